"""gather_all: every awaitable runs, the first inline; the first failure cancels the rest at once."""
import asyncio

import pytest

from wanlink.collectives.base import gather_all


async def hangs(cancelled: list):
    """Wait forever; note in ``cancelled`` that it was cancelled."""
    try:
        await asyncio.Event().wait()
    except asyncio.CancelledError:
        cancelled.append(True)
        raise


def test_all_run_and_the_first_starts_first():
    started = []

    async def job(name):
        started.append(name)
        await asyncio.sleep(0)
        return name

    async def main():
        await gather_all([job("a"), job("b"), job("c")])
        return asyncio.current_task().cancelling()

    assert asyncio.run(main()) == 0
    assert started == ["a", "b", "c"]


def test_a_failing_task_cancels_the_one_running_inline_at_once_and_is_what_is_raised():
    events, ticks = [], []

    async def inline():
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            events.append(("inline cancelled", len(ticks)))
            raise

    async def fails():
        await asyncio.sleep(0)
        raise KeyError("rank 2 lost")

    async def ticking():  # counts loop iterations until it is cancelled
        try:
            while True:
                ticks.append(None)
                await asyncio.sleep(0)
        except asyncio.CancelledError:
            events.append(("sibling cancelled", len(ticks)))
            raise

    async def main():
        with pytest.raises(KeyError, match="rank 2 lost"):
            async with asyncio.timeout(60):  # the failure, not the timeout, ends it
                await gather_all([inline(), fails(), ticking()])
        assert asyncio.current_task().cancelling() == 0, "the caller is left cancelled"
        await asyncio.sleep(0)  # and can go on awaiting

    asyncio.run(main())
    assert sorted(name for name, _ in events) == ["inline cancelled", "sibling cancelled"]
    assert all(seen < 5 for _, seen in events), f"not cancelled at once: {events} loop iterations"


def test_the_inline_one_failing_cancels_the_tasks():
    cancelled = []

    async def inline():
        await asyncio.sleep(0)
        raise ValueError("bad size")

    async def main():
        with pytest.raises(ValueError, match="bad size"):
            await gather_all([inline(), hangs(cancelled), hangs(cancelled)])

    asyncio.run(main())
    assert cancelled == [True, True]


def test_a_timeout_around_it_cancels_everything_and_reads_as_a_timeout():
    cancelled = []

    async def main():
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.01):
                await gather_all([hangs(cancelled), hangs(cancelled), hangs(cancelled)])
        assert asyncio.current_task().cancelling() == 0

    asyncio.run(main())
    assert cancelled == [True, True, True]
