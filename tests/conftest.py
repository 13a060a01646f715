"""Shared test fixtures.

Every asyncio test runs twice, on the stdlib loop and on uvloop, and fails when the loop saw an
exception nobody handled (a task that died silently, a callback that raised).

Without torch (CI runs the suite so on every Python version pyproject claims besides 3.11), the
tests that need it are left out: the wire, scheduling, transport, probing and iperf tests remain.
"""
import asyncio
import gc
import importlib.util
import os

import pytest

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is a Linux dependency
    uvloop = None

NEEDS_TORCH = ["c10d", "kernels", "test_docs.py", "test_examples.py", "test_packaging.py",
               "bench/test_chaos.py", "bench/test_fidelity_schedule.py",
               "bench/test_fidelity_summary.py", "plan/test_predict_busy.py"]
collect_ignore = NEEDS_TORCH if importlib.util.find_spec("torch") is None else []

# Child processes (ranks, servers) print every thread's Python stack if they die of a signal
# (SIGABRT, SIGSEGV), so that a crash seen once under CI's load says where it happened.
os.environ.setdefault("PYTHONFAULTHANDLER", "1")

_unhandled_loop_errors: list[dict] = []


def _record_unhandled(loop, context):
    _unhandled_loop_errors.append(context)


def _guarded(factory):
    def make_loop():
        loop = factory()
        loop.set_exception_handler(_record_unhandled)
        return loop

    return make_loop


def pytest_asyncio_loop_factories(config, item):
    factories = {"asyncio": _guarded(asyncio.new_event_loop)}
    if uvloop is not None:
        factories["uvloop"] = _guarded(uvloop.new_event_loop)
    return factories


@pytest.fixture(autouse=True)
def fail_on_unhandled_loop_exception(request):
    _unhandled_loop_errors.clear()
    yield
    if request.node.get_closest_marker("asyncio") is None:
        return  # no event loop of the test's own: nothing to collect (gc.collect costs ~0.1 s with torch)
    gc.collect()  # "Task exception was never retrieved" is reported when the task is collected
    if _unhandled_loop_errors:
        messages = [ctx.get("message", "") + ": " + repr(ctx.get("exception")) for ctx in _unhandled_loop_errors]
        _unhandled_loop_errors.clear()
        pytest.fail("unhandled event-loop exception(s): " + "; ".join(messages))
