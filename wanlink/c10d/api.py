"""Helpers for calling wanlink groups directly."""
from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from wanlink.errors import UnsupportedError


def monitored_barrier(group=None, timeout: timedelta | None = None, wait_all_ranks: bool = False) -> None:
    """``dist.monitored_barrier`` for wanlink groups (torch's own accepts only gloo).

    Rank 0 waits up to ``timeout`` for every rank and raises DeadlineExceeded naming the first
    (or, with ``wait_all_ranks``, every) rank that did not arrive.
    """
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    from wanlink.c10d.process_group import ProcessGroupWanlink

    if not isinstance(pg, ProcessGroupWanlink):
        raise UnsupportedError(f"wanlink monitored_barrier: group {pg!r} is not a wanlink group; "
                               f"use dist.monitored_barrier for gloo")
    pg.monitored_barrier(timeout, wait_all_ranks)
