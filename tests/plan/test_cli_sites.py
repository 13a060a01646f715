"""wanlink-plan's commands, and the site / DP-cell choice."""
import json
import sys
import textwrap

import pytest

from wanlink.plan import cluster_from_toml, load_profile
from wanlink.plan.cli import main, synthetic_profile
from wanlink.plan.sites import choose_sites

CLUSTER = """
[defaults]
streams = 8

[[site]]
name = "east"
ranks = 4
host_cap = "1 Gbit/s"

[[site]]
name = "west"
ranks = 4
host_cap = "1 Gbit/s"

[[site]]
name = "far"
ranks = 1

[[path]]
sites = ["east", "west"]
rtt = "40 ms"
rate = "10 Gbit/s"

[[path]]
sites = ["east", "far"]
rtt = "200 ms"
rate = "50 Mbit/s"

[[path]]
sites = ["west", "far"]
rtt = "200 ms"
rate = "50 Mbit/s"
"""


@pytest.fixture
def files(tmp_path):
    cluster = tmp_path / "cluster.toml"
    cluster.write_text(CLUSTER)
    profile = synthetic_profile(gradient_mb=40, compute_ms=600, buckets=4, batch=32).save(tmp_path / "profile.json")
    return cluster, profile


def test_sites_prefers_whole_near_sites_and_more_cells():
    cluster = cluster_from_toml(CLUSTER)
    profile = synthetic_profile(gradient_mb=40, compute_ms=600, buckets=4, batch=32)
    choices = choose_sites(cluster, profile, global_batch=256, max_cells=4)
    best = choices[0]
    # the far site's 50 Mbit/s path costs more than its one rank adds
    assert best.sites == ("east", "west") and best.collective == "site"
    by_cells = {c.cells: c.fine.iteration_s for c in choices if c.sites == ("east", "west") and c.collective == "site"}
    assert by_cells[4] < by_cells[2] < by_cells[1]  # each cell adds a host's WAN cap
    assert sum(best.batches) == 256
    assert {c.sites for c in choices} == {("east",), ("east", "west"), ("east", "west", "far")}


def test_predict_table_json_and_png(files, tmp_path, capsys):
    pytest.importorskip("matplotlib")  # the --png timeline; the torch-free CI venvs have no matplotlib
    cluster, profile = files
    png = tmp_path / "timeline.png"
    assert main(["predict", str(cluster), "--profile", str(profile), "--density", "dense,0.01", "--staleness", "0,1",
                 "--streams", "1,8", "--collective", "flat,site", "--cells", "1,2", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "fine s" in out and "coarse s" in out and "wait" in out
    assert png.stat().st_size > 1000
    assert main(["predict", str(cluster), "--profile", str(profile), "--split", "equal,balanced", "-J"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["world_size"] == 9 and len(doc["rows"]) == 2
    assert all(row["fine_s"] > 0 for row in doc["rows"])


def test_sites_command(files, capsys):
    cluster, profile = files
    assert main(["sites", str(cluster), "--profile", str(profile), "--global-batch", "256", "-J"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["choices"][0]["sites"] == ["east", "west"]


def test_simulate_1024_ranks(capsys):
    assert main(["simulate", "--ranks", "1024", "--sites", "4", "--density", "0.01", "--staleness", "1", "-J"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ranks"] == 1024 and doc["fine_s"] > 0


def test_bad_inputs_name_the_field(files, tmp_path, capsys):
    cluster, profile = files
    bad = tmp_path / "bad.toml"
    bad.write_text(CLUSTER.replace('rtt = "40 ms"', 'rtt = "40 lightyears"'))
    assert main(["predict", str(bad), "--profile", str(profile)]) == 2
    assert "path[0].rtt: unknown unit 'lightyears'" in capsys.readouterr().err
    assert main(["predict", str(cluster), "--profile", str(tmp_path / "none.json")]) == 2
    assert "cannot read profile" in capsys.readouterr().err
    assert main(["predict", str(cluster), "--profile", str(profile), "--density", "lots"]) == 2
    assert "--density: cannot read 'lots'" in capsys.readouterr().err
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({**json.loads(profile.read_text()), "forward_s": -1}))
    assert main(["predict", str(cluster), "--profile", str(broken)]) == 2
    assert "forward_s must be a finite number >= 0" in capsys.readouterr().err
    assert main(["simulate", "--ranks", "2", "--sites", "3"]) == 2


def test_profile_command_on_a_real_model(tmp_path, monkeypatch, capsys):
    pytest.importorskip("torch")
    module = tmp_path / "tiny_model.py"
    module.write_text(textwrap.dedent("""
        import torch

        def make():
            model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                                        torch.nn.ReLU(), torch.nn.Linear(512, 10))
            return model, (torch.randn(16, 64), torch.randint(0, 10, (16,)))
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "p.json"
    assert main(["profile", "tiny_model:make", "-o", str(out), "--iterations", "3", "--warmup", "1",
                 "--bucket-cap-mb", "0.5", "--density", "0.01"]) == 0
    profile = load_profile(out)
    assert profile.batch_size == 16 and profile.model == "tiny_model:make"
    sizes = [64 * 512 + 512, 512 * 512 + 512, 512 * 10 + 10]
    assert profile.grad_bytes == 4 * sum(sizes)
    # DDP order: the last layer's gradients are ready first
    assert profile.buckets[0].numels[0] in (10, 5120)
    assert [b.ready_s for b in profile.buckets] == sorted(b.ready_s for b in profile.buckets)
    assert all(b.sparsify_s > 0 for b in profile.buckets)
    assert [layer.grad_bytes for layer in profile.layers if layer.grad_bytes] == [4 * n for n in sizes]
    assert main(["profile", "tiny_model:nothing"]) == 2
    assert "has no 'nothing'" in capsys.readouterr().err
    del sys.modules["tiny_model"]


def test_bucket_assignment_matches_ddp():
    torch = pytest.importorskip("torch")
    from torch.distributed import _compute_bucket_assignment_by_size

    from wanlink.plan.profiler import assign_buckets

    sizes = [300_000, 900_000, 10, 5_000_000, 2_000_000, 30_000_000, 7]
    tensors = [torch.empty(n // 4 or 1) for n in sizes]
    ours = assign_buckets([t.numel() * 4 for t in tensors], 25 * 1024 * 1024, 1024 * 1024)
    theirs, _limits = _compute_bucket_assignment_by_size(tensors, [1024 * 1024, 25 * 1024 * 1024])
    assert ours == [list(b) for b in theirs]


def test_predict_from_a_live_probe_and_a_saved_one(files, tmp_path, monkeypatch, capsys):
    """--probe HOST:PORT probes a real wanlink server (loopback) and predicts for two sites joined by
    what it measured; --probe-json reads the same figures back from a file."""
    import asyncio
    import threading

    import wanlink

    _cluster, profile = files
    monkeypatch.setenv("WANLINK_SECRET", "plan-probe-test")
    loop = asyncio.new_event_loop()
    links = []
    server = loop.run_until_complete(wanlink.serve("127.0.0.1", 0, secret=b"plan-probe-test", on_link=links.append))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        assert main(["predict", "--probe", f"127.0.0.1:{server.port}", "--probe-max-streams", "2",
                     "--ranks-per-site", "2", "--profile", str(profile), "-J"]) == 0
    finally:
        loop.call_soon_threadsafe(server.close)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert doc["world_size"] == 4 and doc["cluster"].startswith("probe of 127.0.0.1:")
    assert doc["rows"][0]["streams"] in (1, 2) and doc["rows"][0]["fine_s"] > 0
    assert "probed 127.0.0.1" in captured.err
    saved = tmp_path / "iperf.json"
    saved.write_text(json.dumps({"wanlink": {"probe": {"streams": 4, "rtt_ms": 40.0, "bits_per_second": 4e8}}}))
    assert main(["predict", "--probe-json", str(saved), "--profile", str(profile), "-J"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert rows[0]["streams"] == 4 and rows[0]["fine_s"] > 0.04  # at least the 40 ms RTT


def test_predict_link_figures_errors(files, tmp_path, capsys):
    cluster, profile = files
    assert main(["predict", "--profile", str(profile)]) == 2
    assert "exactly one of CLUSTER" in capsys.readouterr().err
    assert main(["predict", str(cluster), "--probe", "h:1", "--profile", str(profile)]) == 2
    assert "got CLUSTER and --probe" in capsys.readouterr().err
    assert main(["predict", "--probe", "nohost", "--profile", str(profile)]) == 2
    assert "expected HOST:PORT" in capsys.readouterr().err
    from tests.support.ports import refused_port

    with refused_port() as port:
        assert main(["predict", "--probe", f"127.0.0.1:{port}", "--profile", str(profile)]) == 2
    assert "wanlink-iperf -s" in capsys.readouterr().err
    unprobed = tmp_path / "unprobed.json"
    unprobed.write_text(json.dumps({"wanlink": {"probe": None, "streams": 8}}))
    assert main(["predict", "--probe-json", str(unprobed), "--profile", str(profile)]) == 2
    assert "did not probe" in capsys.readouterr().err
