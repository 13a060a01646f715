"""CPU contention as a measured input: ``Profile.comm_slowdown`` (the step profiled beside the
training's exchanges against the step alone) slows the compute that overlaps exchanges."""
import json

import pytest

from wanlink.errors import ConfigError
from wanlink.plan import Bucket, Choice, Profile, cluster_from_dict, coarse, profile_from_json, simulate
from wanlink.plan.choice import sparsify_seconds, while_exchanging

FAST_LINK = cluster_from_dict({"site": [{"name": "a", "ranks": 1}, {"name": "b", "ranks": 1}],
                               "path": [{"sites": ["a", "b"], "rtt": "1 ms", "rate": "80 Gbit/s"}]})


def profile(forward: float, backward: float, step: float = 0.005, slowdown: float = 1.0) -> Profile:
    return Profile("p", 32, forward, backward, step, (Bucket(4000, backward, (1000,)),), comm_slowdown=slowdown)


def test_measured_slowdown_round_trips_and_is_checked():
    alone = profile(forward=0.01, backward=0.03)
    busy = profile(forward=0.02, backward=0.06)
    measured = alone.while_exchanging(busy)
    assert measured.comm_slowdown == pytest.approx(2.0)
    # the step's CPU time is the busy profile's where it has one (contention costs CPU time too)
    assert Profile(**{**alone.__dict__, "cpu_s": 0.03}).while_exchanging(busy).cpu_s == 0.03
    assert alone.while_exchanging(Profile(**{**busy.__dict__, "cpu_s": 0.05})).cpu_s == 0.05
    assert profile_from_json(json.loads(json.dumps(measured.to_json()))) == measured
    with pytest.raises(ConfigError, match="comm_slowdown must be a finite number > 0"):
        Profile("bad", 1, 0.0, 0.0, 0.0, (Bucket(4, 0.0, (1,)),), comm_slowdown=0.0)


def test_staleness_0_slows_backward_not_forward_or_step():
    base = Profile("p", 32, 0.01, 0.02, 0.005, (Bucket(64, 0.02, (16,), sparsify_s=0.001),), density=0.01)
    slowed = while_exchanging(Profile(**{**base.__dict__, "comm_slowdown": 2.0}), Choice())
    assert (slowed.forward_s, slowed.backward_s, slowed.step_s) == (0.01, 0.04, 0.005)
    assert slowed.buckets[0].ready_s == 0.04 and slowed.buckets[0].sparsify_s == 0.002
    stale = while_exchanging(Profile(**{**base.__dict__, "comm_slowdown": 2.0}), Choice(staleness=1))
    assert stale.forward_s == 0.02 and stale.step_s == 0.005
    assert sparsify_seconds(Profile(**{**base.__dict__, "comm_slowdown": 2.0}), Choice(density=0.01)) == [0.002]


def test_compute_bound_staleness_1_period_carries_the_slowdown():
    # a fast link: the period is the compute, forward and backward at twice their profiled time
    alone, busy = profile(0.01, 0.02), profile(0.01, 0.02, slowdown=2.0)
    choice = Choice(staleness=1)
    for model in (simulate, coarse):
        assert model(FAST_LINK, alone, choice).iteration_s == pytest.approx(0.035, rel=1e-2)
        assert model(FAST_LINK, busy, choice).iteration_s == pytest.approx(0.065, rel=1e-2)


def test_profiler_runs_the_background_beside_every_step():
    torch = pytest.importorskip("torch")
    from wanlink.plan.profiler import profile_model

    calls = []

    def background():
        calls.append("start")
        return lambda: calls.append("finish")

    model = torch.nn.Linear(8, 2)
    profile = profile_model(model, (torch.randn(4, 8), torch.randint(0, 2, (4,))), warmup=1, iterations=3,
                            background=background)
    assert calls == ["start", "finish"] * 4
    assert profile.cpu_s > 0


def test_a_sites_cores_bound_the_period():
    # two ranks per site on one core each site: per step 30 ms of compute alone (the sparse hook's
    # 1 ms included) and 10 ms of transport CPU per rank: no period below 2 x 40 ms
    doc = {"site": [{"name": "a", "ranks": 2, "cores": 1}, {"name": "b", "ranks": 2, "cores": 1}],
           "path": [{"sites": ["a", "b"], "rtt": "1 ms", "rate": "80 Gbit/s"}]}
    cluster = cluster_from_dict(doc)
    busy = Profile("p", 32, 0.01, 0.015, 0.004, (Bucket(4000, 0.015, (1000,), sparsify_s=0.001),), density=0.01,
                   transport_cpu_s=0.01)
    for choice in (Choice(density=0.01), Choice(density=0.01, staleness=1)):
        for model in (simulate, coarse):
            assert model(cluster, busy, choice).iteration_s == pytest.approx(0.08)
    # the training thread's CPU time, where the profile has it, stands for the compute's wall time
    # (a profile taken with a density: the hook's CPU is in it)
    measured_cpu = Profile(**{**busy.__dict__, "cpu_s": 0.02})
    assert simulate(cluster, measured_cpu, Choice(density=0.01, staleness=1)).iteration_s == pytest.approx(0.06)
    dense_profile = Profile(**{**busy.__dict__, "cpu_s": 0.019, "density": None})  # the hook's time on top
    assert simulate(cluster, dense_profile, Choice(density=0.01, staleness=1)).iteration_s == pytest.approx(0.06)
    unlimited = cluster_from_dict({**doc, "site": [{"name": "a", "ranks": 2}, {"name": "b", "ranks": 2}]})
    assert simulate(unlimited, busy, Choice(density=0.01)).iteration_s < 0.05
    with pytest.raises(ConfigError, match=r"site\[1\].cores must be a finite number > 0"):
        cluster_from_dict({**doc, "site": [doc["site"][0], {"name": "b", "ranks": 2, "cores": 0}]})
