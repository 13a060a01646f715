"""Express framing and matching (wanlink/proto/express.py), without sockets: the bytes ``Outgoing``
hands out under arbitrary partial writes, what ``Incoming`` does with any split of a peer's bytes,
and the hello that opens an express socket."""
from __future__ import annotations

import random

import pytest

from wanlink.errors import ProtocolError
from wanlink.proto.express import DISCARD_BYTES, HEADER, HELLO, Incoming, Outgoing, hello, read_hello

SECRET = b"s" * 32


def frame(sequence: int, piece: int, payload: bytes) -> bytes:
    return HEADER.pack(sequence, piece, len(payload)) + payload


def drain(outgoing: Outgoing, rng: random.Random, most: int = 8) -> bytes:
    """Everything ``outgoing`` has queued, as a socket taking a random number of bytes per write sees it."""
    written = bytearray()
    while outgoing.queue:
        gathered = b"".join(bytes(buffer) for buffer in outgoing.buffers(most))
        assert gathered, "pending, but nothing to write"
        count = rng.randint(1, len(gathered))
        written += gathered[:count]
        outgoing.advance(count)
    return bytes(written)


def feed(incoming: Incoming, data: bytes, step: int | None = None, rng: random.Random | None = None) -> None:
    """Hand ``data`` to ``incoming`` as reads of ``step`` bytes (random sizes with ``rng``), each
    capped by ``view()`` as a socket read would be."""
    while data:
        view = incoming.view()
        assert view.nbytes, "incoming offered no room while bytes were waiting"
        count = min(view.nbytes, len(data), step or (rng.randint(1, 1 << 12) if rng else len(data)))
        view[:count] = data[:count]
        data = data[count:]
        incoming.advance(count)


def test_header_round_trips():
    for fields in [(0, 0, 0), (7, 3, 1 << 24), ((1 << 64) - 1, (1 << 32) - 1, (1 << 64) - 1)]:
        assert HEADER.unpack(HEADER.pack(*fields)) == fields


@pytest.mark.parametrize("seed", range(20))
def test_outgoing_writes_every_message_in_order_under_any_partial_writes(seed):
    rng = random.Random(seed)
    outgoing = Outgoing()
    payloads = [(sequence, piece, rng.randbytes(rng.choice([0, 1, 7, 100, 5000])))
                for sequence in range(3) for piece in range(rng.randint(1, 4))]
    messages = [outgoing.push(sequence, piece, memoryview(payload)) for sequence, piece, payload in payloads]
    assert not any(message.done for message in messages)
    assert drain(outgoing, rng, most=rng.randint(1, 8)) == b"".join(frame(*item) for item in payloads)
    assert all(message.done for message in messages)
    assert not outgoing.queue and outgoing.buffers() == []


def test_outgoing_marks_a_message_done_only_once_its_last_byte_is_written():
    outgoing = Outgoing()
    first = outgoing.push(1, 0, memoryview(b"abcd"))
    second = outgoing.push(1, 1, memoryview(b"ef"))
    outgoing.advance(HEADER.size + 3)
    assert not first.done
    outgoing.advance(1 + HEADER.size)  # the first's last byte and the second's header
    assert first.done and not second.done
    assert b"".join(bytes(buffer) for buffer in outgoing.buffers()) == b"ef"


def test_outgoing_gathers_at_most_the_messages_asked_for():
    outgoing = Outgoing()
    for piece in range(5):
        outgoing.push(0, piece, memoryview(b"xy"))
    assert b"".join(bytes(buffer) for buffer in outgoing.buffers(2)) == frame(0, 0, b"xy") + frame(0, 1, b"xy")


def test_abandon_drops_the_unstarted_messages_of_that_collective_and_finishes_a_half_written_one():
    rng = random.Random(1)
    outgoing = Outgoing()
    started = outgoing.push(2, 0, memoryview(b"A" * 50))
    dropped = outgoing.push(2, 1, memoryview(b"B" * 50))
    other = outgoing.push(3, 0, memoryview(b"C" * 50))
    also_dropped = outgoing.push(2, 2, memoryview(b"D" * 50))
    outgoing.advance(HEADER.size + 10)  # the first message is half written: the peer's framing needs the rest
    outgoing.abandon(2)
    assert drain(outgoing, rng) == b"A" * 40 + frame(3, 0, b"C" * 50)
    assert started.done and other.done and not dropped.done and not also_dropped.done


def test_abandon_before_any_byte_drops_every_message_of_that_collective():
    outgoing = Outgoing()
    outgoing.push(4, 0, memoryview(b"x"))
    outgoing.push(5, 0, memoryview(b"y"))
    outgoing.push(4, 1, memoryview(b"z"))
    outgoing.abandon(4)
    assert drain(outgoing, random.Random(2)) == frame(5, 0, b"y")


def test_abandon_after_a_message_ended_exactly_drops_the_next_one():
    outgoing = Outgoing()
    outgoing.push(6, 0, memoryview(b"done"))
    outgoing.push(6, 1, memoryview(b"never"))
    outgoing.advance(HEADER.size + 4)  # the first is complete, the second not begun
    outgoing.abandon(6)
    assert not outgoing.queue


@pytest.mark.parametrize("seed", range(10))
def test_incoming_lands_each_message_in_its_receive_in_posting_order(seed):
    rng = random.Random(seed)
    incoming = Incoming("rank 1")
    sent = [(5, piece, rng.randbytes(rng.randint(1, 3000))) for piece in (0, 1, 0, 2, 1)]  # pieces 0, 1 twice
    targets = [bytearray(len(payload)) for _, _, payload in sent]
    receives = [incoming.post(sequence, piece, memoryview(target))
                for (sequence, piece, _), target in zip(sent, targets)]
    order = [1, 0, 3, 2, 4]  # the peer interleaves the pieces; each piece's messages in posting order
    feed(incoming, b"".join(frame(*sent[index]) for index in order), rng=rng)
    assert all(receive.done for receive in receives)
    assert [bytes(target) for target in targets] == [payload for _, _, payload in sent]
    assert not incoming.unfilled


def test_incoming_takes_its_bytes_one_at_a_time():
    incoming = Incoming("rank 3")
    targets = [bytearray(3), bytearray(5)]
    first = incoming.post(9, 0, memoryview(targets[0]))
    second = incoming.post(9, 1, memoryview(targets[1]))
    data = frame(9, 1, b"12345") + frame(9, 0, b"abc")
    for index in range(len(data)):
        assert incoming.unfilled
        feed(incoming, data[index:index + 1], step=1)
        assert second.done == (index >= HEADER.size + 4)
    assert first.done and targets == [bytearray(b"abc"), bytearray(b"12345")]
    assert not incoming.unfilled


def test_incoming_refuses_a_message_of_another_size_naming_rank_piece_and_collective():
    incoming = Incoming("rank 2")
    target = bytearray(4)
    incoming.post(7, 3, memoryview(target))
    with pytest.raises(ProtocolError, match=r"rank 2 sent 8 bytes as piece 3 of collective #7, where this rank "
                                            r"expects 4: the ranks passed tensors of different sizes"):
        feed(incoming, frame(7, 3, b"12345678"))
    assert target == bytearray(4)


def test_a_message_of_an_older_abandoned_collective_is_dropped_without_touching_any_target():
    incoming = Incoming("rank 1")
    stale = incoming.post(4, 0, memoryview(bytearray(8)))
    incoming.abandon(4)  # collective 4 failed here (its timeout): the peer's message for it comes late
    target = bytearray(b"-" * 16)
    receive = incoming.post(5, 0, memoryview(target))
    big = b"s" * (3 * DISCARD_BYTES + 5)  # dropped a scratch buffer at a time
    data = frame(4, 0, b"old") + frame(4, 1, big)
    feed(incoming, data, rng=random.Random(3))
    assert target == bytearray(b"-" * 16) and not receive.done and not stale.done
    feed(incoming, frame(5, 0, b"n" * 16), step=5)
    assert receive.done and target == bytearray(b"n" * 16)


def test_a_newer_collectives_message_while_waiting_is_an_error_then_matches_once_that_collective_posts():
    incoming = Incoming("rank 2")
    waiting = bytearray(4)
    incoming.post(5, 0, memoryview(waiting))
    with pytest.raises(ProtocolError, match=r"rank 2 sent piece 1 of collective #6 while this rank waits for its "
                                            r"part of collective #5: the ranks issued different collectives, or "
                                            r"rank 2 gave up on #5"):
        feed(incoming, HEADER.pack(6, 1, 3))
    incoming.abandon(5)  # collective 5 fails here; the header read stays, for collective 6
    later = bytearray(3)
    receive = incoming.post(6, 1, memoryview(later))
    feed(incoming, b"xyz")
    assert receive.done and later == bytearray(b"xyz") and waiting == bytearray(4)


def test_a_receive_withdrawn_mid_payload_is_left_alone_after_that_point():
    incoming = Incoming("rank 1")
    target = bytearray(b"." * 100)
    receive = incoming.post(8, 0, memoryview(target))
    payload = bytes(range(100))
    data = frame(8, 0, payload)
    feed(incoming, data[:HEADER.size + 40])
    incoming.abandon(8)  # e.g. its timeout: the caller takes the tensor back
    assert not incoming.unfilled
    feed(incoming, data[HEADER.size + 40:], step=7)  # the rest arrives when a later collective reads
    assert target == bytearray(payload[:40] + b"." * 60) and not receive.done
    after = bytearray(2)
    incoming.post(9, 0, memoryview(after))
    feed(incoming, frame(9, 0, b"ok"))
    assert after == bytearray(b"ok")


def test_hello_round_trips():
    assert read_hello(hello(SECRET, "world-a", 3, 17), SECRET, "world-a") == (3, 17)


def test_a_hello_under_another_secret_fails_authentication_naming_the_rank():
    with pytest.raises(ProtocolError, match="claiming rank 17 failed authentication .*WANLINK_SECRET"):
        read_hello(hello(b"t" * 32, "world-a", 3, 17), SECRET, "world-a")


def test_a_hello_of_another_world_is_refused():
    with pytest.raises(ProtocolError, match="another world"):
        read_hello(hello(SECRET, "world-b", 3, 17), SECRET, "world-a")


def test_a_tampered_hello_fails_authentication():
    data = bytearray(hello(SECRET, "world-a", 3, 17))
    data[HELLO.size - 33] ^= 1  # the rank's last byte
    with pytest.raises(ProtocolError, match="failed authentication"):
        read_hello(bytes(data), SECRET, "world-a")


def test_a_truncated_hello_is_refused():
    data = hello(SECRET, "world-a", 3, 17)
    with pytest.raises(ProtocolError, match=f"express hello of {HELLO.size - 1} bytes, expected {HELLO.size}"):
        read_hello(data[:-1], SECRET, "world-a")
