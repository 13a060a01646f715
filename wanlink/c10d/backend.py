"""Creates ProcessGroupWanlink instances for torch.distributed (the registered creator).

This is the backend's edge: it reads the environment once per group (``wanlink.settings`` and
torch's ``TORCH_DISTRIBUTED_DEBUG``) and passes the values down. The world group
(``init_process_group(backend="wanlink")``) builds the process's Mesh; groups made later with
``dist.new_group(backend="wanlink")`` share it, so one Link per pair of processes carries every
group's traffic. A wanlink group inside a world of another backend gets its own Mesh, set up
through its own Store.
"""
from __future__ import annotations

import os

import torch.distributed as dist

from wanlink.c10d.mesh import Mesh, shared_world_mesh, world_mesh
from wanlink.c10d.process_group import ProcessGroupWanlink
from wanlink.settings import from_env


def detail_debug() -> bool:
    """Whether ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` asks for the per-collective desync check."""
    return dist.get_debug_level() == dist.DebugLevel.DETAIL or \
        os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL"


def create_process_group(dist_options, backend_options=None) -> ProcessGroupWanlink:
    """torch's extended-API creator: ``(DistributedBackendOptions, backend options)``."""
    settings = from_env()
    store, rank, size = dist_options.store, dist_options.group_rank, dist_options.group_size
    timeout, group_name = dist_options.timeout, str(dist_options.group_id)
    global_ranks = list(dist_options.global_ranks_in_group or [])
    shared = shared_world_mesh(global_ranks, rank) if global_ranks else None
    if shared is not None:
        mesh, owns_mesh, mesh_ranks = shared, False, global_ranks
    else:
        make = Mesh if global_ranks else world_mesh
        mesh, owns_mesh, mesh_ranks = make(store, rank, size, timeout, settings), True, range(size)
    return ProcessGroupWanlink(mesh, owns_mesh, mesh_ranks, rank, group_name, timeout, settings, detail_debug())
