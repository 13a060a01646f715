"""``Reassembler.next_started``: peeking whether the next message on a tag has begun, claiming nothing."""
from wanlink.proto.frames import FLAG_EAGER, FrameType, Header
from wanlink.proto.reassembly import Reassembler


def chunk(tag, seq, total, offset, length):
    return Header(FrameType.DATA, FLAG_EAGER, tag, seq, total, offset, length, length, 0)


def test_nothing_started_on_an_unknown_or_quiet_tag():
    r = Reassembler()
    assert not r.next_started(7)
    r.place(chunk(8, 0, 4, 0, 4))
    assert not r.next_started(7) and r.next_started(8)


def test_first_chunk_placed_is_enough_and_peeking_claims_nothing():
    r = Reassembler()
    r.place(chunk(3, 0, 8, 4, 4))  # a later chunk of message 0, still landing
    assert r.next_started(3) and r.next_started(3)
    buf = bytearray(8)
    entry = r.post(3, memoryview(buf))
    assert entry.seq == 0 and not r.next_started(3)  # message 0 is claimed; message 1 has not begun


def test_a_later_message_alone_does_not_count():
    r = Reassembler()
    r.place(chunk(3, 1, 4, 0, 4))  # message 1 overtook message 0 on another stream
    assert not r.next_started(3)
    r.place(chunk(3, 0, 4, 0, 4))
    assert r.next_started(3)
    r.post(3, memoryview(bytearray(4)))
    assert r.next_started(3)  # now message 1 is next


def test_a_message_given_back_by_a_cancelled_receive_is_next_again():
    r = Reassembler()
    entry = r.post(5, memoryview(bytearray(4)))
    view = r.place(chunk(5, 0, 4, 0, 2))
    view[:] = b"ab"
    r.chunk_done(chunk(5, 0, 4, 0, 2))
    assert not r.next_started(5)
    r.unpost(entry)
    assert r.next_started(5)
    buf = bytearray(4)
    again = r.post(5, memoryview(buf))
    assert again.seq == 0 and bytes(buf[:2]) == b"ab" and not r.next_started(5)
