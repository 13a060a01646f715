"""The backend drops a failed link at once (freeing what it staged); later operations say why it failed."""
import torch
import torch.distributed as dist

from tests.support.worlds import run_world


def fail_one_link(rank, size):
    import gc
    import weakref

    from wanlink.c10d import mesh as mesh_module
    from wanlink.errors import PeerLost, RemoteProtocolError

    mesh = mesh_module._world_mesh
    store = dist.distributed_c10d._get_default_store()
    dist.barrier()  # both links are up
    if rank == 1:
        link = mesh.runtime.run(mesh.link(0))
        gone = weakref.ref(link)
        gc.disable()
        mesh.runtime.run(_fail(link, RemoteProtocolError("test: a broken frame")))
        del link
        store.set("failed", "1")
    else:
        store.wait(["failed"])
    try:
        tensor = torch.ones(4)
        (dist.send if rank == 0 else dist.recv)(tensor, 1 - rank)
        return "no error"
    except Exception as error:  # noqa: BLE001 - reported to the test
        message, lost = str(error), isinstance(error, PeerLost)
    if rank == 1:
        import time

        deadline = time.monotonic() + 10
        while gone() is not None and time.monotonic() < deadline:  # its streams finish saying goodbye
            time.sleep(0.05)
        return message, gone() is None
    return message, lost


async def _fail(link, error):
    link.fail(error)


def test_a_failed_link_is_dropped_and_both_sides_say_why():
    (sender_error, sender_lost), (receiver_error, freed) = run_world(2, fail_one_link, timeout=120)
    assert "test: a broken frame" in sender_error and sender_lost  # told by the ABORT frame
    assert "link rank 1 <-> rank 0 failed" in receiver_error and "test: a broken frame" in receiver_error
    assert freed  # dropped by the mesh and freed without a GC pass
