"""Exact reassembly: a message completes only when its chunks cover every byte exactly once.

Property-based (hypothesis) over random chunkings, delivery orders, re-sent duplicates, cut-off
chunks and the moment the receive is posted; overlapping chunks are a ProtocolError.
"""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wanlink.errors import ProtocolError
from wanlink.proto.frames import FLAG_EAGER, FrameType, Header
from wanlink.proto.reassembly import Reassembler

TAG = 9


def chunk(total, offset, length, seq=0):
    return Header(FrameType.DATA, FLAG_EAGER, TAG, seq, total, offset, length, length, 0)


@st.composite
def chunkings(draw, max_total=300):
    """(payload, chunks as (offset, length) in offset order) with every byte in exactly one chunk."""
    total = draw(st.integers(1, max_total))
    cuts = sorted(draw(st.sets(st.integers(1, total - 1), max_size=12))) if total > 1 else []
    bounds = [0, *cuts, total]
    payload = bytes(draw(st.binary(min_size=total, max_size=total)))
    return payload, [(a, b - a) for a, b in zip(bounds, bounds[1:])]


@st.composite
def deliveries(draw):
    """A chunking plus a delivery schedule: shuffled, some chunks re-sent, some first copies cut off."""
    payload, pieces = draw(chunkings())
    order = draw(st.permutations(pieces))
    schedule = []
    for offset, length in order:
        if draw(st.booleans()) and length > 1:  # first copy cut off mid-chunk (its stream died), then re-sent
            schedule.append(("cut", offset, length))
        schedule.append(("whole", offset, length))
        if draw(st.integers(0, 3)) == 0:  # a duplicate after the fact (ack lost with its stream)
            schedule.append(("whole", offset, length))
    post_at = draw(st.integers(0, len(schedule)))
    return payload, schedule, post_at


def run(payload, schedule, post_at):
    r = Reassembler()
    buf = bytearray(len(payload))
    finished, entry = [], None
    for step, delivery in enumerate(schedule + [None]):
        if step == post_at:
            entry = r.post(TAG, memoryview(buf))
            if entry.done:
                finished.append(step)
        if delivery is None:
            break
        kind, offset, length = delivery
        header = chunk(len(payload), offset, length)
        view = r.place(header)
        if kind == "cut":
            view[:length // 2] = payload[offset:offset + length // 2]
            continue
        view[:] = payload[offset:offset + length]
        if r.chunk_done(header) is not None:
            finished.append(step)
    return r, buf, entry, finished


@settings(max_examples=300, deadline=None)
@given(deliveries())
def test_random_chunkings_complete_exactly_once_with_every_byte(case):
    payload, schedule, post_at = case
    r, buf, entry, finished = run(payload, schedule, post_at)
    assert len(finished) == 1 and entry.done and entry.error is None
    assert bytes(buf) == payload
    last_new = max(i for i, (kind, o, n) in enumerate(schedule)
                   if kind == "whole" and (kind, o, n) not in schedule[:i])
    assert finished[0] == max(last_new, post_at)  # not before the last byte is covered
    assert r.unexpected_bytes == 0 and r.eager_bytes == 0
    assert r.take_credit() == len(payload)  # every eager byte's credit came back, once


@settings(max_examples=300, deadline=None)
@given(chunkings(), st.data())
def test_an_overlapping_chunk_is_a_protocol_error_naming_the_tag_and_ranges(case, data):
    payload, pieces = case
    total = len(payload)
    if len(pieces) < 2:
        return  # one chunk completes the message: later chunks of it are re-sends of a finished message
    order = data.draw(st.permutations(pieces))
    accepted = order[:data.draw(st.integers(1, len(order) - 1))]  # the message is still incomplete
    start = data.draw(st.integers(0, total - 1))
    length = data.draw(st.integers(1, total - start))
    overlapped = [(o, n) for o, n in accepted if o < start + length and start < o + n]
    if not overlapped or (start, length) in accepted:
        return  # not an overlap (a gap filler, or an exact re-send)
    r = Reassembler()
    buf = bytearray(total)
    r.post(TAG, memoryview(buf))
    for offset, n in accepted:
        r.place(chunk(total, offset, n))[:] = payload[offset:offset + n]
        r.chunk_done(chunk(total, offset, n))
    with pytest.raises(ProtocolError) as info:
        r.place(chunk(total, start, length))
    message = str(info.value)
    assert f"tag={TAG}" in message and f"[{start}, {start + length})" in message
    assert any(f"[{o}, {o + n})" in message for o, n in overlapped)


def test_the_overlap_of_the_issue_fails_instead_of_completing_with_bytes_unwritten():
    """[0,100) and [50,150) of a 200-byte message: 200 bytes counted, bytes 150-199 never written."""
    r = Reassembler()
    r.post(TAG, memoryview(bytearray(200)))
    r.place(chunk(200, 0, 100))
    assert r.chunk_done(chunk(200, 0, 100)) is None
    with pytest.raises(ProtocolError, match=r"\[50, 150\) of tag=9 seq=0 overlaps chunk \[0, 100\)"):
        r.place(chunk(200, 50, 150 - 50))


def test_same_offset_with_another_length_is_an_overlap():
    r = Reassembler()
    r.place(chunk(10, 0, 4))
    with pytest.raises(ProtocolError, match="another length"):
        r.place(chunk(10, 0, 6))


def test_a_gap_leaves_the_message_incomplete():
    r = Reassembler()
    entry = r.post(TAG, memoryview(bytearray(10)))
    for offset, n in [(0, 4), (6, 4)]:
        r.place(chunk(10, offset, n))
        assert r.chunk_done(chunk(10, offset, n)) is None
    assert not entry.done and r.pending() == [entry]
