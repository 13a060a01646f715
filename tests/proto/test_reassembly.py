"""Receiver bookkeeping: matching, staging, duplicates, size errors and limits (no sockets)."""
import pytest

from wanlink.errors import LimitExceeded, LocalProtocolError, MessageSizeError, RemoteProtocolError
from wanlink.proto.frames import FLAG_EAGER, FrameType, Header
from wanlink.proto.limits import Limits
from wanlink.proto.reassembly import PROBE_DISCARD_TAG, Reassembler, StagingPool


def chunk(tag, seq, total, offset, length):
    return Header(FrameType.DATA, FLAG_EAGER, tag, seq, total, offset, length, length, 0)


def deliver(r: Reassembler, header: Header, data: bytes):
    view = r.place(header)
    view[:] = data
    return r.chunk_done(header)


def test_posted_buffer_receives_chunks_in_any_order():
    r = Reassembler()
    buf = bytearray(10)
    entry = r.post(5, memoryview(buf))
    assert deliver(r, chunk(5, 0, 10, 6, 4), b"6789") is None
    done = deliver(r, chunk(5, 0, 10, 0, 6), b"012345")
    assert done is entry and entry.done and entry.error is None and bytes(buf) == b"0123456789"


def test_message_before_post_is_staged_then_copied():
    r = Reassembler()
    deliver(r, chunk(1, 0, 4, 0, 4), b"abcd")
    assert r.unexpected_bytes == 4
    buf = bytearray(4)
    entry = r.post(1, memoryview(buf))
    assert entry.done and bytes(buf) == b"abcd" and r.unexpected_bytes == 0


def test_staging_buffers_are_reused_once_copied_out():
    r = Reassembler()
    first = r.place(chunk(1, 0, 4, 0, 4))
    first[:] = b"abcd"
    r.chunk_done(chunk(1, 0, 4, 0, 4))
    buf = bytearray(4)
    r.post(1, memoryview(buf))
    second = r.place(chunk(2, 0, 4, 0, 4))
    assert second.obj is first.obj  # the freed staging buffer, not fresh memory
    second[:] = b"wxyz"
    r.chunk_done(chunk(2, 0, 4, 0, 4))
    out = bytearray(4)
    r.post(2, memoryview(out))
    assert bytes(buf) == b"abcd" and bytes(out) == b"wxyz" and r.unexpected_bytes == 0


def _stage_and_claim(r: Reassembler, tag: int, size: int):
    """Stage a whole ``size``-byte message on ``tag``, then post for it; returns the staging buffer."""
    view = r.place(chunk(tag, 0, size, 0, size))
    r.chunk_done(chunk(tag, 0, size, 0, size))
    r.post(tag, memoryview(bytearray(size)))
    return view.obj


def test_full_spare_pool_makes_room_for_the_current_chunk_size(monkeypatch):
    monkeypatch.setattr("wanlink.proto.reassembly.STAGING_POOL", StagingPool(8))
    r = Reassembler()
    old = [_stage_and_claim(r, tag, 4) for tag in (1, 2)]  # the pool is full of 4-byte buffers
    new = _stage_and_claim(r, 3, 8)  # the chunk size changed: its buffer evicts them
    assert r.place(chunk(4, 0, 8, 0, 8)).obj is new
    assert all(r.place(chunk(5 + i, 0, 4, 0, 4)).obj is not buffer for i, buffer in enumerate(old))


def test_partially_staged_message_completes_after_post():
    r = Reassembler()
    deliver(r, chunk(1, 0, 8, 0, 4), b"abcd")
    buf = bytearray(8)
    entry = r.post(1, memoryview(buf))
    assert not entry.done
    assert deliver(r, chunk(1, 0, 8, 4, 4), b"efgh") is entry
    assert bytes(buf) == b"abcdefgh"


def test_posts_match_messages_in_order_per_tag():
    r = Reassembler()
    first, second, other = bytearray(1), bytearray(1), bytearray(1)
    e1, e2 = r.post(7, memoryview(first)), r.post(7, memoryview(second))
    e3 = r.post(8, memoryview(other))
    deliver(r, chunk(7, 1, 1, 0, 1), b"B")
    deliver(r, chunk(8, 0, 1, 0, 1), b"C")
    deliver(r, chunk(7, 0, 1, 0, 1), b"A")
    assert (bytes(first), bytes(second), bytes(other)) == (b"A", b"B", b"C")
    assert e1.done and e2.done and e3.done


def test_duplicate_chunks_are_not_counted_twice_and_never_touch_finished_buffers():
    r = Reassembler()
    buf = bytearray(4)
    r.post(1, memoryview(buf))
    deliver(r, chunk(1, 0, 4, 0, 2), b"ab")
    assert deliver(r, chunk(1, 0, 4, 0, 2), b"XX") is None  # re-sent chunk: scratch
    assert bytes(buf[:2]) == b"ab"
    deliver(r, chunk(1, 0, 4, 2, 2), b"cd")
    buf[:] = b"user"  # the application reuses its buffer
    assert deliver(r, chunk(1, 0, 4, 2, 2), b"ZZ") is None
    assert bytes(buf) == b"user" and r.duplicate_chunks == 2


def test_zero_size_message():
    r = Reassembler()
    entry = r.post(3, memoryview(bytearray(0)))
    assert deliver(r, chunk(3, 0, 0, 0, 0), b"") is entry and entry.done


def test_size_mismatch_fails_the_receive_and_drains_the_message():
    r = Reassembler()
    entry = r.post(1, memoryview(bytearray(3)))
    done = deliver(r, chunk(1, 0, 8, 0, 4), b"abcd")
    assert done is entry and isinstance(entry.error, MessageSizeError)
    assert deliver(r, chunk(1, 0, 8, 4, 4), b"efgh") is None  # rest of it is dropped, not re-reported
    ok = bytearray(2)
    nxt = r.post(1, memoryview(ok))
    deliver(r, chunk(1, 1, 2, 0, 2), b"hi")
    assert nxt.done and bytes(ok) == b"hi"


def test_size_mismatch_with_staged_message():
    r = Reassembler()
    deliver(r, chunk(1, 0, 4, 0, 4), b"abcd")
    entry = r.post(1, memoryview(bytearray(5)))
    assert entry.done and isinstance(entry.error, MessageSizeError) and r.unexpected_bytes == 0


def test_unexpected_bytes_are_bounded_by_what_actually_arrived():
    r = Reassembler(Limits(max_unexpected_bytes=100))
    deliver(r, chunk(1, 0, 1000, 0, 60), bytes(60))  # announcing a large message allocates nothing
    assert r.unexpected_bytes == 60
    deliver(r, chunk(2, 0, 40, 0, 40), bytes(40))
    with pytest.raises(LimitExceeded) as info:
        r.place(chunk(1, 0, 1000, 60, 1))
    assert info.value.limit == "max_unexpected_bytes"


def test_late_post_copies_only_the_early_chunks():
    r = Reassembler()
    deliver(r, chunk(1, 0, 12, 4, 4), b"efgh")
    assert r.unexpected_bytes == 4
    buf = bytearray(12)
    entry = r.post(1, memoryview(buf))
    assert r.unexpected_bytes == 0 and bytes(buf) == b"\0" * 4 + b"efgh" + b"\0" * 4
    deliver(r, chunk(1, 0, 12, 0, 4), b"abcd")
    assert deliver(r, chunk(1, 0, 12, 8, 4), b"ijkl") is entry
    assert bytes(buf) == b"abcdefghijkl"


def test_chunk_cut_off_before_completion_is_not_copied_at_post():
    r = Reassembler()
    r.place(chunk(1, 0, 8, 0, 4))[:2] = b"ab"  # its stream died mid-chunk: never chunk_done
    deliver(r, chunk(1, 0, 8, 4, 4), b"efgh")
    buf = bytearray(8)
    entry = r.post(1, memoryview(buf))
    assert bytes(buf) == b"\0" * 4 + b"efgh" and r.unexpected_bytes == 4  # the cut chunk's buffer is held
    assert deliver(r, chunk(1, 0, 8, 0, 4), b"abcd") is entry and bytes(buf) == b"abcdefgh"
    assert r.unexpected_bytes == 0  # the re-sent chunk went to the posted buffer; the leftover is freed


def test_chunk_arriving_while_the_message_is_claimed_lands_in_the_posted_buffer():
    r = Reassembler()
    header = chunk(1, 0, 8, 0, 8)
    landing = r.place(header)  # first bytes are being received into staging...
    landing[:3] = b"abc"
    buf = bytearray(8)
    entry = r.post(1, memoryview(buf))  # ...when the application posts its buffer
    landing[3:] = b"defgh"
    assert r.chunk_done(header) is entry
    assert bytes(buf) == b"abcdefgh" and r.unexpected_bytes == 0


def test_chunk_arriving_while_the_receive_is_cancelled_is_restaged():
    r = Reassembler()
    first = bytearray(8)
    entry = r.post(1, memoryview(first))
    header = chunk(1, 0, 8, 0, 8)
    landing = r.place(header)
    landing[:4] = b"abcd"
    r.unpost(entry)  # receiver cancelled mid-chunk
    landing[4:] = b"efgh"
    r.chunk_done(header)
    second = bytearray(8)
    again = r.post(1, memoryview(second))
    assert again.done and bytes(second) == b"abcdefgh" and r.unexpected_bytes == 0


def test_pending_messages_are_bounded():
    r = Reassembler(Limits(max_pending_transfers=2))
    r.post(1, memoryview(bytearray(1)))
    r.post(2, memoryview(bytearray(1)))
    with pytest.raises(LimitExceeded, match="max_pending_transfers"):
        r.place(chunk(3, 0, 1, 0, 1))


def test_unpost_restages_and_next_post_gets_the_same_message():
    r = Reassembler()
    first = bytearray(4)
    entry = r.post(1, memoryview(first))
    deliver(r, chunk(1, 0, 4, 0, 2), b"ab")
    r.unpost(entry)
    assert r.unexpected_bytes == 2
    second = bytearray(4)
    again = r.post(1, memoryview(second))
    deliver(r, chunk(1, 0, 4, 2, 2), b"cd")
    assert again.done and bytes(second) == b"abcd" and bytes(first[2:]) == b"\0\0"


def test_discard_tag_goes_to_scratch_and_other_negative_tags_are_errors():
    r = Reassembler()
    assert deliver(r, chunk(PROBE_DISCARD_TAG, 0, 100, 0, 100), bytes(100)) is None
    with pytest.raises(RemoteProtocolError, match="reserved"):
        r.place(chunk(-2, 0, 1, 0, 1))
    with pytest.raises(LocalProtocolError, match="reserved"):
        r.post(-1, memoryview(bytearray(1)))


def test_message_changing_size_is_a_protocol_error():
    r = Reassembler()
    r.place(chunk(1, 0, 8, 0, 4))
    with pytest.raises(RemoteProtocolError, match="changed size"):
        r.place(chunk(1, 0, 9, 4, 4))


def test_pending_lists_unfinished_posts():
    r = Reassembler()
    entry = r.post(1, memoryview(bytearray(2)))
    assert r.pending() == [entry]
    deliver(r, chunk(1, 0, 2, 0, 2), b"ok")
    assert r.pending() == []


def test_staging_pool_is_shared_by_the_links_of_a_process():
    first, second = Reassembler(), Reassembler()
    buffer = _stage_and_claim(first, 1, 12345)
    assert second.place(chunk(1, 0, 12345, 0, 12345)).obj is buffer


def test_a_chunk_landing_in_staging_when_posted_moves_to_the_posted_buffer_and_frees_its_staging():
    r = Reassembler()
    header = chunk(1, 0, 8, 0, 8)
    landing = r.place(header)  # an eager chunk is being received into staging...
    landing[:3] = b"abc"
    assert r.unexpected_bytes == 8 and r.eager_bytes == 8
    buf = bytearray(8)
    entry = r.post(1, memoryview(buf))  # ...when the application posts its buffer
    assert r.staged_landing(entry) == [0]
    view = r.land_directly(entry, 0)  # the decoder moves what arrived (redirect) and goes on there
    view[:3] = landing[:3]
    r.release_staging(entry, 0)
    assert r.unexpected_bytes == 0 and r.staged_landing(entry) == []
    view[3:] = b"defgh"
    assert r.chunk_done(header) is entry and bytes(buf) == b"abcdefgh"
    assert r.eager_bytes == 0 and r.take_credit() == 8  # its credit is due back as for any eager chunk


def test_no_staged_landing_for_a_message_that_failed_or_was_not_claimed():
    r = Reassembler()
    r.place(chunk(1, 0, 8, 0, 8))
    entry = r.post(1, memoryview(bytearray(4)))  # wrong size: the message fails
    assert entry.error is not None and r.staged_landing(entry) == []
