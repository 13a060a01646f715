"""Helpers for calling wanlink groups directly."""
from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from wanlink.errors import UnsupportedError


def site_map(group=None) -> dict:
    """This rank's site and LocalDPRank, the group's cells (site -> group ranks) and whether its
    collectives run site-aware (docs/sites.md)."""
    return _wanlink_group("site_map", group).sites()


def _wanlink_group(op: str, group, hint: str = ""):
    """``group`` (default: the default group) when it is a wanlink group; UnsupportedError otherwise."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    from wanlink.c10d.process_group import ProcessGroupWanlink

    if not isinstance(pg, ProcessGroupWanlink):
        raise UnsupportedError(f"wanlink {op}: group {pg!r} is not a wanlink group{hint}")
    return pg


def monitored_barrier(group=None, timeout: timedelta | None = None, wait_all_ranks: bool = False) -> None:
    """``dist.monitored_barrier`` for wanlink groups (torch's own accepts only gloo).

    Rank 0 waits up to ``timeout`` for every rank and raises DeadlineExceeded naming the first
    (or, with ``wait_all_ranks``, every) rank that did not arrive.
    """
    _wanlink_group("monitored_barrier", group, "; use dist.monitored_barrier for gloo").monitored_barrier(
        timeout, wait_all_ranks)
