"""Striped links over loopback: sizes, stream counts, ordering, faults. Each test runs on asyncio and uvloop."""
import asyncio
import contextlib
import socket
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import wanlink
from wanlink.errors import (
    AuthenticationError, ConfigError, LimitExceeded, LocalProtocolError, MessageSizeError, PeerLost,
    RemoteProtocolError,
)
from wanlink.proto.frames import data_header
from wanlink.proto.handshake import CHALLENGE, HELLO
from wanlink.proto.limits import Limits
from wanlink.proto.reassembly import PROBE_DISCARD_TAG
from bench.reporting import child_env
from tests.support.links import SECRET, open_pair, proxied_pair

pytestmark = pytest.mark.asyncio
MiB = 1024 * 1024


def pattern(size: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


@pytest.mark.parametrize("streams", [1, 4, 16])
@pytest.mark.parametrize("size", [0, 1, 16 * 1024 + 1, 64 * MiB])
async def test_sizes_and_stream_counts_arrive_identical(streams, size):
    p = await open_pair(streams)
    try:
        data = pattern(size, seed=size)
        out = bytearray(size)
        sent, received = await asyncio.gather(p.client.send(data, tag=1), p.accepted.recv_into(out, tag=1))
        assert received == size and out == data
        if size >= 64 * MiB and streams > 1:
            per_stream = p.client.stats()["chunks_sent_per_stream"]
            assert sum(per_stream) == size // p.client.chunk_size and sum(1 for n in per_stream if n) > 1  # striped
    finally:
        await p.close()


async def test_loopback_links_default_to_large_chunks_unless_told(monkeypatch):
    from wanlink.io.link import LOOPBACK_CHUNK_SIZE

    p = await open_pair(2)
    try:
        assert p.client.chunk_size == p.accepted.chunk_size == LOOPBACK_CHUNK_SIZE
    finally:
        await p.close()
    monkeypatch.setenv("WANLINK_CHUNK_SIZE", str(MiB))
    p = await open_pair(2, chunk_size=512 * 1024)
    try:
        assert (p.client.chunk_size, p.accepted.chunk_size) == (512 * 1024, MiB)
    finally:
        await p.close()


async def test_reader_yields_after_its_budget_and_still_delivers_everything(monkeypatch):
    monkeypatch.setattr("wanlink.io.stream.READ_BUDGET_BYTES", 1000)  # a few reads per readable callback
    p = await open_pair(2)
    try:
        data = pattern(3 * MiB + 5, seed=3)
        out = bytearray(len(data))
        sending = asyncio.ensure_future(p.client.send(data, tag=4))
        await asyncio.sleep(0)  # the data is queued
        p.client.send_control({"after": "data"})
        await asyncio.gather(sending, p.accepted.recv_into(out, tag=4))
        assert out == data
        assert await asyncio.wait_for(p.accepted.recv_control(), 5) == {"after": "data"}
    finally:
        await p.close()


async def test_both_directions_at_once_and_numpy_buffers(pair):
    a = np.arange(3 * MiB // 8, dtype=np.float64)
    b = np.arange(MiB // 4, dtype=np.int32)[::-1].copy()
    got_a, got_b = np.empty_like(a), np.empty_like(b)
    await asyncio.gather(pair.client.send(a, tag=1), pair.accepted.send(b, tag=1),
                         pair.accepted.recv_into(got_a, tag=1), pair.client.recv_into(got_b, tag=1))
    np.testing.assert_array_equal(got_a, a)
    np.testing.assert_array_equal(got_b, b)


async def test_messages_on_one_tag_match_in_order_and_early_data_waits(pair):
    await asyncio.gather(*(pair.client.send(bytes([i]) * 1000, tag=9) for i in range(5)))
    assert pair.accepted.stats()["unexpected_bytes_held"] == 5000
    outs = [bytearray(1000) for _ in range(5)]
    for out in outs:
        await pair.accepted.recv_into(out, tag=9)
    assert [out[0] for out in outs] == list(range(5))
    assert pair.accepted.stats()["unexpected_bytes_held"] == 0


@pytest.mark.parametrize("order", ["edf", "fcfs"])
async def test_sends_leave_in_edf_or_arrival_order(order):
    p = await open_pair(1, chunk_size=256 * 1024, chunk_order=order)
    try:
        deadlines = [7, 3, 9, 1, 5, 3]
        outs = {tag: bytearray(MiB) for tag in range(len(deadlines))}
        finished = []
        receivers = []
        for tag in outs:
            task = asyncio.ensure_future(p.accepted.recv_into(outs[tag], tag=tag))
            task.add_done_callback(lambda _t, tag=tag: finished.append(tag))
            receivers.append(task)
        await asyncio.sleep(0)
        log = p.client.record_send_order()
        sends = [asyncio.ensure_future(p.client.send(pattern(MiB, tag), tag=tag, deadline=deadlines[tag]))
                 for tag in outs]
        await asyncio.gather(*sends, *receivers)
        if order == "edf":
            expected = sorted(outs, key=lambda tag: (deadlines[tag], tag))  # FIFO among equal deadlines
        else:
            expected = list(outs)  # the order the sends were queued in
        assert finished == expected
        assert [tag for tag, _seq, _offset in log] == [tag for tag in expected for _chunk in range(4)]
        assert all(outs[tag] == pattern(MiB, tag) for tag in outs)
    finally:
        await p.close()


async def test_wrong_secret_is_rejected_and_server_keeps_serving():
    links = asyncio.Queue()
    server = await wanlink.serve("127.0.0.1", 0, secret=SECRET, on_link=links.put_nowait)
    try:
        with pytest.raises(AuthenticationError, match="secret"):
            await wanlink.connect("127.0.0.1", server.port, streams=2, secret=b"wrong", timeout=5)
        good = await wanlink.connect("127.0.0.1", server.port, streams=2, secret=SECRET, timeout=5)
        accepted = await asyncio.wait_for(links.get(), 5)
        await asyncio.gather(good.send(b"hello", tag=1), accepted.recv_into(out := bytearray(5), tag=1))
        # the failed client ends its other stream at once: the server counts it when it sees the close
        assert out == b"hello" and 1 <= server.rejected_streams <= 2 and links.empty()
        await good.close()
        await accepted.close()
    finally:
        server.close()
        await server.wait_closed()


@contextlib.contextmanager
def half_answering_server():
    """A thread serving raw sockets: stream 0 of a link gets garbage instead of a CHALLENGE, the other
    streams get no answer at all, so their handshake reads are still pending when stream 0 fails."""
    listener = socket.create_server(("127.0.0.1", 0))
    held = []

    def serve():
        while True:
            try:
                sock, _ = listener.accept()
            except OSError:
                return
            held.append(sock)
            hello = sock.recv(HELLO.size, socket.MSG_WAITALL)
            if len(hello) == HELLO.size and HELLO.unpack(hello)[4] == 0:
                sock.sendall(b"SSH-" + bytes(CHALLENGE.size - 4))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        listener.shutdown(socket.SHUT_RDWR)
        listener.close()
        thread.join(10)
        for sock in held:
            sock.close()


async def test_a_failed_connect_ends_every_stream_task_before_closing_sockets():
    """Closing a socket whose read is still pending broke the stdlib loop's bookkeeping for the fd:
    the next connect that reused the descriptor failed with PeerLost '[Errno 2] No such file or directory'."""
    server = await wanlink.serve("127.0.0.1", 0, secret=SECRET, on_link=lambda link: None)
    try:
        for _ in range(3):
            before = asyncio.all_tasks()
            with half_answering_server() as port:
                with pytest.raises(RemoteProtocolError, match="not a wanlink server"):
                    await wanlink.connect("127.0.0.1", port, streams=3, secret=SECRET, timeout=10)
                assert [task for task in asyncio.all_tasks() - before if not task.done()] == []
            good = await wanlink.connect("127.0.0.1", server.port, streams=3, secret=SECRET, timeout=10)
            await good.close()
    finally:
        server.close()
        await server.wait_closed()


async def test_stream_cut_mid_transfer_still_delivers_identical_bytes():
    async with proxied_pair(4) as (proxy, client, accepted):
        proxy.cut_after(1, 8 * MiB)  # stream 1 dies after carrying 8 MiB
        data = pattern(64 * MiB, 3)
        out = bytearray(len(data))
        await asyncio.wait_for(asyncio.gather(client.send(data, tag=2), accepted.recv_into(out, tag=2)), 60)
        assert out == data
        await _until(lambda: client.streams_alive == 4 == accepted.streams_alive)  # the dead stream came back
        assert client.stats()["reconnects"] == 1 == accepted.stats()["reconnects"]


async def test_cut_streams_requeue_unacked_chunks():
    async with proxied_pair(2) as (proxy, client, accepted):
        proxy.stall()  # chunks go out but no ack comes back
        data = pattern(8 * MiB, 4)
        out = bytearray(len(data))
        transfer = asyncio.gather(client.send(data, tag=1), accepted.recv_into(out, tag=1))
        await asyncio.sleep(0.2)
        proxy.cut(0)
        proxy.resume()
        await asyncio.wait_for(transfer, 30)
        assert out == data and client.stats()["requeued_chunks"] > 0
        await _until(lambda: client.streams_alive == 2)


async def _until(condition, timeout: float = 30.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.02)


async def test_all_streams_cut_fails_pending_operations_with_details():
    async with proxied_pair(2) as (proxy, client, accepted):
        pending_recv = asyncio.ensure_future(client.recv_into(bytearray(100), tag=42))
        await asyncio.sleep(0.05)
        proxy.cut(0)
        proxy.cut(1)
        with pytest.raises(PeerLost, match="tag 42: 0 of 100 bytes"):
            await asyncio.wait_for(pending_recv, 10)
        with pytest.raises(PeerLost):
            await client.send(b"x", tag=1)


async def test_silent_peer_times_out_instead_of_hanging():
    async with proxied_pair(2, timeout=1.0) as (proxy, client, accepted):
        proxy.stall()
        with pytest.raises(PeerLost, match="silent"):
            await asyncio.wait_for(client.send(pattern(4 * MiB), tag=1), 10)


async def test_killed_peer_process_gives_an_error_not_a_hang():
    links = asyncio.Queue()
    server = await wanlink.serve("127.0.0.1", 0, secret=SECRET, on_link=links.put_nowait, timeout=5.0)
    script = textwrap.dedent(f"""
        import asyncio, os, wanlink
        async def main():
            link = await wanlink.connect("127.0.0.1", {server.port}, streams=3, secret={SECRET!r})
            await link.send(b"ready", tag=0)
            await asyncio.sleep(60)
        asyncio.run(main())
    """)
    child = subprocess.Popen([sys.executable, "-c", script], env=child_env())
    try:
        accepted = await asyncio.wait_for(links.get(), 30)
        await accepted.recv_into(bytearray(5), tag=0)
        pending = asyncio.ensure_future(accepted.recv_into(bytearray(10), tag=1))
        await asyncio.sleep(0)  # the receive is posted and waiting before the peer dies
        assert not pending.done()
        child.kill()
        with pytest.raises(PeerLost, match="recv on tag 1: 0 of 10 bytes received"):
            await asyncio.wait_for(pending, 10)
        # an operation started after the link failed names itself just the same
        with pytest.raises(PeerLost, match="recv on tag 2: 0 of 7 bytes received"):
            await accepted.recv_into(bytearray(7), tag=2)
        with pytest.raises(PeerLost, match="send on tag 3: 0 of 4 bytes acknowledged"):
            await accepted.send(b"late", tag=3)
        with pytest.raises(PeerLost, match="waiting for a message on tag 4"):
            await accepted.wait_message_started(4)
        with pytest.raises(PeerLost, match="control message send"):
            accepted.send_control({"late": True})
        await accepted.close()
    finally:
        child.kill()
        child.wait()
        server.close()
        await server.wait_closed()


async def test_malformed_frame_closes_only_that_link():
    links = asyncio.Queue()
    server = await wanlink.serve("127.0.0.1", 0, secret=SECRET, on_link=links.put_nowait,
                                 limits=Limits(max_frame_payload=MiB * 4))
    try:
        bad = await wanlink.connect("127.0.0.1", server.port, streams=1, secret=SECRET)
        bad_peer = await asyncio.wait_for(links.get(), 5)
        good = await wanlink.connect("127.0.0.1", server.port, streams=1, secret=SECRET)
        good_peer = await asyncio.wait_for(links.get(), 5)
        pending = asyncio.ensure_future(bad_peer.recv_into(bytearray(8), tag=3))
        await asyncio.sleep(0.01)
        sock = bad._streams[0].sock  # write a frame that breaks a limit, bypassing the sender's checks
        await asyncio.get_running_loop().sock_sendall(sock, data_header(3, 0, 64 * MiB, 0, 8 * MiB))
        with pytest.raises(PeerLost) as info:
            await asyncio.wait_for(pending, 10)
        assert isinstance(info.value.__cause__, LimitExceeded) and "max_frame_payload" in str(info.value)
        await asyncio.gather(good.send(b"still fine", tag=1), good_peer.recv_into(out := bytearray(10), tag=1))
        assert out == b"still fine"
        for link in (bad, bad_peer, good, good_peer):
            await link.close()
    finally:
        server.close()
        await server.wait_closed()


async def test_garbage_instead_of_handshake_is_dropped_and_server_survives():
    links = asyncio.Queue()
    server = await wanlink.serve("127.0.0.1", 0, secret=SECRET, on_link=links.put_nowait, timeout=2)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(100))
        try:
            answer = await asyncio.wait_for(reader.read(), 5)
        except ConnectionResetError:  # closed with our unread bytes pending
            answer = b""
        assert answer == b""  # dropped without a reply
        writer.close()
        link = await wanlink.connect("127.0.0.1", server.port, streams=1, secret=SECRET)
        peer = await asyncio.wait_for(links.get(), 5)
        await link.close()
        await peer.close()
        assert server.rejected_streams == 1
    finally:
        server.close()
        await server.wait_closed()


async def test_message_size_mismatch_raises_and_link_survives(pair):
    with pytest.raises(MessageSizeError, match="100 bytes but the posted buffer has 50"):
        await asyncio.gather(pair.client.send(bytes(100), tag=1), pair.accepted.recv_into(bytearray(50), tag=1))
    await asyncio.gather(pair.client.send(b"ok", tag=1), pair.accepted.recv_into(out := bytearray(2), tag=1))
    assert out == b"ok"


@pytest.mark.parametrize("secure", [False, True])
async def test_a_late_receiver_makes_the_sender_wait_within_the_staging_limit(secure):
    p = await open_pair(2, server_options={"limits": Limits(max_unexpected_bytes=2 * MiB), "secure": secure},
                        chunk_size=256 * 1024, secure=secure)
    try:
        payload = bytes(range(256)) * (6 * MiB // 256)
        sending = asyncio.ensure_future(p.client.send(payload, tag=5))
        async def eager_window_arrived():  # the eager window (half the budget) arrives
            while p.accepted.reassembler.unexpected_bytes < 1 * MiB:
                await asyncio.sleep(0.01)

        await asyncio.wait_for(eager_window_arrived(), 10)  # bounded: a stalled sender fails, not hangs
        assert not sending.done()  # the rest waits for the receive
        out = bytearray(len(payload))
        await asyncio.wait_for(p.accepted.recv_into(out, tag=5), 10)
        await asyncio.wait_for(sending, 10)
        assert out == payload and p.accepted.reassembler.peak_unexpected_bytes <= 2 * MiB
    finally:
        await p.close()


async def test_a_peer_ignoring_credit_fails_the_link_and_both_errors_name_tag_bytes_and_limit(monkeypatch):
    p = await open_pair(2, server_options={"limits": Limits(max_unexpected_bytes=2 * MiB)}, chunk_size=256 * 1024)
    try:
        p.client.flow.credit = 1 << 40  # a broken peer: it sends as if it had credit...
        monkeypatch.setattr(p.client, "eager_window", lambda: 1 << 40)  # ...for the whole message
        with pytest.raises(PeerLost) as info:
            await asyncio.wait_for(p.client.send(bytes(4 * MiB), tag=5), 10)
        assert isinstance(p.accepted.error, LimitExceeded) and "tag=5" in str(p.accepted.error)
        remote = str(info.value)
        assert "failed the link (limit)" in remote and "max_unexpected_bytes" in remote
        assert f"> {2 * MiB}" in remote and "tag=5" in remote
    finally:
        await p.close()


async def test_sending_more_than_the_protocol_carries_is_a_local_error_and_the_link_survives():
    p = await open_pair(1, limits=Limits(max_control_size=1024, max_transfer_size=MiB))
    try:
        with pytest.raises(LocalProtocolError, match="outgoing control message: 20.. > 1024"):
            p.client.send_control({"big": bytes(2000)})
        with pytest.raises(LocalProtocolError, match=f"send on tag 3: {MiB + 1} > {MiB}"):
            await p.client.send(bytes(MiB + 1), tag=3)
        assert p.client.error is None
        await asyncio.gather(p.client.send(b"ok", tag=3), p.accepted.recv_into(out := bytearray(2), tag=3))
        assert out == b"ok"
    finally:
        await p.close()


async def test_cancelled_recv_hands_the_message_to_the_next_recv(pair):
    waiting = asyncio.ensure_future(pair.accepted.recv_into(bytearray(3), tag=4))
    await asyncio.sleep(0.01)
    waiting.cancel()
    await pair.client.send(b"abc", tag=4)
    out = bytearray(3)
    await pair.accepted.recv_into(out, tag=4)
    assert out == b"abc"


async def test_discard_tag_control_messages_and_stats(pair):
    await pair.client.send(bytes(3 * MiB), tag=PROBE_DISCARD_TAG)
    pair.client.send_control({"op": "hello", "n": [1, 2]})
    assert await asyncio.wait_for(pair.accepted.recv_control(), 5) == {"op": "hello", "n": [1, 2]}
    stats = wanlink.stats()
    mine = stats[pair.client.name]
    assert mine["streams"] == 4 and mine["streams_alive"] == 4 and mine["bytes_sent"] >= 3 * MiB
    assert sum(mine["chunks_sent_per_stream"]) == -(-3 * MiB // pair.client.chunk_size)
    assert pair.accepted.stats()["unexpected_bytes_held"] == 0


async def test_compression_and_checksums():
    p = await open_pair(2, compress=True, checksum=True)
    try:
        data = b"wanlink " * MiB
        out = bytearray(len(data))
        await asyncio.gather(p.client.send(data, tag=1), p.accepted.recv_into(out, tag=1))
        assert out == data and p.client.stats()["bytes_sent"] < len(data) // 4
    finally:
        await p.close()


async def test_closed_link_fails_pending_and_new_operations(pair):
    pending = asyncio.ensure_future(pair.client.recv_into(bytearray(1), tag=1))
    await asyncio.sleep(0.01)
    await pair.client.close()
    with pytest.raises(PeerLost, match="closed locally"):
        await pending
    with pytest.raises(PeerLost):
        await pair.client.send(b"x", tag=1)
    with pytest.raises(PeerLost):
        await asyncio.wait_for(pair.accepted.recv_into(bytearray(1), tag=1), 10)


async def test_bad_arguments_are_config_errors(pair):
    with pytest.raises(ConfigError, match="reserved"):
        await pair.client.send(b"x", tag=-5)
    with pytest.raises(ConfigError, match="tag must be an int"):
        await pair.client.send(b"x", tag="a")
    with pytest.raises(ConfigError, match="writable"):
        await pair.client.recv_into(b"immutable", tag=1)
    with pytest.raises(ConfigError, match="contiguous"):
        await pair.client.send(np.arange(10)[::2], tag=1)
    with pytest.raises(ConfigError, match="buffer"):
        await pair.client.send(12, tag=1)
    with pytest.raises(ConfigError, match="streams"):
        await wanlink.connect("127.0.0.1", pair.server.port, streams=0, secret=SECRET)


async def test_unreachable_port_is_a_clear_connection_error():
    server = await wanlink.serve("127.0.0.1", 0, secret=SECRET, on_link=lambda link: None)
    port = server.port
    server.close()
    await server.wait_closed()
    with pytest.raises(PeerLost, match=f"cannot connect to 127.0.0.1:{port}"):
        await wanlink.connect("127.0.0.1", port, streams=2, secret=SECRET, timeout=5)


async def test_port_in_use_is_reported():
    server = await wanlink.serve("127.0.0.1", 0, secret=SECRET, on_link=lambda link: None)
    try:
        with pytest.raises(OSError, match="cannot listen"):
            await wanlink.serve("127.0.0.1", server.port, secret=SECRET, on_link=lambda link: None)
    finally:
        server.close()
        await server.wait_closed()


async def test_failing_on_link_callback_closes_that_link_only():
    calls = []

    async def on_link(link):
        calls.append(link)
        if len(calls) == 1:
            raise RuntimeError("application bug")

    server = await wanlink.serve("127.0.0.1", 0, secret=SECRET, on_link=on_link)
    try:
        first = await wanlink.connect("127.0.0.1", server.port, streams=1, secret=SECRET)
        with pytest.raises(PeerLost):
            await asyncio.wait_for(first.recv_into(bytearray(1), tag=1), 10)
        second = await wanlink.connect("127.0.0.1", server.port, streams=1, secret=SECRET)
        await asyncio.wait_for(second.send(b"x", tag=1), 10)  # acked by the second link's peer
        await first.close()
        await second.close()
        await calls[1].close()
    finally:
        server.close()
        await server.wait_closed()


async def test_handshakes_in_progress_are_bounded():
    links = asyncio.Queue()
    server = await wanlink.serve("127.0.0.1", 0, secret=SECRET, on_link=links.put_nowait, timeout=5,
                                 limits=Limits(max_handshakes=2))
    idle = []
    try:
        for _ in range(3):  # three clients that connect and never speak: the third evicts the first
            idle.append(await asyncio.open_connection("127.0.0.1", server.port))
            await asyncio.sleep(0.1)
        answer = await asyncio.wait_for(idle[0][0].read(), 5)
        assert answer[:4] == CHALLENGE.pack(b"WLK1", 1, 3, bytes(32), bytes(32))[:4] and answer[6] == 3  # BUSY
        assert server.rejected_streams == 1 and len(server.handshakes) == 2
    finally:
        for _reader, idle_writer in idle:
            idle_writer.close()
        server.close()
        await server.wait_closed()


async def test_small_messages_spread_over_streams(pair):
    for tag in range(40):
        await asyncio.gather(pair.client.send(b"x" * 100, tag=tag), pair.accepted.recv_into(bytearray(100), tag=tag))
    per_stream = pair.client.stats()["chunks_sent_per_stream"]
    assert sum(per_stream) == 40 and sum(1 for n in per_stream if n) >= 2


async def test_a_stream_whose_window_cannot_send_a_message_at_once_waits_for_the_others(pair, monkeypatch):
    # one stream's congestion window collapsed (losses): its turn goes to a stream that can send now
    from wanlink.io import link as link_module

    for stream in pair.client._streams:
        stream.is_local = False  # taken for WAN streams (local ones have no window worth asking about)
    slow = pair.client._streams[0].sock
    monkeypatch.setattr(link_module, "tcp_send_room", lambda sock: 1000 if sock is slow else 1 << 20)
    for tag in range(40):
        await asyncio.gather(pair.client.send(b"x" * 8000, tag=tag), pair.accepted.recv_into(bytearray(8000), tag=tag))
    per_stream = pair.client.stats()["chunks_sent_per_stream"]
    assert per_stream[0] == 0 and sum(per_stream) == 40 and sum(1 for n in per_stream if n) >= 2
    # a message that fits the short window, or streams all short: every stream still takes its turn
    for room, size in ((1000, 500), (0, 8000)):
        monkeypatch.setattr(link_module, "tcp_send_room", lambda sock, room=room: room)
        before = pair.client.stats()["chunks_sent_per_stream"]
        for tag in range(40, 60):
            await asyncio.gather(pair.client.send(b"y" * size, tag=tag),
                                 pair.accepted.recv_into(bytearray(size), tag=tag))
        assert pair.client.stats()["chunks_sent_per_stream"][0] > before[0]


async def test_peer_close_does_not_fail_sends_whose_acks_are_still_arriving():
    p = await open_pair(4)
    try:
        data = bytes(8 * MiB)
        out = bytearray(len(data))
        sent = asyncio.ensure_future(p.client.send(data, tag=1))
        await p.accepted.recv_into(out, tag=1)
        await p.accepted.close()  # closes right after the last chunk: its acks are still on the way
        await asyncio.wait_for(sent, 10)  # every ack arrives before the CLOSE behind it on each stream
    finally:
        await p.close()


async def test_idle_link_outlives_its_silence_timeout():
    p = await open_pair(2, timeout=0.5, server_options={"timeout": 0.5})
    try:
        await asyncio.sleep(1.6)  # idle for three timeouts: pings keep both sides alive
        await asyncio.gather(p.client.send(b"still here", tag=1), p.accepted.recv_into(out := bytearray(10), tag=1))
        assert out == b"still here" and p.client.streams_alive == 2 and p.accepted.error is None
    finally:
        await p.close()


async def test_a_stalled_process_does_not_call_its_peers_silent():
    p = await open_pair(2, timeout=0.5, server_options={"timeout": 0.5})
    try:
        await asyncio.sleep(0.3)
        time.sleep(1.2)  # the whole loop stalls for over two timeouts: nobody pinged, nobody read
        await asyncio.sleep(0.3)  # the watchdogs wake late, ping, and hear each other next round
        await asyncio.gather(p.client.send(b"still here", tag=1), p.accepted.recv_into(out := bytearray(10), tag=1))
        assert out == b"still here" and p.client.error is None and p.accepted.error is None
        assert p.client.streams_alive == p.accepted.streams_alive == 2
    finally:
        await p.close()


async def test_unix_socket_link_between_processes_of_one_host():
    from wanlink.io.link import LOOPBACK_CHUNK_SIZE

    links: asyncio.Queue = asyncio.Queue()
    async with await wanlink.serve("127.0.0.1", 0, secret=SECRET, on_link=links.put_nowait, unix=True) as server:
        client = await wanlink.connect("127.0.0.1", server.port, streams=2, secret=SECRET,
                                       unix_name=server.unix_name)
        accepted = await asyncio.wait_for(links.get(), 10)
        try:
            data, back = pattern(9 * MiB + 3, seed=1), pattern(MiB, seed=2)
            out, out_back = bytearray(len(data)), bytearray(len(back))
            await asyncio.gather(client.send(data, tag=1), accepted.recv_into(out, tag=1),
                                 accepted.send(back, tag=2), client.recv_into(out_back, tag=2))
            assert out == data and out_back == back
            stats = client.stats()
            assert stats["peer"] == f"unix:{server.unix_name}" and stats["streams_alive"] == 2
            assert client.chunk_size == accepted.chunk_size == LOOPBACK_CHUNK_SIZE  # a local path: large chunks
        finally:
            await client.close()
            await accepted.close()
        with pytest.raises(AuthenticationError):
            await wanlink.connect("127.0.0.1", server.port, streams=1, secret=b"wrong", unix_name=server.unix_name)
    with pytest.raises(PeerLost, match="cannot connect"):  # the server is gone, and so is its abstract socket
        await wanlink.connect("127.0.0.1", server.port, streams=1, secret=SECRET, unix_name=server.unix_name,
                              timeout=5)


async def test_server_close_leaves_no_registration_on_a_descriptor_it_closed():
    """close() must not close a listener under its pending accept: a socket that then reuses the
    descriptor could not be registered with the stdlib loop ([Errno 2] from epoll)."""
    server = await wanlink.serve("127.0.0.1", 0, secret=SECRET, on_link=lambda link: None)
    await asyncio.sleep(0.01)  # the accept loop is waiting on the listener
    listener_fd = server._listener.fileno()
    loop = asyncio.get_running_loop()
    server.close()
    opened = []
    try:
        while not opened or opened[-1].fileno() < listener_fd:  # the lowest free descriptor comes first
            opened.append(socket.socket())
        reused = opened[-1]
        loop.add_writer(reused, lambda: None)
        loop.remove_writer(reused)
    finally:
        for sock in opened:
            sock.close()
    await server.wait_closed()


async def test_errors_name_the_rank_the_layers_above_labelled(pair):
    pair.client.labels.update(peer_rank=2, peer_address="10.0.0.9:29500")
    assert wanlink.stats()["rank 2"]["peer_rank"] == 2 and pair.accepted.name in wanlink.stats()  # keyed by rank
    await pair.accepted.close()
    with pytest.raises(PeerLost, match=r"link to rank 2 at 10\.0\.0\.9:29500 \(127\.0\.0\.1:\d+\) failed"):
        await asyncio.wait_for(pair.client.recv_into(bytearray(4), tag=9), 30)


async def test_a_send_until_written_returns_before_its_ack_and_a_cut_still_delivers_the_original_bytes():
    async with proxied_pair(2) as (proxy, client, accepted):
        proxy.stall()  # what the streams write stays in the proxy: no ack can come back
        data = bytearray(pattern(64 * 1024, 5))
        original = bytes(data)
        await asyncio.wait_for(client.send(data, tag=1, until="written"), 10)  # in the kernel: done
        carrier = next(i for i, n in enumerate(client.stats()["chunks_sent_per_stream"]) if n)
        waiting = asyncio.ensure_future(client.send(b"acked", tag=2))  # the default waits for the ack
        data[:] = bytes(len(data))  # the caller reuses its buffer at once
        await asyncio.sleep(0.1)
        assert not waiting.done()
        port = client.stream_sockets()[carrier].getsockname()[1]
        pipe = next(i for i, p in enumerate(proxy.pipes) if p.writers[0].get_extra_info("peername")[1] == port)
        proxy.cut(pipe)  # what the proxy holds of tag 1 is lost: the link re-sends its own copy
        proxy.resume()
        out, token = bytearray(len(data)), bytearray(5)
        await asyncio.wait_for(asyncio.gather(accepted.recv_into(out, tag=1), accepted.recv_into(token, tag=2),
                                              waiting), 30)
        assert out == original and token == b"acked" and client.stats()["requeued_chunks"] >= 1
        with pytest.raises(ConfigError, match="until"):
            await client.send(b"x", tag=3, until="soon")


async def test_sending_time_counts_each_busy_period_until_its_last_ack(pair):
    """Link.sending (what density="auto" reads): a period from the first send while idle until
    everything sent is acknowledged; the acked bytes count at its end."""
    assert pair.client.sending.reading() == (0, 0.0, 0)
    out = bytearray(300_000)
    await asyncio.gather(pair.client.send(b"x" * 200_000, tag=3), pair.client.send(b"y" * 100_000, tag=4),
                         pair.accepted.recv_into(memoryview(out)[:200_000], tag=3),
                         pair.accepted.recv_into(memoryview(out)[200_000:], tag=4))
    acked, busy, periods = pair.client.sending.reading()
    assert (acked, periods) == (300_000, 1) and busy > 0
    await asyncio.gather(pair.client.send(b"z" * 1000, tag=3), pair.accepted.recv_into(bytearray(1000), tag=3))
    assert pair.client.sending.reading()[::2] == (301_000, 2)
    assert pair.accepted.sending.reading() == (0, 0.0, 0)  # it sent nothing but acks
    acked, wire, messages = pair.client.wire.reading()  # Link.wire: per message, send to last ack
    assert (acked, messages) == (301_000, 3) and wire > 0 and pair.accepted.wire.reading() == (0, 0.0, 0)
    rtt = pair.client.min_rtt_s()
    assert rtt is None or 0 < rtt < 1  # None over Unix sockets


async def test_pending_says_what_a_stuck_link_still_sends_and_awaits(pair):
    """Link.pending and registry.pending (the e2e benches' stall watchdog prints them): a send
    nobody receives and a receive nothing arrives for are named with their bytes; a blocked event
    loop is reported as such rather than waited on."""
    from wanlink.io import registry

    big = 3 * pair.client.eager_window()  # only the eager window leaves before the peer's grant
    sending = asyncio.ensure_future(pair.client.send(bytearray(big), tag=3))
    receiving = asyncio.ensure_future(pair.accepted.recv_into(bytearray(1000), tag=9))
    await _until(lambda: pair.client.pending()["sends"] and pair.accepted.pending()["receives"])
    client = pair.client.pending()
    assert client["sends"] == [(3, 0, client["sends"][0][2], big)] and client["sends"][0][2] < big
    assert client["held_messages"] == 1 and client["receives_pending"] == 0
    assert pair.accepted.pending()["receives"] == [(9, 0, 0, 1000)]
    from_thread = await asyncio.to_thread(registry.pending)
    assert from_thread[pair.client.name]["sends"][0][:2] == (3, 0)
    assert from_thread[pair.accepted.name]["receives"] == [(9, 0, 0, 1000)]
    blocked = threading.Thread(target=lambda: answers.append(registry.pending(timeout=0.2)))
    answers: list = []
    blocked.start()
    time.sleep(1.0)  # this loop is the links' loop: it cannot answer meanwhile
    blocked.join()
    assert all("did not answer" in state["error"] for state in answers[0].values())
    await pair.accepted.recv_into(bytearray(big), tag=3)
    await sending
    assert pair.client.pending()["sends_pending"] == 0
    receiving.cancel()


async def test_a_messages_wire_time_ends_at_its_kernel_ack_not_the_peers_late_ack_frame(pair):
    """Link.wire reads each message's end from the peer's kernel (Link.kernel_acks): a peer whose
    application acknowledges late (here its ack frames handled 0.6 s after they came) does not read
    as a slow link. The clock runs only once something read the meter, and only on WAN streams
    (these loopback ones are taken for WAN streams here)."""
    loop = asyncio.get_running_loop()
    handle_now = pair.client.ack_received
    pair.client.ack_received = lambda stream, header: loop.call_later(0.6, handle_now, stream, header)

    async def exchange() -> float:
        started = time.monotonic()
        sending = asyncio.ensure_future(pair.client.send(b"x" * 100_000, tag=3))
        await pair.accepted.recv_into(bytearray(100_000), tag=3)
        tracked = len(pair.client.kernel_acks)  # the message awaits its (late) ack
        await sending
        assert time.monotonic() - started >= 0.5  # the application's ack came late (0.6 s; uvloop's timers round to ms)
        return tracked

    for stream in pair.client._streams:
        stream.is_local = False
    assert await exchange() == 0 and not pair.client.timing_acks  # nobody read the meter: no clock
    _, wire_before, _ = pair.client.wire.reading()
    assert wire_before >= 0.5 and pair.client.timing_acks  # that message ended at its ack frame (0.6 s late)
    assert all(s._quickack for s in pair.client._streams) and not any(s._quickack for s in pair.accepted._streams)
    assert await exchange() == 1
    acked, wire, messages = pair.client.wire.reading()
    assert (acked, messages) == (200_000, 2) and wire - wire_before < 0.4  # the kernel's ack came within milliseconds
    for stream in pair.client._streams:
        stream.is_local = True
    assert await exchange() == 0  # loopback streams: nothing to time
    assert len(pair.client.kernel_acks) == 0  # finished messages are forgotten


async def test_probe_messages_are_timed_apart_from_the_applications(pair):
    """What is sent on PROBE_DISCARD_TAG (density="auto"'s probe bursts) goes to Link.probe_wire."""
    from wanlink.proto.reassembly import PROBE_DISCARD_TAG

    await pair.client.send(b"p" * 50_000, tag=PROBE_DISCARD_TAG, deadline=float("inf"))
    await asyncio.gather(pair.client.send(b"x" * 1000, tag=3), pair.accepted.recv_into(bytearray(1000), tag=3))
    assert pair.client.probe_wire.reading()[::2] == (50_000, 1)
    assert pair.client.wire.reading()[::2] == (1000, 1)


async def test_open_since_says_when_the_earliest_message_awaiting_its_acks_was_sent(pair):
    loop = asyncio.get_running_loop()
    handle_now = pair.client.ack_received
    pair.client.ack_received = lambda stream, header: loop.call_later(0.3, handle_now, stream, header)
    before = time.monotonic()
    sending = asyncio.ensure_future(pair.client.send(b"x" * 1000, tag=3))
    await pair.accepted.recv_into(bytearray(1000), tag=3)
    assert before <= pair.client.open_since() <= time.monotonic() and pair.client.open_since(probes=True) is None
    await sending
    assert pair.client.open_since() is None


async def test_a_probe_burst_sends_one_part_on_each_stream(pair):
    """density="auto"'s probes ask every stream's congestion window for more (ProbeSchedule): the
    parts start one loop iteration apart, so each goes to the next stream in turn."""
    from wanlink.c10d.auto_density import _send_probe

    before = [stream.chunks_sent for stream in pair.client._streams]
    _send_probe(pair.client, [memoryview(bytes(100_000))] * 4)
    await _until(lambda: pair.client.probe_wire.reading()[2] == 4)
    assert [stream.chunks_sent - sent for stream, sent in zip(pair.client._streams, before)] == [1] * 4


async def test_a_probe_sent_on_a_dead_link_is_reported_by_the_links_next_operation():
    """A probe burst's failure goes to no caller: nothing is logged as an unretrieved task error,
    and the link's next operation raises PeerLost as it would without the probe."""
    import gc

    from wanlink.c10d.auto_density import _send_probe

    loop = asyncio.get_running_loop()
    unhandled = []
    loop.set_exception_handler(lambda _loop, context: unhandled.append(context))
    async with proxied_pair(2) as (proxy, client, accepted):
        def probe_tasks():
            return {task for task in asyncio.all_tasks() if task.get_coro().__qualname__ == "Link.send"}

        _send_probe(client, [memoryview(bytes(100_000))] * 2)
        probes = probe_tasks()
        assert len(probes) == 1  # the first part's task: not yet begun when the streams are cut
        proxy.cut(0)
        proxy.cut(1)
        await asyncio.sleep(0)
        probes |= probe_tasks()  # the second part's, unless the link had already failed
        await asyncio.wait_for(asyncio.wait(probes), 10)  # the test leaves their errors unread
        with pytest.raises(PeerLost):
            await client.send(b"x", tag=1)
    del probes  # collected: an error nobody read would be logged now
    gc.collect()
    assert unhandled == []


async def test_eager_credit_comes_back_in_batches_and_a_short_sender_still_completes():
    budget = 2 * MiB  # batches of budget / 16 = 128 KiB
    p = await open_pair(1, server_options={"limits": Limits(max_unexpected_bytes=budget)})
    try:
        for seq in range(3):  # 96 KiB of eager bytes staged, then claimed: less than a batch
            await p.client.send(bytes([seq]) * 32 * 1024, tag=3)
            out = bytearray(32 * 1024)
            await p.accepted.recv_into(out, tag=3)
            assert out == bytes([seq]) * len(out)
        await asyncio.sleep(0.05)
        assert p.client.flow.credit == budget - 96 * 1024  # nothing returned yet
        await asyncio.gather(p.client.send(b"x" * 64 * 1024, tag=3), p.accepted.recv_into(bytearray(64 * 1024), tag=3))
        for _ in range(100):  # 160 KiB due: one CREDIT returns all of it
            if p.client.flow.credit == budget:
                break
            await asyncio.sleep(0.01)
        assert p.client.flow.credit == budget
        p.client.flow.credit = 1024  # a sender short of credit (what is held back): its message waits
        sending = asyncio.ensure_future(p.client.send(pattern(MiB, 5), tag=4))  # for the receive's grant
        out = bytearray(MiB)
        await asyncio.wait_for(asyncio.gather(sending, p.accepted.recv_into(out, tag=4)), 10)
        assert out == pattern(MiB, 5)
    finally:
        await p.close()


class CountingSocket:
    """A socket that counts sendmsg calls (everything else goes to the real one)."""

    def __init__(self, sock):
        self._sock, self.sendmsg_calls = sock, 0

    def sendmsg(self, parts):
        self.sendmsg_calls += 1
        return self._sock.sendmsg(parts)

    def __getattr__(self, name):
        return getattr(self._sock, name)


async def test_frames_queued_while_held_leave_in_one_write_and_the_receives_complete():
    p = await open_pair(1)
    try:
        stream = p.accepted._streams[0]
        stream.sock = counting = CountingSocket(stream.sock)
        outs = [bytearray(1000) for _ in range(3)]
        p.accepted.hold_frames()  # as a readable event does: three grants queued, none written
        receives = [asyncio.ensure_future(p.accepted.recv_into(out, tag=tag)) for tag, out in enumerate(outs)]
        await asyncio.sleep(0)
        assert counting.sendmsg_calls == 0 and len(stream.control) == 3
        p.accepted.release_frames()
        assert counting.sendmsg_calls == 1 and not stream.control
        await asyncio.gather(*(p.client.send(bytes([tag]) * 1000, tag=tag) for tag in range(3)))
        await asyncio.wait_for(asyncio.gather(*receives), 10)
        assert [out[0] for out in outs] == [0, 1, 2]
    finally:
        await p.close()


async def test_a_receive_posted_between_two_sends_does_not_put_the_later_deadline_first():
    p = await open_pair(1)
    try:
        log = p.client.record_send_order()
        late = asyncio.ensure_future(p.client.send(b"l" * 1000, tag=1, deadline=9))
        posted = asyncio.ensure_future(p.client.recv_into(bytearray(10), tag=7))  # writes a GRANT at once
        urgent = asyncio.ensure_future(p.client.send(b"u" * 1000, tag=2, deadline=1))  # same iteration
        await asyncio.wait_for(asyncio.gather(late, urgent), 10)
        posted.cancel()
        await asyncio.gather(posted, return_exceptions=True)
        assert [tag for tag, _seq, _offset in log] == [2, 1]
    finally:
        await p.close()


async def test_a_receive_posted_while_its_chunk_arrives_takes_the_rest_straight_into_its_buffer():
    async with proxied_pair(1) as (proxy, client, accepted):
        payload, passed = pattern(2 * MiB, 7), [None]

        def stall_midway(upstream, data):  # 64 KiB to ~320 KiB of the chunk pass, then the proxy stalls
            if upstream and passed[0] is not None:
                passed[0] += len(data)
                if passed[0] >= 64 * 1024:
                    passed[0] = None
                    proxy.stall()
            return data

        proxy.rewrite = stall_midway
        passed[0] = 0
        sending = asyncio.ensure_future(client.send(payload, tag=5))  # one chunk (loopback: up to 4 MiB)
        await _until(lambda: accepted.reassembler.unexpected_bytes > 0)  # arriving into staging
        out = bytearray(len(payload))
        receiving = asyncio.ensure_future(accepted.recv_into(out, tag=5))
        try:
            await asyncio.sleep(0.05)
            assert accepted.reassembler.unexpected_bytes == 0  # staging freed at the post: the rest goes to `out`
            proxy.resume()
            await asyncio.wait_for(asyncio.gather(sending, receiving), 10)
            assert out == payload and accepted.reassembler.unexpected_bytes == 0
        finally:
            for task in (sending, receiving):
                task.cancel()
            await asyncio.gather(sending, receiving, return_exceptions=True)


async def test_a_readable_events_acks_leave_after_the_receives_it_completed_resumed():
    p = await open_pair(1)
    try:
        stream = p.accepted._streams[0]
        stream.sock = counting = CountingSocket(stream.sock)
        out, seen = bytearray(1000), {}

        async def receive():
            await p.accepted.recv_into(out, tag=1)
            seen["at_resume"] = counting.sendmsg_calls

        receiving = asyncio.ensure_future(receive())
        await asyncio.sleep(0.05)  # posted: its GRANT is written
        before = counting.sendmsg_calls
        await asyncio.wait_for(asyncio.gather(p.client.send(b"x" * 1000, tag=1), receiving), 10)
        await asyncio.sleep(0.05)
        assert seen["at_resume"] == before  # the chunk's ack was still held when the receiver resumed...
        assert counting.sendmsg_calls == before + 1 and out == b"x" * 1000  # ...and left right after
    finally:
        await p.close()


async def test_a_held_grant_and_the_next_chunk_leave_in_one_sendmsg(monkeypatch):
    """What an exchange does (LinkComm.exchange): post a receive (its GRANT held), queue a send, release
    after the chunks: the stream writes the grant and the data frame together, one system call."""
    from wanlink.io.stream import Stream
    writes, real = [], Stream._write

    def recording(stream, parts, chunk):
        writes.append((len(parts), chunk is not None))
        return real(stream, parts, chunk)
    monkeypatch.setattr(Stream, "_write", recording)
    pair = await open_pair(1)
    try:
        link = pair.client
        # frames the link queued while opening (Python 3.12 leaves one) are written first
        await _until(lambda: not any(stream.control for stream in link._streams))
        link.hold_frames()
        _entry, received = link.start_recv(bytearray(5), tag=3)
        sent = link.start_send(b"hello", tag=4, until="written")
        link.release_frames(after_wakeups=True)
        writes.clear()
        await asyncio.wait_for(sent, 10)
        assert writes[0] == (3, True)  # GRANT frame, DATA header, payload
        out = bytearray(5)
        await pair.accepted.recv_into(out, tag=4)
        await pair.accepted.send(b"world", tag=3)
        assert await asyncio.wait_for(received, 10) == 5 and out == b"hello"
    finally:
        await pair.close()


async def test_local_streams_do_not_ask_the_kernel_for_their_window_per_chunk(pair, monkeypatch):
    from wanlink.io import link as link_module

    asked = []
    monkeypatch.setattr(link_module, "tcp_send_room", lambda sock: asked.append(sock) or 0)
    await asyncio.gather(pair.client.send(b"x" * 8000, tag=1), pair.accepted.recv_into(bytearray(8000), tag=1))
    assert asked == [] and pair.client.streams == 4


async def test_on_wire_holds_while_a_send_on_the_tag_is_not_all_in_the_kernel(pair):
    """``on_wire`` (the striped routes' hand-over): False while a chunk of a send on the tag waits
    in user space, True once everything is written and the kernel holds nothing unsent."""
    from wanlink.io.sockets import tcp_info

    if tcp_info(pair.client.stream_sockets()[0]) is None:
        pytest.skip("no TCP_INFO on this platform")
    sent = pair.client.start_send(bytes(8_000_000), tag=5)
    assert not pair.client.on_wire(5)  # queued, no chunk written yet
    out = bytearray(8_000_000)
    await asyncio.gather(sent, pair.accepted.recv_into(out, tag=5))
    assert pair.client.on_wire(5) and pair.client.on_wire(6)  # acknowledged: nothing left anywhere
