"""WANLINK_SECURE=1 in the backend: every link of the world is sealed, and collectives are exact."""
import pytest
import torch
import torch.distributed as dist

from tests.support.worlds import run_world


def sealed_world(rank, size):
    from wanlink.c10d import mesh as mesh_module

    tensor = torch.arange(1 << 18, dtype=torch.float32) * (rank + 1)
    dist.all_reduce(tensor)  # ring-sized: through every link
    exact = torch.equal(tensor, torch.arange(1 << 18, dtype=torch.float32) * sum(range(1, size + 1)))
    mesh = mesh_module._world_mesh
    links = [mesh.runtime.run(mesh.link(peer)) for peer in range(size) if peer != rank]
    express = dist.distributed_c10d._get_default_group().express is not None  # (its sockets are not sealed)
    return exact, [link.secure for link in links], express


@pytest.mark.parametrize("unix", ["0", "1"], ids=["tcp", "unix"])
def test_secure_backend_seals_every_link(unix):
    results = run_world(3, sealed_world, env={"WANLINK_SECURE": "1", "WANLINK_UNIX": unix}, timeout=120)
    assert results == [(True, [True, True], False)] * 3, results


def test_plaintext_backend_links_are_not_sealed():
    results = run_world(2, sealed_world, env={"WANLINK_SECURE": "0", "WANLINK_UNIX": "0"}, timeout=120)
    assert results == [(True, [False], False)] * 2, results  # (WANLINK_UNIX=0: no express path either)
