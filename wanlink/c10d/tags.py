"""How wanlink's process groups turn (group, collective, piece) into 63-bit transport tags.

Links are shared by every group of a world, so a tag names its group::

    bit 62        1 = point-to-point (send/recv), 0 = collective
    bits 46..61   group slot (16 bits, from the group name; collisions are refused)
    collective:   bits 16..45 sequence number mod 2**30, bits 0..15 piece (0xFFFF = DETAIL header)
    p2p:          bits 0..45 the user's tag
    striped p2p:  the slot of group ``wanlink/striped-p2p``, bits 30..45 the origin rank,
                  bits 8..29 its transfer serial, bits 0..7 the share (wanlink.c10d.striped_p2p)

Every collective has its own sequence number, so overlapping collectives (DDP buckets) never
share a tag; inside one collective the transport's per-tag FIFO orders the ring's steps.
"""
from __future__ import annotations

import zlib

from wanlink.errors import ConfigError

P2P_FLAG = 1 << 62
SLOT_BITS, SEQ_BITS, PIECE_BITS, USER_TAG_BITS = 16, 30, 16, 46
HEADER_PIECE = (1 << PIECE_BITS) - 1
MAX_USER_TAG = (1 << USER_TAG_BITS) - 1


def group_slot(group_name: str) -> int:
    """The 16-bit slot of a group; equal on every member because group names are."""
    return zlib.crc32(group_name.encode()) & ((1 << SLOT_BITS) - 1)


def collective_tag(slot: int, sequence: int) -> int:
    """Base tag of one collective; add the piece index (< 0xFFFF) to it."""
    return (slot << (SEQ_BITS + PIECE_BITS)) | ((sequence % (1 << SEQ_BITS)) << PIECE_BITS)


def p2p_tag(slot: int, user_tag: int) -> int:
    """Tag of a point-to-point message; the user's tag must fit in 46 bits."""
    if not 0 <= user_tag <= MAX_USER_TAG:
        raise ConfigError(f"wanlink send/recv: tag must be in [0, {MAX_USER_TAG}], got {user_tag}")
    return P2P_FLAG | (slot << USER_TAG_BITS) | user_tag


def relay_tag(slot: int, origin: int, serial: int, share: int) -> int:
    """Tag of one share of a striped transfer on every hop (``slot``: the reserved group's)."""
    return (slot << USER_TAG_BITS) | (origin << 30) | (serial << 8) | share
