"""The process's event-loop thread: futures for synchronous callers, clean shutdown, no leaks."""
import asyncio
import os
import subprocess
import sys
import threading

import pytest

import wanlink
from wanlink.errors import DeadlineExceeded
from wanlink.io.runtime import Runtime, get_runtime, shutdown_runtime
from tests.support.links import open_pair


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def wanlink_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "wanlink-io"]


async def _transfer():
    pair = await open_pair(4)
    out = bytearray(3_000_000)
    await asyncio.gather(pair.client.send(b"z" * len(out), tag=1), pair.accepted.recv_into(out, tag=1))
    await pair.close()
    return bytes(out)


def test_synchronous_transfer_then_clean_shutdown_leaks_nothing():
    get_runtime().run(_transfer(), timeout=30)  # warm-up: libuv keeps one process-wide signal pipe
    shutdown_runtime()
    fds_before = open_fds()
    threads_before = threading.active_count()
    runtime = get_runtime()
    assert get_runtime() is runtime and len(wanlink_threads()) == 1
    future = runtime.submit(_transfer())
    assert future.result(30) == b"z" * 3_000_000
    shutdown_runtime()
    assert wanlink_threads() == []
    assert threading.active_count() == threads_before
    assert open_fds() == fds_before


def test_shutdown_with_open_links_cancels_and_closes_everything():
    get_runtime().run(_transfer(), timeout=30)
    shutdown_runtime()
    fds_before = open_fds()
    runtime = get_runtime()
    pair = runtime.run(open_pair(2), timeout=30)
    pending = runtime.submit(pair.client.recv_into(bytearray(10), tag=1))
    shutdown_runtime()
    assert pending.cancelled() or pending.exception() is not None
    assert not runtime.running and wanlink_threads() == []
    assert pair.client.closed and pair.accepted.closed
    assert open_fds() == fds_before  # links and server the application never closed were closed


def test_run_times_out_with_deadline_exceeded():
    runtime = Runtime()
    try:
        with pytest.raises(DeadlineExceeded):
            runtime.run(asyncio.sleep(10), timeout=0.1)
        assert runtime.run(asyncio.sleep(0, result=5)) == 5
    finally:
        runtime.close()
    assert not runtime.running
    with pytest.raises(RuntimeError, match="shut down"):
        runtime.submit(asyncio.sleep(0))


def test_run_from_the_loop_thread_is_refused():
    runtime = Runtime()
    try:
        async def nested():
            return runtime.run(asyncio.sleep(0))

        with pytest.raises(RuntimeError, match="deadlock"):
            runtime.run(nested(), timeout=5)
    finally:
        runtime.close()


def test_public_api_is_importable_lazily():
    assert callable(wanlink.connect) and callable(wanlink.serve) and callable(wanlink.stats)
    with pytest.raises(AttributeError):
        _ = wanlink.not_a_thing


_EXIT_PROGRAM = """
import asyncio, atexit, threading, time
from wanlink.io.runtime import get_runtime

def late_worker():  # a non-daemon thread still using the runtime after the main thread ended
    time.sleep(0.5)
    print("worker", get_runtime().run(asyncio.sleep(0, result=7), timeout=10), flush=True)

get_runtime()
threading.Thread(target=late_worker).start()
# registered after wanlink, as torch's handlers are: atexit runs it before wanlink's own handlers
atexit.register(lambda: print("loop thread alive at atexit:",
                              any(t.name == "wanlink-io" for t in threading.enumerate()), flush=True))
"""


def test_loop_thread_is_stopped_before_atexit_handlers_and_after_non_daemon_threads():
    """The runtime stops after the application's threads end but before any atexit handler runs, so
    the daemon loop thread is never inside a (torch) op while the interpreter finalizes."""
    done = subprocess.run([sys.executable, "-c", _EXIT_PROGRAM], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["worker 7", "loop thread alive at atexit: False"], done.stdout


_FAILING_EXIT_PROGRAM = """
import concurrent.futures, threading, time
import wanlink.io.runtime as runtime

def refuse():
    raise OSError("a link would not close")

runtime.shutdown_runtime = refuse
pool = concurrent.futures.ThreadPoolExecutor(1)  # its worker, started from a daemon thread, is a daemon
starter = threading.Thread(target=lambda: pool.submit(lambda: (time.sleep(1), print("completed", flush=True))),
                           daemon=True)
starter.start()
starter.join()
"""


def test_a_runtime_that_fails_to_stop_at_exit_leaves_the_later_exit_hooks_running():
    """The exit hook logs its failure and lets concurrent.futures' own hook run after it: the
    completion pool's daemon worker (wanlink.c10d.work) is joined, not killed inside a torch
    future's callbacks as the interpreter finalizes."""
    done = subprocess.run([sys.executable, "-c", _FAILING_EXIT_PROGRAM], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["completed"], (done.stdout, done.stderr)
    assert "stopping the runtime at exit failed" in done.stderr and "a link would not close" in done.stderr
