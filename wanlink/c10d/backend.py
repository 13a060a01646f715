"""Creates ProcessGroupWanlink instances for torch.distributed (the registered creator).

The world group (``init_process_group(backend="wanlink")``) builds the process's Mesh; groups
made later with ``dist.new_group(backend="wanlink")`` share it, so one Link per pair of processes
carries every group's traffic. A wanlink group inside a world of another backend gets its own
Mesh, set up through its own Store.
"""
from __future__ import annotations

import threading

from wanlink.c10d.mesh import Mesh
from wanlink.c10d.process_group import ProcessGroupWanlink

_lock = threading.Lock()
_world_mesh: Mesh | None = None


def forget_mesh(mesh: Mesh) -> None:
    """Stop handing ``mesh`` to new groups (its world group is shutting down)."""
    global _world_mesh
    with _lock:
        if _world_mesh is mesh:
            _world_mesh = None


def create_process_group(dist_options, backend_options=None) -> ProcessGroupWanlink:
    """torch's extended-API creator: ``(DistributedBackendOptions, backend options)``."""
    global _world_mesh
    store, rank, size = dist_options.store, dist_options.group_rank, dist_options.group_size
    timeout, group_name = dist_options.timeout, str(dist_options.group_id)
    global_ranks = list(dist_options.global_ranks_in_group or [])
    with _lock:
        if not global_ranks:
            mesh = Mesh(store, rank, size, timeout)
            _world_mesh = mesh
            return ProcessGroupWanlink(mesh, True, range(size), rank, group_name, timeout)
        shared = _world_mesh
    if shared is not None and max(global_ranks) < shared.size and global_ranks[rank] == shared.rank:
        return ProcessGroupWanlink(shared, False, global_ranks, rank, group_name, timeout)
    mesh = Mesh(store, rank, size, timeout)
    return ProcessGroupWanlink(mesh, True, range(size), rank, group_name, timeout)
