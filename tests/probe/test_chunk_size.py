"""choose_chunk_size: powers of two within the transport's bounds, by CPU floor and preemption cap."""
import pytest

from wanlink.errors import ConfigError
from wanlink.probe.chunk import MAX_CHUNK, MIN_CHUNK, choose_chunk_size
from wanlink.sched.chunking import chunk_size_from


@pytest.mark.parametrize("rate", [0, 1e3, 1e6, 3.75e7, 1.25e8, 1.25e9, 1e11])
@pytest.mark.parametrize("streams", [1, 8, 64])
@pytest.mark.parametrize("rtt", [0.0, 1e-4, 0.04, 0.2])
def test_always_a_valid_transport_chunk_size(rate, streams, rtt):
    size = choose_chunk_size(rate, streams, rtt)
    assert MIN_CHUNK <= size <= MAX_CHUNK and size & (size - 1) == 0
    assert chunk_size_from(size) == size


def test_faster_links_get_larger_chunks():
    sizes = [choose_chunk_size(rate, 4, 0.04) for rate in (1e6, 1e7, 1e8, 1e9)]
    assert sizes == sorted(sizes) and sizes[0] < sizes[-1]


def test_cpu_floor_wins_over_preemption_cap():
    # 10 Gbit/s over 64 streams on a 1 ms path: preemption wants tiny chunks, the event loop cannot
    size = choose_chunk_size(1.25e9, 64, 0.001, per_chunk_cost_s=20e-6, max_overhead=0.02)
    assert size >= 1.25e9 * 20e-6 / 0.02 / 1.5


def test_preemption_caps_chunks_on_slow_streams():
    assert choose_chunk_size(1.25e7, 16, 0.04) == MIN_CHUNK


@pytest.mark.parametrize("args", [(-1, 1, 0.0), (1.0, 0, 0.0), (1.0, 1, -1.0), (float("nan"), 1, 0.0)])
def test_bad_arguments(args):
    with pytest.raises(ConfigError):
        choose_chunk_size(*args)
