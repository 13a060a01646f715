"""Express sockets (wanlink/io/express.py): ``ExpressSockets`` moving messages over a socket pair
(both ways at once, deadlines, a peer that goes), and the listener that accepts authenticated ones."""
from __future__ import annotations

import logging
import os
import socket
import threading
import time

import pytest

from wanlink.errors import PeerLost, ProtocolError
from wanlink.io.express import ExpressListener, ExpressSockets, dial
from wanlink.io.sockets import configure_stream_socket

SECRET = os.urandom(32)
WORLD = "express-test"


@pytest.fixture
def pair():
    """Two ExpressSockets joined by a Unix socket pair: ``(ours, theirs)``, ours peer 1, theirs peer 0."""
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ours, theirs = ExpressSockets(), ExpressSockets()
    for sock in (left, right):
        configure_stream_socket(sock)
    ours.add(1, left, "rank 1")
    theirs.add(0, right, "rank 0")
    yield ours, theirs
    ours.close()
    theirs.close()


def move_until(sockets: ExpressSockets, items: list, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while not all(item.done for item in items):
        assert sockets.progress(deadline), f"not done within {seconds} s"


def exchange(ours: ExpressSockets, theirs: ExpressSockets, nbytes: int, sequence: int = 1) -> None:
    """Each side sends the other ``nbytes`` at once and receives the other's, on threads of their own."""
    payloads = {side: os.urandom(nbytes) for side in ("ours", "theirs")}
    targets = {side: bytearray(nbytes) for side in ("ours", "theirs")}
    items = {
        "ours": [ours.incoming(1).post(sequence, 0, memoryview(targets["ours"])),
                 ours.outgoing(1).push(sequence, 0, memoryview(payloads["ours"]))],
        "theirs": [theirs.incoming(0).post(sequence, 0, memoryview(targets["theirs"])),
                   theirs.outgoing(0).push(sequence, 0, memoryview(payloads["theirs"]))],
    }
    errors = []

    def run(sockets, side):
        try:
            move_until(sockets, items[side])
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(ours, "ours")), threading.Thread(target=run, args=(theirs, "theirs"))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not any(thread.is_alive() for thread in threads), "an exchange hung"
    assert not errors, errors
    assert targets["ours"] == payloads["theirs"] and targets["theirs"] == payloads["ours"]


def test_small_messages_both_ways(pair):
    ours, theirs = pair
    for sequence in range(1, 4):
        exchange(ours, theirs, 100, sequence)


def test_16_mib_each_way_at_once_does_not_deadlock(pair):
    """Each side's message is four times its socket buffer: both must read while they write."""
    exchange(*pair, 16 << 20)


def test_many_pieces_of_one_collective_in_one_direction(pair):
    ours, theirs = pair
    payloads = [os.urandom(1000 * (piece + 1)) for piece in range(12)]
    targets = [bytearray(len(payload)) for payload in payloads]
    receives = [theirs.incoming(0).post(2, piece, memoryview(target)) for piece, target in enumerate(targets)]
    messages = [ours.outgoing(1).push(2, piece, memoryview(payload)) for piece, payload in enumerate(payloads)]
    move_until(ours, messages)
    move_until(theirs, receives)
    assert targets == [bytearray(payload) for payload in payloads]


def test_progress_returns_false_at_its_deadline(pair):
    ours, _ = pair
    ours.incoming(1).post(1, 0, memoryview(bytearray(4)))  # nothing will come
    deadline = time.monotonic() + 0.2
    while ours.progress(deadline):
        pass
    assert time.monotonic() >= deadline
    assert not ours.progress(time.monotonic() - 1)  # a deadline already past: at once


def test_progress_with_nothing_to_move_waits_for_its_deadline(pair):
    ours, _ = pair
    deadline = time.monotonic() + 0.1
    assert not ours.progress(deadline)
    assert time.monotonic() >= deadline


def test_a_peer_that_closes_is_peer_lost_for_a_receive(pair):
    ours, theirs = pair
    receive = ours.incoming(1).post(1, 0, memoryview(bytearray(4)))
    theirs.close()
    with pytest.raises(PeerLost, match="rank 1 closed its express socket"):
        move_until(ours, [receive])


def test_a_peer_that_closes_is_peer_lost_for_a_send(pair):
    ours, theirs = pair
    theirs.close()
    message = ours.outgoing(1).push(1, 0, memoryview(b"x" * 100))
    with pytest.raises(PeerLost, match="rank 1 closed its express socket"):
        move_until(ours, [message])


def test_a_peer_that_breaks_the_protocol_is_a_protocol_error(pair):
    ours, theirs = pair
    receive = ours.incoming(1).post(1, 0, memoryview(bytearray(4)))
    move_until(theirs, [theirs.outgoing(0).push(1, 0, memoryview(b"12345678"))])
    with pytest.raises(ProtocolError, match="rank 1 sent 8 bytes as piece 0 of collective #1"):
        move_until(ours, [receive])


@pytest.fixture
def listener():
    listening = ExpressListener(SECRET, WORLD)
    yield listening
    listening.close()


def test_a_dialled_socket_is_taken_under_its_group_and_rank(listener):
    sock = dial(listener.name, SECRET, WORLD, 3, 2)
    taken = listener.take(3, 2, time.monotonic() + 30)
    assert taken is not None
    try:
        taken.setblocking(True)
        sock.setblocking(True)
        sock.sendall(b"ping")
        assert taken.recv(4) == b"ping"
    finally:
        sock.close()
        taken.close()


def test_take_returns_none_at_its_deadline_when_nobody_dialled(listener):
    assert listener.take(1, 1, time.monotonic() + 0.1) is None


def test_a_dialler_with_another_secret_is_refused(listener, caplog):
    caplog.set_level(logging.WARNING, logger="wanlink.io")
    sock = dial(listener.name, os.urandom(32), WORLD, 3, 2)
    try:
        assert listener.take(3, 2, time.monotonic() + 1.0) is None
        sock.setblocking(True)
        sock.settimeout(30)
        assert sock.recv(1) == b""  # the listener closed it
    finally:
        sock.close()
    assert "refused a connection" in caplog.text and "failed authentication" in caplog.text


def test_a_member_that_dials_again_replaces_its_first_socket(listener):
    first = dial(listener.name, SECRET, WORLD, 1, 5)
    second = dial(listener.name, SECRET, WORLD, 1, 5)
    try:
        first.setblocking(True)
        first.settimeout(30)
        assert first.recv(1) == b""  # closed once the second arrived
        taken = listener.take(1, 5, time.monotonic() + 30)
        assert taken is not None
        second.sendall(b"2")
        taken.setblocking(True)
        assert taken.recv(1) == b"2"
        taken.close()
    finally:
        first.close()
        second.close()


def test_close_ends_the_accepting_thread_and_closes_sockets_not_taken():
    listening = ExpressListener(SECRET, WORLD)
    sock = dial(listening.name, SECRET, WORLD, 2, 2)
    deadline = time.monotonic() + 30
    while not listening._arrived and time.monotonic() < deadline:  # accepted, not taken
        time.sleep(0.01)
    listening.close()
    listening._thread.join(30)
    assert not listening._thread.is_alive()
    assert listening.take(2, 2, time.monotonic() + 30) is None  # at once: closed
    try:
        sock.setblocking(True)
        sock.settimeout(30)
        assert sock.recv(1) == b""
    finally:
        sock.close()
    with pytest.raises(OSError):
        dial(listening.name, SECRET, WORLD, 2, 2)
