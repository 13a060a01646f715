"""bench/predict.py's busy profile and measurement: the training's exchanges keep training's
rhythm (a step waits for the exchanges ``staleness`` steps back), a sparse exchange ends once every
rank's message is decoded, the sample lengths, and the cores other processes take."""
import time

import pytest
import torch

from bench import predict
from wanlink.plan import Bucket, Profile

PROFILE = Profile("p", 8, 0.005, 0.01, 0.005, (Bucket(5 << 20, 0.004, (4096,)), Bucket(4 << 20, 0.008, (4096,))))


class _Work:
    def __init__(self, future):
        self._future = future

    def get_future(self):
        return self._future


class _Dist:
    """Collectives that end when the test says so (``pending`` holds their futures in launch order)."""

    def __init__(self):
        self.pending = []

    def all_reduce(self, _tensor, async_op):
        assert async_op
        self.pending.append(torch.futures.Future())
        return _Work(self.pending[-1])

    @staticmethod
    def get_rank():
        return 0


def _end(futures):
    for future in futures:
        future.set_result(None)


@pytest.mark.parametrize("staleness", [0, 1])
def test_a_step_waits_for_the_exchanges_staleness_steps_back(staleness):
    dist = _Dist()
    start = predict.training_exchanges(dist, torch, PROFILE, {"ranks": 2, "density": None, "staleness": staleness})
    for step in range(3):
        finish = start()
        start.launch(0)
        start.launch(1)
        _end(dist.pending[-2:])  # ended at once: what a step waits for shows in what it counted
        finish()
        assert len(start.seconds) == step + 1 - staleness  # the step `staleness` back is waited for, no later one
    start.drain()
    assert len(start.seconds) == 3 and len(start.offsets) == 3
    assert all(set(offsets) == {0, 1} for offsets in start.offsets)


def test_a_sparse_exchange_ends_once_every_ranks_message_is_decoded(monkeypatch):
    from wanlink.c10d import sparse_hook

    launched = []

    def all_gather(gathered, message, async_op):
        launched.append((gathered, message, torch.futures.Future()))
        return _Work(launched[-1][2])

    monkeypatch.setattr(sparse_hook, "all_gather_single", all_gather)
    start = predict.training_exchanges(_Dist(), torch, PROFILE, {"ranks": 2, "density": 0.01, "staleness": 0})
    finish = start()
    start.launch(0)
    gathered, message, future = launched[0]
    assert gathered.numel() == 2 * message.numel()
    gathered.copy_(torch.cat([message, message]))  # both ranks' messages: valid, they decode
    future.set_result(None)
    finish()
    assert len(start.seconds) == 1
    finish = start()
    start.launch(1)
    launched[1][0].zero_()  # not a block-COO message: the decode raises, and the step's wait says so
    launched[1][2].set_result(None)
    with pytest.raises(RuntimeError, match="not a block frame"):  # torch's future wraps the codec's ProtocolError
        finish()


def test_the_busy_profile_times_about_busy_timed_s_and_at_least_busy_steps():
    lone = {str(64 << 10): 0.04, str(4 << 20): 0.2}
    step = PROFILE.compute_s + 5 / 4 * 0.2  # dense: the buckets side by side, the largest at the 4 MiB rate
    assert predict.busy_iterations(PROFILE, lone, None) == -(-predict.BUSY_TIMED_S // step)
    assert predict.busy_iterations(PROFILE, lone, 0.01) == -(-predict.BUSY_TIMED_S // (PROFILE.compute_s + 2 * 0.04))
    assert predict.busy_iterations(PROFILE, {str(64 << 10): 1.0, str(4 << 20): 9.0}, None) == predict.BUSY_STEPS


def test_training_times_at_least_train_timed_s():
    config = {"iterations": 16}
    assert predict.training_iterations(config, 1.4) == 16  # 11 timed steps of 1.4 s: more than enough
    assert predict.training_iterations(config, 0.025) == predict.SKIP_FIRST + 400


def test_a_sites_cores_are_what_the_emulator_leaves_whatever_niced_processes_took():
    row = {"host_cores": 2, "emulator_cores": 0.1, "profiles": [{"cpu_s": 0.02}], "bench_nice_zero": True,
           "host_cpu_ticks": {"profiles": [20, 0, 200], "timed iterations": [100, 0, 200]}}
    assert predict.others_cores(row) == pytest.approx(0.2)  # reported: the busy profile's phase, not training's
    assert predict.site_cores(row) == pytest.approx((2 - 0.1) / 2)  # niced jobs mostly fill idle cores
    assert predict.others_cores({**row, "bench_nice_zero": False}) == 0.0  # niced bench: its own ranks are niced
    assert predict.site_cores({**row, "profiles": [{"cpu_s": 0.0}]}) is None  # no CPU time: no cores bound


def _run(name, measured, fine, load=3.0, repeat=None):
    errors = {f"{key}_s": fine for key in predict.KEYS}
    errors.update({f"{key}_error": fine / measured - 1 for key in predict.KEYS})
    return {"name": name if repeat is None else f"{name} (repeat {repeat})", "configuration": name,
            "measured_s": measured, "load1": load, "fine_error_pct": 100 * (fine / measured - 1), **errors}


def test_a_configuration_measured_twice_compares_the_mean_of_its_runs_with_the_mean_of_their_predictions():
    rows = [_run("a", 0.30, 0.33), _run("a", 0.26, 0.25, load=5.0, repeat=2), _run("b", 1.0, 1.1)]
    a, b = predict.combine(rows)
    assert (a["name"], a["runs"], b["runs"]) == ("a", 2, 1)
    assert a["measured_s"] == pytest.approx(0.28) and a["fine_s"] == pytest.approx(0.29)
    assert a["fine_error"] == pytest.approx(0.29 / 0.28 - 1)  # not the mean of +10 % and -3.8 %
    assert a["load1"] == pytest.approx(4.0)
    assert a["measured_spread_pct"] == pytest.approx(100 * 0.04 / 0.28)
    assert b["fine_error"] == pytest.approx(0.1)
    assert [[r["name"] for r in group] for group in predict._groups(rows)] == [["a", "a (repeat 2)"], ["b"]]


def test_schedstat_reads_this_process_threads():
    """The kernel adds a running thread's CPU to schedstat at its scheduler ticks and switches, so
    the thread works for 50 ms of its own CPU time (many ticks), however loaded the machine is."""
    before = predict.thread_schedstat()
    started = time.thread_time()
    while time.thread_time() - started < 0.05:
        sum(range(10000))
    spent = predict._delta(before, predict.thread_schedstat())
    assert spent["main"][0] > 0 and spent["all"][0] >= spent["main"][0]


def test_bdp_streams_are_the_fewest_windows_covering_rate_times_rtt():
    window = predict.WINDOW_BYTES  # 1536 KiB: 12.58 Mbit
    assert window == 1536 * 1024
    assert predict.bdp_streams(40, 500) == 2  # 20 Mbit of BDP: two windows carry 629 Mbit/s at 40 ms
    assert predict.bdp_streams(80, 100) == 1  # 8 Mbit: one window
    assert predict.bdp_streams(80, 2000) == 13  # 160 Mbit
    assert predict.bdp_streams(0.01, 1) == 1  # at least one
    rtt_ms = window * 8 / 1e6 * 1000 / 500  # one window exactly covers 500 Mbit/s at this RTT
    assert predict.bdp_streams(rtt_ms, 500) == 1
    assert predict.bdp_streams(rtt_ms * 1.01, 500) == 2


def test_every_configuration_uses_the_bdp_rule_unless_it_names_its_streams():
    named = {"2r 80ms 2000M dense 1 stream": 1, "2r 80ms 2000M dense 8 streams": 8}
    for config in predict.CONFIGS:
        expected = named.get(config["name"], predict.bdp_streams(config["rtt_ms"], config["rate_mbit"]))
        assert config["streams"] == expected, config["name"]


def test_the_model_is_given_the_run_s_stream_count(monkeypatch):
    monkeypatch.setattr(predict, "site_cores", lambda row: None)
    monkeypatch.setattr(predict, "lan_rate", lambda: "10 Gbit/s")
    config = next(c for c in predict.CONFIGS if c["name"] == "2r 40ms 500M dense")
    cluster = predict._cluster(config, 500, 0.6)
    assert cluster.streams == config["streams"] == 2
