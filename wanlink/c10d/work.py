"""Work objects that torch.distributed hands back for ``async_op=True`` calls."""
from __future__ import annotations

import _thread
import asyncio
import concurrent.futures
import threading
from datetime import timedelta

import torch
from torch._C._distributed_c10d import Work

from wanlink.errors import DeadlineExceeded

_completions = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="wanlink-complete")
"""Completes torch futures off the I/O thread, so user ``then`` callbacks never stall the links."""


class WanlinkWork(Work):
    """Finishes when its collective's coroutine does; ``get_future()`` yields the output tensors.

    A receive's coroutine returns the sender's group rank, which ``_source_rank()`` reports.
    """

    def __init__(self, op: str, outputs: list, reports_source: bool = False, label: object = None):
        super().__init__()
        self.op = op
        self.label = label or f"wanlink {op}"  # what error messages call it (op, sequence, group): str() of it
        self._outputs = outputs
        self._reports_source = reports_source
        self._source = -1
        self._future: torch.futures.Future | None = None  # made by the first get_future()
        self._future_lock = threading.Lock()
        self._finished = False
        self._done = _thread.allocate_lock()  # held until finished: waiters block on it (one futex, no
        self._done.acquire()  # Condition: threading.Event would cost both threads ~20 Python calls per op)
        self._error: BaseException | None = None

    # -- told by the collective's coroutine, on the I/O thread --------------------------------
    def succeed(self, result) -> None:
        """The collective finished; ``result`` is a receive's source rank (ignored otherwise)."""
        if self._reports_source:
            self._source = result
        self._finish()

    def fail(self, error: BaseException) -> None:
        """The collective failed with ``error`` (a cancellation reads as a RuntimeError naming it)."""
        if isinstance(error, asyncio.CancelledError):
            error = RuntimeError(f"{self.label} was cancelled")
        self._error = error
        self._finish()

    def task_done(self, task: asyncio.Task) -> None:
        """The task's done callback: tells the Work what its coroutine could not, as when the task
        was cancelled before the coroutine began (runtime shutdown)."""
        if self._finished:
            return
        if task.cancelled():
            self.fail(asyncio.CancelledError())
        elif task.exception() is not None:
            self.fail(task.exception())
        else:
            self.succeed(task.result())

    def _finish(self) -> None:
        """Release ``wait()`` at once; the torch future, if anyone asked for it (its ``then``
        callbacks run inline), is completed on the completion thread. A plain ``wait()`` wakes no
        third thread to compete with it for the GIL."""
        with self._future_lock:
            if self._finished:
                return
            self._finished = True
            self._done.release()
            wanted = self._future is not None
        if wanted:
            _completions.submit(self._complete_future, self._future)

    def _complete_future(self, future: torch.futures.Future) -> None:
        if self._error is not None:
            future.set_exception(self._error)
        else:
            future.set_result(self._outputs)

    def wait(self, timeout: timedelta | float | None = None) -> bool:
        """Block until done; re-raise the collective's error; DeadlineExceeded after ``timeout``.

        As torch's ``Work.wait``, no timeout or a zero one waits for as long as the collective runs
        (the collective's own timeout bounds that).
        """
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
        if not self._finished and not self._wait_done(seconds if seconds and seconds > 0 else -1):
            raise DeadlineExceeded(f"{self.label}: Work.wait timed out after {seconds:g} s "
                                   f"(the collective goes on, bounded by its own timeout)")
        if self._error is not None:
            raise self._error
        return True

    def _wait_done(self, seconds: float) -> bool:
        """Block until finished or ``seconds`` passed (-1: no limit); True when finished."""
        if not self._done.acquire(timeout=seconds):
            return False
        self._done.release()  # (let any other waiter through too)
        return True

    def get_future(self) -> torch.futures.Future:
        with self._future_lock:
            if self._future is not None:
                return self._future
            self._future = future = torch.futures.Future()
            finished = self._finished
        if finished:  # nothing can have a callback on it yet: complete it here
            self._complete_future(future)
        return future

    def is_completed(self) -> bool:
        return self._finished

    def is_success(self) -> bool:
        return self._finished and self._error is None

    def exception(self):
        return self._error

    def result(self) -> list:
        self.wait()
        return self._outputs

    def synchronize(self) -> None:
        self.wait()

    def _source_rank(self) -> int:
        """The group rank a finished receive came from (-1 until it finished), as torch's recv reads it."""
        if not self._reports_source:
            raise RuntimeError(f"wanlink {self.op}: only a recv's Work has a source rank")
        return self._source

    source_rank = _source_rank
