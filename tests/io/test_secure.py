"""secure=True: every frame encrypted and authenticated; one changed byte fails the link clearly."""
import asyncio
import os

import pytest

import wanlink
from wanlink.errors import ConfigError, PeerLost, RemoteProtocolError
from wanlink.proto.frames import FrameDecoder, PING_FRAME, data_header
from wanlink.proto.handshake import ClientHandshake, ServerHandshake
from wanlink.proto.seal import FrameOpener, FrameSealer, stream_keys
from wanlink.settings import Settings
from tests.support.faultproxy import FaultProxy
from tests.support.links import SECRET, open_pair

MiB = 1024 * 1024
MARKER = b"PLAINTEXT-MARKER-0123456789"


# -- sans-I/O ----------------------------------------------------------------------------------------
def _handshake_pair():
    client = ClientHandshake(SECRET, os.urandom(16), 0, 1, secure=True)
    server = ServerHandshake(SECRET)
    proof = client.receive(server.receive(client.hello()))
    client.receive(server.receive(proof))
    assert client.accepted and server.done and server.stream.secure
    return client, server


def test_both_sides_derive_matching_keys_per_direction_and_fresh_per_stream():
    client, server = _handshake_pair()
    c_send, c_recv = stream_keys(SECRET, *client.transcript(), client=True)
    s_send, s_recv = stream_keys(SECRET, *server.transcript(), client=False)
    assert c_send == s_recv and s_send == c_recv and c_send != c_recv
    other, _ = _handshake_pair()
    assert stream_keys(SECRET, *other.transcript(), client=True)[0] != c_send  # nonces differ per stream
    assert stream_keys(b"other", *client.transcript(), client=True)[0] != c_send


def test_secure_needs_a_secret():
    with pytest.raises(ConfigError, match="WANLINK_SECRET"):
        ClientHandshake(b"", bytes(16), 0, 1, secure=True)
    with pytest.raises(ConfigError, match="WANLINK_SECRET"):
        stream_keys(b"", b"hello", bytes(32), client=True)


class _Sink:
    def __init__(self):
        self.buffers = []

    def place(self, header):
        buffer = bytearray(header.raw_len)
        self.buffers.append(buffer)
        return memoryview(buffer)


def _sealed_frames(key, payloads):
    sealer = FrameSealer(key)
    records = []
    for i, payload in enumerate(payloads):
        parts = sealer.seal_data(data_header(1, i, len(payload), 0, len(payload)), payload)
        records.append(b"".join(bytes(p) for p in parts))
    records.append(sealer.seal_frame(PING_FRAME))
    return records


def _open(key, wire: bytes, step: int = 7):
    sink = _Sink()
    opener = FrameOpener(FrameDecoder(sink.place), key, "stream 0 of link test")
    events = []
    view = memoryview(wire)
    while view:
        target = opener.buffer()
        n = min(len(target), len(view), step)
        target[:n] = view[:n]
        view = view[n:]
        events += opener.advance(n)
    return events, sink


def test_sealed_frames_open_in_place_in_any_read_pieces():
    key = os.urandom(32)
    payloads = [MARKER * 100, b"", os.urandom(70_000)]
    wire = b"".join(_sealed_frames(key, payloads))
    assert MARKER not in wire
    for step in (1, 13, 4096, len(wire)):
        events, sink = _open(key, wire, step)
        assert [bytes(b) for b in sink.buffers] == payloads and len(events) == 4


@pytest.mark.parametrize("attack", ["flip", "replay", "reorder", "drop", "other_key"])
def test_tampered_replayed_reordered_or_dropped_records_fail(attack):
    key = os.urandom(32)
    records = _sealed_frames(key, [MARKER, MARKER * 2, MARKER * 3])
    if attack == "flip":
        first = bytearray(records[1])
        first[len(first) // 2] ^= 0x01
        records[1] = bytes(first)
    elif attack == "replay":
        records.insert(2, records[1])
    elif attack == "reorder":
        records[0], records[1] = records[1], records[0]
    elif attack == "drop":
        del records[1]
    wire = b"".join(records)
    open_key = os.urandom(32) if attack == "other_key" else key
    with pytest.raises(RemoteProtocolError, match="stream 0 of link test: record .* failed authentication"):
        _open(open_key, wire)


# -- over loopback ---------------------------------------------------------------------------------------
@pytest.mark.asyncio
@pytest.mark.parametrize("compress", [False, True])
async def test_secure_links_carry_every_size_identically(compress):
    p = await open_pair(4, secure=True, compress=compress, server_options={"secure": True})
    try:
        assert p.client.secure and p.accepted.secure
        for tag, size in enumerate([0, 1, 100_000, 9 * MiB + 3]):
            data = (MARKER * (size // len(MARKER) + 1))[:size]
            out = bytearray(size)
            await asyncio.gather(p.client.send(data, tag=tag), p.accepted.recv_into(out, tag=tag))
            assert out == data
            back = bytearray(size)
            await asyncio.gather(p.accepted.send(data, tag=tag), p.client.recv_into(back, tag=tag))
            assert back == data
        p.client.send_control({"hello": "world"})
        assert await asyncio.wait_for(p.accepted.recv_control(), 10) == {"hello": "world"}
    finally:
        await p.close()


@pytest.mark.asyncio
async def test_secure_server_refuses_plaintext_clients_saying_how_to_fix_it():
    links = asyncio.Queue()
    server = await wanlink.serve("127.0.0.1", 0, secret=SECRET, on_link=links.put_nowait, secure=True)
    try:
        with pytest.raises(RemoteProtocolError, match="secure=True \\(WANLINK_SECRET|WANLINK_SECURE=1"):
            await wanlink.connect("127.0.0.1", server.port, streams=2, secret=SECRET, timeout=10)
        link = await wanlink.connect("127.0.0.1", server.port, streams=2, secret=SECRET, timeout=10,
                                     settings=Settings(secure=True))  # WANLINK_SECURE=1
        assert link.secure
        await link.close()
    finally:
        server.close()
        await server.wait_closed()


@pytest.mark.asyncio
@pytest.mark.parametrize("secure", [False, True])
async def test_on_path_reader_and_tamperer(secure):
    """An on-path proxy looks for a marker and flips a byte after it: plaintext shows and takes the
    change silently; secure hides the marker and fails the link naming it."""
    links = asyncio.Queue()
    server = await wanlink.serve("127.0.0.1", 0, secret=SECRET, on_link=links.put_nowait, timeout=10)
    proxy = await FaultProxy(server.port).start()
    seen = []

    def tamper(upstream, data):
        if upstream and MARKER in data:
            seen.append(True)
            i = data.index(MARKER) + len(MARKER)
            data = data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1:]
        elif upstream and len(data) > 200 and secure and not seen:
            seen.append(False)  # sealed: flip a byte of the payload's ciphertext
            data = data[:150] + bytes([data[150] ^ 0xFF]) + data[151:]
        return data

    client = await wanlink.connect("127.0.0.1", proxy.port, streams=1, secret=SECRET, secure=secure, timeout=10)
    accepted = await asyncio.wait_for(links.get(), 10)
    proxy.rewrite = tamper
    try:
        payload = MARKER + bytes(1000)
        out = bytearray(len(payload))
        if secure:
            with pytest.raises(PeerLost) as failure:
                await asyncio.wait_for(asyncio.gather(client.send(payload, tag=1), accepted.recv_into(out, tag=1)), 20)
            assert seen == [False]
            cause = accepted.error
            assert isinstance(cause, RemoteProtocolError) and "failed authentication" in str(cause)
            assert accepted.name in str(cause) and "stream 0" in str(cause)
            assert "failed" in str(failure.value)
        else:
            await asyncio.wait_for(asyncio.gather(client.send(payload, tag=1), accepted.recv_into(out, tag=1)), 20)
            assert seen == [True] and out != payload  # read and changed undetected
    finally:
        for link in (client, accepted):
            await link.close()
        await proxy.close()
        server.close()
        await server.wait_closed()
