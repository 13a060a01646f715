"""Coarse and fine models against hand-computed cases."""
import math

import pytest

from wanlink.errors import ConfigError
from wanlink.plan import Bucket, Choice, Profile, cluster_from_dict, coarse, simulate
from wanlink.plan.simulate import _Flow, allocate
from wanlink.plan.topology import Network, Transfer, flat_collective, sparse_message_bytes

MB = 1e6


def two_sites(ranks=(1, 1), rtt="40 ms", rate="80 Mbit/s", window="100 MB", streams=8, chunk="1 MB",
              overhead="0 ms", **extra):
    sites = [{"name": "a", "ranks": ranks[0], **extra.get("a", {})}, {"name": "b", "ranks": ranks[1]}]
    return cluster_from_dict({
        "defaults": {"window": window, "streams": streams, "efficiency": 1.0, "chunk": chunk,
                     "lan_rate": extra.get("lan_rate", "80 Gbit/s"), "send_overhead": overhead},
        "site": sites, "path": [{"sites": ["a", "b"], "rtt": rtt, "rate": rate}]})


def profile(buckets=((4_000_000, 0.02),), forward=0.01, backward=0.02, step=0.005):
    return Profile("test", 32, forward, backward, step,
                   tuple(Bucket(int(nbytes), ready, (int(nbytes) // 4,)) for nbytes, ready in buckets))


def test_two_rank_all_reduce_by_hand():
    # 4 MB all-reduce between two ranks, one piece (wanlink goes direct: a ring could not pipeline
    # it): each sends the other its 4 MB at 10 MB/s = 0.4 s, then one one-way delay of 20 ms; no
    # acknowledgement (a send ends once written, a member's part once its peer's bytes arrived)
    cluster, prof = two_sites(), profile()
    expected = 0.01 + max(0.02, 0.02 + 0.4 + 0.02) + 0.005
    assert simulate(cluster, prof).iteration_s == pytest.approx(expected)
    assert coarse(cluster, prof).iteration_s == pytest.approx(expected)
    # 8 MB, two pieces: the ring, each rank sends 4 MB twice (reduce-scatter, all-gather) = 0.8 s,
    # and 2 one-way delays
    ring = profile(buckets=((8_000_000, 0.02),))
    expected = 0.01 + 0.02 + 0.8 + 0.04 + 0.005
    assert simulate(cluster, ring).iteration_s == pytest.approx(expected)
    assert coarse(cluster, ring).iteration_s == pytest.approx(expected)


def test_send_overhead_adds_to_every_wan_step():
    # the two ring steps (8 MB: two pieces) each take 5 ms more, the direct exchange's one step too
    for nbytes, steps in ((8_000_000, 2), (4_000_000, 1)):
        prof = profile(buckets=((nbytes, 0.02),))
        base = simulate(two_sites(), prof).iteration_s
        assert simulate(two_sites(overhead="5 ms"), prof).iteration_s == pytest.approx(base + 0.005 * steps)
        assert coarse(two_sites(overhead="5 ms"), prof).iteration_s == pytest.approx(base + 0.005 * steps)


def test_window_limited_single_stream_by_hand():
    # one stream, 1 MB window, 100 ms RTT, a 4 MB direct exchange: the first window leaves at line
    # rate (100 MB/s), the other 3 MB at 1 MB per RTT = 10 MB/s; plus its one-way delay of 50 ms
    cluster = two_sites(rtt="100 ms", rate="800 Mbit/s", window="1 MB", streams=1)
    prof = profile(buckets=((4_000_000, 0.0),), forward=0.0, backward=0.0, step=0.0)
    expected = 1 / 100 + 3 / 10 + 0.05
    assert simulate(cluster, prof).iteration_s == pytest.approx(expected)
    assert coarse(cluster, prof).iteration_s == pytest.approx(expected)
    # two streams carry the 1 MB chunks two at a time: twice the windowed rate
    striped = two_sites(rtt="100 ms", rate="800 Mbit/s", window="1 MB", streams=2)
    assert simulate(striped, prof).iteration_s == pytest.approx(2 / 100 + 2 / 20 + 0.05)


def test_more_streams_than_chunks_do_not_help():
    cluster = two_sites(rtt="100 ms", rate="8 Gbit/s", window="0.25 MB", streams=4)
    many = two_sites(rtt="100 ms", rate="8 Gbit/s", window="0.25 MB", streams=16)
    prof = profile(buckets=((8_000_000, 0.0),), forward=0.0, backward=0.0, step=0.0)
    # the ring's 4 MB sends (8 MB: two pieces) in 1 MB chunks keep at most 4 streams busy
    assert simulate(cluster, prof).iteration_s == pytest.approx(simulate(many, prof).iteration_s)


def test_staleness_one_hides_communication_up_to_compute():
    cluster = two_sites()
    comm_bound = profile()
    # the link never idles: the period is the exchange's sending time (0.4 s), its delays overlap the
    # next exchange
    assert simulate(cluster, comm_bound, Choice(staleness=1), iterations=8).iteration_s == pytest.approx(0.4)
    assert coarse(cluster, comm_bound, Choice(staleness=1)).iteration_s == pytest.approx(0.4)
    # a small exchange on a long path: two steps per chain of forward, backward to the bucket, its
    # 4 ms of sending, the exchange's one-way delay (one hop) and the step
    latency_bound = profile(buckets=((40_000, 0.02),), forward=0.01, backward=0.02, step=0.005)
    far = two_sites(rtt="80 ms")
    chain = 0.01 + 0.02 + 0.004 + 0.04 + 0.005
    assert simulate(far, latency_bound, Choice(staleness=1), iterations=8).iteration_s == pytest.approx(chain / 2)
    assert coarse(far, latency_bound, Choice(staleness=1)).iteration_s == pytest.approx(chain / 2)
    compute_bound = profile(buckets=((40_000, 0.02),), forward=0.3, backward=0.2, step=0.1)
    assert simulate(cluster, compute_bound, Choice(staleness=1), iterations=6).iteration_s == pytest.approx(0.6)
    assert coarse(cluster, compute_bound, Choice(staleness=1)).iteration_s == pytest.approx(0.6)


def test_sparse_message_size_matches_the_codec():
    pytest.importorskip("torch")
    from wanlink.compress import encoded_size
    from wanlink.compress.sparsifier import target_blocks

    for numel, density in [(1_000_000, 0.01), (1000, 0.5), (17, 0.01), (262_144, 0.001)]:
        blocks = -(-numel // 16)
        assert sparse_message_bytes([numel], density) == encoded_size(target_blocks(density, blocks), 16)


def test_sparse_direct_exchange_by_hand():
    # density 1 % of 1e6 floats: 625 blocks; one direct exchange costs its bytes plus one one-way delay
    cluster = two_sites()
    prof = profile(buckets=((4_000_000, 0.02),))
    message = sparse_message_bytes([1_000_000], 0.01)
    expected = 0.01 + 0.02 + message / 10e6 + 0.02 + 0.005
    assert simulate(cluster, prof, Choice(density=0.01)).iteration_s == pytest.approx(expected)


def test_edf_sends_the_first_layers_bucket_first():
    cluster = two_sites()
    prof = profile(buckets=((4_000_000, 0.02), (4_000_000, 0.02)), backward=0.02)

    def end_of(result, bucket):
        return max(s[4] for s in result.segments if s[0] == "comm" and s[1] == f"bucket {bucket}" and s[2] == 0)

    fcfs, edf = simulate(cluster, prof, Choice(order="fcfs")), simulate(cluster, prof, Choice(order="edf"))
    assert end_of(fcfs, 0) < end_of(fcfs, 1)
    assert end_of(edf, 1) < end_of(edf, 0)
    # with DDP's step after every bucket, the order does not change the iteration
    assert fcfs.iteration_s == pytest.approx(edf.iteration_s)


def test_ring_of_four_over_two_sites_shares_the_wan_link():
    # ranks a0 a1 | b0 b1: the ring crosses the WAN once each way; 3/2 x 4 MB per edge at 10 MB/s
    cluster = two_sites(ranks=(2, 2))
    prof = profile(buckets=((4_000_000, 0.0),), forward=0.0, backward=0.0, step=0.0)
    result = simulate(cluster, prof)
    # 6 ring steps alternate LAN (no delay) and WAN (20 ms) edges: 6 x 10 ms
    assert result.iteration_s == pytest.approx(0.6 + 0.06)
    assert result.wan_bytes == pytest.approx(2 * 6 * MB)


def test_flows_of_one_group_go_in_priority_order_and_groups_share_fairly():
    capacity = {"wan": 10.0}
    first = _Flow(Transfer(100, {"wan": 1}, math.inf, 0.0, ("g",)), (0,), None)
    second = _Flow(Transfer(100, {"wan": 1}, math.inf, 0.0, ("g",)), (1,), None)
    allocate([second, first], capacity)
    assert (first.rate, second.rate) == (10.0, 0.0)
    capped = _Flow(Transfer(100, {"wan": 1}, 4.0, 0.0, ("g",), free_bytes=0), (0,), None)
    allocate([capped, second], capacity)
    assert (capped.rate, second.rate) == (4.0, 6.0)  # the next one takes what the capped head leaves
    other = _Flow(Transfer(100, {"wan": 1}, math.inf, 0.0, ("h",)), (0,), None)
    allocate([first, second, other], capacity)
    assert (first.rate, second.rate, other.rate) == (5.0, 0.0, 5.0)


def test_site_collective_with_cells_uses_more_hosts_wan_caps():
    # 4 ranks per site, each host capped at 100 Mbit/s, the path at 800: more cells, more hosts carry it
    cluster = two_sites(ranks=(4, 4), rate="800 Mbit/s", a={"host_cap": "100 Mbit/s"})
    prof = profile(buckets=((8_000_000, 0.0),), forward=0.0, backward=0.0, step=0.0)
    one = simulate(cluster, prof, Choice(collective="site", cells=1)).iteration_s
    four = simulate(cluster, prof, Choice(collective="site", cells=4)).iteration_s
    assert four < one / 3
    assert simulate(cluster, prof, Choice(collective="site", cells=4)).iteration_s == pytest.approx(
        coarse(cluster, prof, Choice(collective="site", cells=4)).iteration_s)


def test_coarse_ring_equation_11():
    # K ranks, every bucket ready at the end of backward: T = T_F + T_B + 2(K-1)/K M / B + delays + T_S
    cluster = two_sites(ranks=(2, 2), rtt="1 us")
    prof = profile(buckets=((8_000_000, 0.02),))
    k, m, b = 4, 8e6, 10e6
    assert coarse(cluster, prof).iteration_s == pytest.approx(0.01 + 0.02 + 2 * (k - 1) / k * m / b + 0.005, rel=1e-4)


def test_coarse_parameter_server_equation_10():
    cluster = two_sites(ranks=(1, 2))
    prof = profile(buckets=((1_000_000, 0.02),), forward=0.01, backward=0.02)
    k, m, b = 3, 1e6, 10e6
    expected = max(k * m / b, 0.01) + max((k + 1) * m / (2 * b), 0.02) + 0.005
    assert coarse(cluster, prof, architecture="ps").iteration_s == pytest.approx(expected)


def test_heterogeneous_ranks_wait_for_the_slowest():
    cluster = two_sites(ranks=(1, 1), rate="80 Gbit/s")
    prof = profile(buckets=((4_000, 0.02),))
    even = simulate(cluster, prof).iteration_s
    slow = simulate(cluster, prof, Choice(rank_speeds=(1.0, 0.5))).iteration_s
    assert slow == pytest.approx(even + 0.03 + 0.005, rel=1e-3)  # forward + backward twice as long, step too
    halved = simulate(cluster, prof, Choice(rank_speeds=(1.0, 0.5), batches=(32, 16))).iteration_s
    assert halved == pytest.approx(even + 0.005, rel=1e-3)


def test_deterministic_and_1024_ranks():
    cluster = two_sites(ranks=(512, 512), rate="10 Gbit/s")
    prof = profile(buckets=((1_000_000, 0.005), (4_000_000, 0.02)))
    results = [simulate(cluster, prof, Choice(streams=4)) for _ in range(2)]
    assert results[0].iteration_s == results[1].iteration_s
    assert math.isfinite(results[0].iteration_s) and results[0].iteration_s > prof.compute_s


def test_bad_choices():
    cluster, prof = two_sites(), profile()
    for choice, message in [(Choice(staleness=2), "staleness must be 0 or 1"), (Choice(density=0.0), "density"),
                            (Choice(order="lifo"), "order must be one of"), (Choice(batches=(1,)), "batches has 1"),
                            (Choice(cells=0), "cells must be"), (Choice(collective="tree"), "collective must be")]:
        with pytest.raises(ConfigError, match=message):
            simulate(cluster, prof, choice)
    with pytest.raises(ConfigError, match="architecture"):
        coarse(cluster, prof, architecture="mesh")


def test_one_rank_has_no_communication():
    cluster = cluster_from_dict({"site": [{"name": "a", "ranks": 1}]})
    prof = profile()
    assert simulate(cluster, prof).iteration_s == pytest.approx(prof.compute_s)
    assert flat_collective(Network.of(cluster), 1000, False, "b") == []


def test_concurrent_buckets_share_the_links_windows():
    # one stream, 1 MB window, 100 ms RTT, two 4 MB buckets at once (FCFS): the first's first window
    # leaves at line rate, its other 3 MB at the stream's 10 MB/s; the second finds the link's
    # window in use (no burst) and sends its 4 MB at 10 MB/s after it; then its direct exchange's
    # one-way delay
    cluster = two_sites(rtt="100 ms", rate="800 Mbit/s", window="1 MB", streams=1)
    prof = profile(buckets=((4_000_000, 0.0), (4_000_000, 0.0)), forward=0.0, backward=0.0, step=0.0)
    assert simulate(cluster, prof).iteration_s == pytest.approx(1 / 100 + 3 / 10 + 4 / 10 + 0.05)


def test_coarse_runs_buckets_side_by_side_when_one_cannot_fill_the_link():
    # 16 streams of a 1 MB window at 100 ms RTT: 160 MB/s for the link, 40 MB/s for one bucket's 4 MB
    # sends (4 chunks). Four 8 MB buckets ready at once (two pieces: the ring, 2 steps of 4 MB): side
    # by side they share the link's 160 MB/s, 0.2 s for all, then the 2 steps' one-way delays; one
    # after another they would take 0.8 s
    cluster = two_sites(rtt="100 ms", rate="8 Gbit/s", window="1 MB", streams=16)
    prof = profile(buckets=((8_000_000, 0.0),) * 4, forward=0.0, backward=0.0, step=0.0)
    fine = simulate(cluster, prof).iteration_s
    assert fine == pytest.approx(0.2 + 0.1, rel=0.02)
    assert coarse(cluster, prof).iteration_s == pytest.approx(fine, rel=0.02)


def test_flat_collectives_go_direct_where_wanlinks_ring_would_not_pipeline():
    # wanlink.collectives.choice: a ring of one piece cannot pipeline; wanlink exchanges directly (one hop)
    two, four = Network.of(two_sites()), Network.of(two_sites(ranks=(2, 2)))
    hop = 0.02  # 40 ms RTT

    def hops(net, nbytes, sparse):
        (transfer,), = flat_collective(net, nbytes, sparse, "b")
        return round(transfer.latency_s / hop)

    assert hops(two, 4_000_000, False) == 1  # two members, one piece: direct
    assert hops(two, 8_000_000, False) == 2  # two pieces: the ring's reduce-scatter and all-gather
    assert hops(four, 4_000_000, False) > 1  # more members: the ring (wanlink's halving is not modelled)
    assert hops(four, 4_000_000, True) == 1  # an all-gather of one-piece messages: direct
    assert hops(four, 8_000_000, True) > 1  # of larger ones: the ring
