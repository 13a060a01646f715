"""WanlinkWork told by its coroutine on the loop thread (Runtime.start), or by its task's end."""
import asyncio

import pytest
import torch

from wanlink.c10d.work import WanlinkWork
from wanlink.errors import DeadlineExceeded
from wanlink.io.runtime import Runtime


@pytest.fixture
def runtime():
    runtime = Runtime()
    yield runtime
    runtime.close()


def test_a_coroutine_that_tells_its_work_completes_wait_future_and_source(runtime):
    outputs = [torch.ones(2)]
    work = WanlinkWork("recv", outputs, reports_source=True, label="wanlink recv peer 3 tag 0")
    release = asyncio.Event()

    async def body():
        await release.wait()
        work.succeed(3)

    runtime.start(body(), work.task_done)
    future = work.get_future()  # asked for before the end: completed on the completion thread
    with pytest.raises(DeadlineExceeded, match="wanlink recv peer 3 tag 0: Work.wait timed out after 0.01 s"):
        work.wait(0.01)
    assert not work.is_completed()
    runtime.loop.call_soon_threadsafe(release.set)
    assert work.wait(30) and work.is_completed() and work.is_success()
    assert work._source_rank() == 3
    assert torch.equal(future.wait()[0], outputs[0])


def test_a_failure_told_by_the_coroutine_is_raised_by_wait_and_the_future(runtime):
    work = WanlinkWork("all_reduce", [torch.ones(1)], label="wanlink all_reduce #4")

    async def body():
        work.fail(KeyError("rank 1 lost"))

    runtime.start(body(), work.task_done)
    with pytest.raises(KeyError, match="rank 1 lost"):
        work.wait(30)
    assert work.is_completed() and not work.is_success()
    with pytest.raises(Exception, match="rank 1 lost"):
        work.get_future().wait()  # asked for after the end: completed at once


def test_a_task_that_ends_without_telling_its_work_still_ends_it_as_cancelled():
    runtime = Runtime()
    work = WanlinkWork("barrier", [], label="wanlink barrier #0")

    async def forever():  # never tells the Work: only the task's end can
        await asyncio.Event().wait()

    runtime.start(forever(), work.task_done)
    runtime.close()  # cancels every task
    with pytest.raises(RuntimeError, match="wanlink barrier #0 was cancelled"):
        work.wait(30)


def test_start_on_a_closed_runtime_is_refused_and_closes_the_coroutine():
    runtime = Runtime()
    runtime.close()

    async def body():
        pass

    coro = body()
    with pytest.raises(RuntimeError, match="runtime is shut down"):
        runtime.start(coro, lambda task: None)
    assert coro.cr_frame is None  # closed: no "never awaited" warning
