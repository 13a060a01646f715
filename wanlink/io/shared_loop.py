"""An event loop that its I/O thread runs and that a thread blocked on it may run instead, in turn.

A synchronous caller of the runtime (a torch collective, ``Runtime.run``) used to hand its
coroutine to the I/O thread and sleep until the loop thread handed the result back: two thread
wake-ups and two GIL transfers per call, each 0.1-0.25 ms on a loaded host, more than a 64 KiB
message takes on the wire. Here the loop has a *baton* (a lock) held by whichever thread runs its
callbacks. The I/O thread lets go of it while it waits in ``select``; a caller that finds it free
runs the loop itself, in its own thread: it starts its coroutine there (``start``) and, when it
blocks on the result, runs the loop until the result is in (``drive``). The bytes then go out and
come in on the caller's thread, with no hand-off on the way in or back. Everything else on the loop
(other links' reads and writes, acks, pings, timers, work other threads submitted) runs as usual,
in whichever thread holds the baton; only one thread ever runs callbacks.

The I/O thread still wakes when a socket becomes readable while a caller runs the loop (both wait
in the same epoll); it then waits for the baton and, once it has it, polls again (what it saw may
have been handled meanwhile). A caller that lets go of the baton wakes the I/O thread only when
it left work due before the I/O thread's own wake-up (ready callbacks, an earlier timer).

While the main thread runs the loop, SIGINT (Ctrl-C) with Python's default handler is deferred
to the end of the callback in progress, so a KeyboardInterrupt never breaks a link's bookkeeping
half-way; it is raised at once from ``drive`` and the interrupted call goes on in the background.
"""
from __future__ import annotations

import asyncio
import heapq
import math
import selectors
import signal
import threading
import time
from typing import Callable

START_STEPS = 32
"""Most loop iterations ``start`` runs in the caller (it stops earlier once nothing is ready)."""


class _BatonSelector(selectors.BaseSelector):
    """The loop's selector: the I/O thread lets go of the baton while it waits in ``select``."""

    def __init__(self, loop: SharedLoop):
        self._inner = selectors.DefaultSelector()
        self._loop = loop

    def register(self, fileobj, events, data=None):
        return self._inner.register(fileobj, events, data)

    def unregister(self, fileobj):
        return self._inner.unregister(fileobj)

    def modify(self, fileobj, events, data=None):
        return self._inner.modify(fileobj, events, data)

    def select(self, timeout=None):
        loop = self._loop
        if threading.get_ident() != loop.io_thread:  # a caller running the loop keeps the baton throughout
            return self._inner.select(timeout)
        generation = loop.generation
        loop.io_wake_at = math.inf if timeout is None else loop.time() + timeout
        loop.let_go()
        try:
            events = self._inner.select(timeout)
        finally:
            loop.baton.acquire()
        if loop.generation != generation:  # a caller ran the loop meanwhile: these may be handled already
            events = self._inner.select(0)
        return events

    def close(self):
        self._inner.close()

    def get_key(self, fileobj):
        return self._inner.get_key(fileobj)

    def get_map(self):
        return self._inner.get_map()


class SharedLoop(asyncio.SelectorEventLoop):
    """See the module docstring. The I/O thread runs ``run_io_thread``; other threads ``start`` and ``drive``."""

    def __init__(self):
        self.baton = threading.Lock()
        self.generation = 0  # bumped each time a caller takes the baton
        self.io_thread: int | None = None
        self.io_wake_at = math.inf  # when the I/O thread's select returns at the latest (loop.time())
        self._waiters: set[threading.Event] = set()
        self._interrupted = False
        super().__init__(_BatonSelector(self))

    def run_io_thread(self) -> None:
        """``run_forever`` for the loop's own thread, holding the baton except while it selects."""
        self.io_thread = threading.get_ident()
        with self.baton:
            self.run_forever()

    def let_go(self) -> None:
        """Release the baton; wake the I/O thread if work is due before it would wake by itself; tell
        the threads waiting for the baton (``waiting``)."""
        if threading.get_ident() != self.io_thread:
            scheduled = self._scheduled
            while scheduled and scheduled[0]._cancelled:  # as _run_once does: the head decides the wake-up
                self._timer_cancelled_count -= 1
                heapq.heappop(scheduled)._scheduled = False
            wake = self._ready or self._stopping or (scheduled and scheduled[0]._when < self.io_wake_at)
        else:
            wake = False
        self.baton.release()
        if wake:
            self._write_to_self()
        for event in list(self._waiters):
            event.set()

    def waiting(self, event: threading.Event) -> _Waiting:
        """While in this context, ``event`` is set each time a thread lets go of the baton."""
        return _Waiting(self._waiters, event)

    def _take(self) -> bool:
        """Take the baton for this (non-loop) thread, if it is free and this thread may run the loop."""
        if self._stopping or self.is_closed() or self.io_thread is None or asyncio._get_running_loop() is not None:
            return False  # (a thread inside another loop, or inside this one's callbacks, only waits)
        if not self.baton.acquire(blocking=False):
            return False
        self.generation += 1
        asyncio._set_running_loop(self)
        return True

    def _give_back(self) -> None:
        asyncio._set_running_loop(None)
        self.let_go()

    def start(self, coro, future) -> bool:
        """Run ``coro`` as a task whose outcome goes to the concurrent ``future``, starting it in this
        thread when the baton is free (until it waits for I/O, at most START_STEPS iterations);
        False (``coro`` untouched) when it is not: submit it to the loop thread instead."""
        if not self._take():
            return False
        try:
            with _SigintDeferred(self):
                task = self.create_task(coro)
                asyncio.futures._chain_future(task, future)  # what run_coroutine_threadsafe does
                for _ in range(START_STEPS):
                    if not self._ready or task.done():
                        break
                    self._step()
        finally:
            self._give_back()
        return True

    def drive(self, done: Callable[[], bool], end: float | None = None) -> bool:
        """Run the loop in this thread until ``done()`` or ``end`` (time.monotonic()), if the baton is
        free; False at once when it is not (the caller then waits on the loop thread as before)."""
        if not self._take():
            return False
        timer = None if end is None else self.call_later(max(0.0, end - time.monotonic()), _nothing)
        try:
            with _SigintDeferred(self):
                while not done() and not self._stopping and (end is None or time.monotonic() < end):
                    self._step()
        finally:
            if timer is not None:
                timer.cancel()
            self._give_back()
        return True

    def _step(self) -> None:
        self._run_once()
        if self._interrupted:
            self._interrupted = False
            raise KeyboardInterrupt

    def _check_thread(self) -> None:
        """(Debug mode's check that callbacks are scheduled from the thread running the loop.)"""
        if asyncio._get_running_loop() is not self:
            super()._check_thread()

    def _defer_sigint(self, _signum, _frame) -> None:
        self._interrupted = True
        self._write_to_self()  # ends the select in progress


def _nothing() -> None:
    """A timer that only ends the driving thread's select at its deadline."""


class _Waiting:
    def __init__(self, waiters: set, event: threading.Event):
        self.waiters, self.event = waiters, event

    def __enter__(self):
        self.waiters.add(self.event)

    def __exit__(self, *_):
        self.waiters.discard(self.event)


class _SigintDeferred:
    """In the main thread with Python's default SIGINT handler: Ctrl-C is noted, the select in
    progress ends, and KeyboardInterrupt is raised between two loop iterations (``SharedLoop._step``)."""

    def __init__(self, loop: SharedLoop):
        self.loop = loop
        self.swapped = (threading.current_thread() is threading.main_thread()
                        and signal.getsignal(signal.SIGINT) is signal.default_int_handler)

    def __enter__(self):
        if self.swapped:
            signal.signal(signal.SIGINT, self.loop._defer_sigint)

    def __exit__(self, *_):
        if self.swapped:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            if self.loop._interrupted:  # arrived after the last iteration
                self.loop._interrupted = False
                raise KeyboardInterrupt
