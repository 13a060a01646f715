"""The process's one event-loop thread, for synchronous callers (torch backend, trainers)."""
from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import logging
import sys
import threading
import traceback

from wanlink.errors import DeadlineExceeded


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop when importable, the stdlib loop otherwise."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class Runtime:
    """Runs one event loop in a daemon thread; coroutines are submitted from any thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None):
        self.loop = loop or new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name="wanlink-io", daemon=True)
        self._thread.start()
        self._started.wait()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._started.set)
        self.loop.run_forever()

    @property
    def thread(self) -> threading.Thread:
        """The loop's thread (bench/collectives.py --count reads its CPU time and context switches)."""
        return self._thread

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def submit(self, coro) -> concurrent.futures.Future:
        """Schedule ``coro`` on the loop thread; returns a concurrent.futures.Future."""
        if not self.running:
            coro.close()
            raise RuntimeError("the wanlink runtime is shut down")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def start(self, coro, done) -> None:
        """Run ``coro`` as a task on the loop thread and call ``done(task)`` there when it ends.

        Cheaper than ``submit`` for callers that are told of the outcome by ``coro`` itself: no
        concurrent Future, no chained callbacks, no locks taken on the loop thread.
        """
        if not self.running:
            coro.close()
            raise RuntimeError("the wanlink runtime is shut down")
        try:
            self.loop.call_soon_threadsafe(self._start, coro, done)
        except RuntimeError:  # the loop closed meanwhile
            coro.close()
            raise

    def _start(self, coro, done) -> None:
        self.loop.create_task(coro).add_done_callback(done)

    def run(self, coro, timeout: float | None = None):
        """Run ``coro`` on the loop thread and wait; DeadlineExceeded (and cancellation) on timeout."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("Runtime.run() called from the loop thread would deadlock; await instead")
        future = self.submit(coro)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise DeadlineExceeded(f"operation did not finish within {timeout} s") from None

    def close(self, timeout: float = 10.0) -> None:
        """Cancel every task, close the loop and join the thread."""
        if not self.running:
            return

        async def cancel_all():
            from wanlink.io.registry import close_all_on

            await close_all_on(self.loop)
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.loop.shutdown_asyncgens()
            await self.loop.shutdown_default_executor()

        try:
            asyncio.run_coroutine_threadsafe(cancel_all(), self.loop).result(timeout)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout)
            if self._thread.is_alive():
                logging.getLogger(__name__).warning(
                    "wanlink: the event-loop thread did not stop within %g s of the runtime's close", timeout)
            else:
                self.loop.close()


_runtime: Runtime | None = None
_runtime_lock = threading.Lock()


def get_runtime() -> Runtime:
    """The process-wide runtime, started on first use."""
    global _runtime
    with _runtime_lock:
        if _runtime is None or not _runtime.running:
            _runtime = Runtime()
        return _runtime


def shutdown_runtime() -> None:
    """Stop the process-wide runtime (idempotent); a later get_runtime() starts a new one."""
    global _runtime
    with _runtime_lock:
        runtime, _runtime = _runtime, None
    if runtime is not None:
        runtime.close()


def _shutdown_at_exit() -> None:
    """Stop the runtime once the main thread ended and every other non-daemon thread (which may still
    use it) finished, before the interpreter finalizes."""
    for thread in threading.enumerate():
        if not thread.daemon and thread is not threading.current_thread():
            thread.join()
    try:
        shutdown_runtime()
    except Exception:  # noqa: BLE001 - an error here must not skip the exit hooks after this one;
        print("wanlink: stopping the runtime at exit failed:", file=sys.stderr)  # stderr: no logging
        traceback.print_exc()  # is configured this late, and wanlink's logger has only a NullHandler


# A threading exit hook, not a plain atexit handler: threading's hooks run when the main thread ends,
# before every atexit handler (torch's among them, which may tear down what a reduction on the loop
# thread uses). A daemon loop thread still inside a torch op when finalization starts is killed as
# it retakes the GIL, and the process aborts (SIGABRT) instead of exiting.
getattr(threading, "_register_atexit", atexit.register)(_shutdown_at_exit)
