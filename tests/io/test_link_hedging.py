"""A stalled stream's chunks re-sent on an idle stream of the link (``Link._check_stalls``), over
loopback. Stalls are told by the kernel counters (patched) and checks run at given times, so no
test waits for a clock."""
import asyncio

import pytest

from wanlink.io import link as link_module
from wanlink.io.sockets import TcpInfo
from wanlink.proto.frames import ChunkReceived, FrameDecoder, data_header
from wanlink.sched.hedging import stall_after
from tests.support.links import open_pair

pytestmark = pytest.mark.asyncio
CHUNK = 256 * 1024


def pattern(size: int) -> bytes:
    return bytes((i * 7 + 3) % 251 for i in range(size))


async def _until(condition, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.01)


def _pause(stream) -> None:
    stream.loop.remove_reader(stream.sock)


def _resume(stream) -> None:
    stream.loop.add_reader(stream.sock, stream._on_readable)


def _kernel(acked: int, in_flight: int = 10, cwnd: int = 100) -> TcpInfo:
    """TCP_INFO of a stream: ``acked`` bytes acknowledged, ``in_flight`` and ``cwnd`` segments of 1000 bytes."""
    return TcpInfo(snd_mss=1000, unacked=in_flight, sacked=0, lost=0, retrans=0, pmtu=1500, rtt=40_000, rttvar=0,
                   snd_ssthresh=0, snd_cwnd=cwnd, total_retrans=0, bytes_acked=acked, notsent_bytes=0)


async def _one_chunk_stuck(pair):
    """Send one chunk while the peer reads no stream; returns (send+recv, stuck stream, other stream)
    with the peer reading again on every stream but the stuck one's."""
    client, accepted = pair.client, pair.accepted
    for stream in accepted._streams:
        _pause(stream)
    data = pattern(CHUNK)
    out = bytearray(CHUNK)
    both = asyncio.gather(client.send(data, tag=5), accepted.recv_into(out, tag=5))
    await _until(lambda: any(s.in_flight for s in client._streams))
    stuck = next(s for s in client._streams if s.in_flight)
    other = next(s for s in client._streams if s is not stuck)
    _resume(accepted._streams[other.index])
    return both, data, out, stuck, other


@pytest.mark.parametrize("progress", [False, True])
async def test_a_stalled_streams_chunk_arrives_over_another_stream_and_its_late_copy_is_dropped(monkeypatch, progress):
    pair = await open_pair(2, chunk_size=CHUNK)
    try:
        client, accepted = pair.client, pair.accepted
        both, data, out, stuck, other = await _one_chunk_stuck(pair)
        real = link_module.tcp_info
        acked = iter(range(10**6))  # with progress: the stuck stream's kernel acknowledges more at each look
        monkeypatch.setattr(link_module, "tcp_info",
                            lambda sock: _kernel(next(acked) if progress else 0) if sock is stuck.sock else real(sock))
        after = stall_after(client._rtt_s)
        client._check_stalls(now=1000.0)
        client._check_stalls(now=1000.0 + after / 2)  # not yet stalled for long enough
        assert client.hedged_chunks == 0 and not other.in_flight
        client._check_stalls(now=1000.0 + after)
        if progress:  # only slow: nothing is copied, the message waits for its stream
            assert client.hedged_chunks == 0 and not other.in_flight
            _resume(accepted._streams[stuck.index])
            await asyncio.wait_for(both, 10)
            assert out == data and client.stats()["hedged_chunks"] == 0
            return
        assert client.stats()["hedged_chunks"] == 1
        client._check_stalls(now=1000.0 + 2 * after)  # a chunk is copied once
        assert client.hedged_chunks == 1
        await asyncio.wait_for(both, 10)  # over the other stream: the stuck one still reads nothing
        assert out == data and accepted.stats()["duplicate_chunks"] == 0
        _resume(accepted._streams[stuck.index])  # the first copy arrives late: dropped, its ack counted
        await _until(lambda: accepted.stats()["duplicate_chunks"] == 1 and client.stats()["duplicate_acks"] == 1)
        await _until(lambda: not stuck.in_flight)  # nothing holds the sender's buffer any more
        assert out == data
    finally:
        await pair.close()


async def test_a_stream_whose_bytes_need_many_round_trips_at_its_window_is_copied_at_once(monkeypatch):
    pair = await open_pair(2, chunk_size=CHUNK)
    try:
        client, accepted = pair.client, pair.accepted
        both, data, out, stuck, other = await _one_chunk_stuck(pair)
        real = link_module.tcp_info
        acked = iter(range(10**6))  # it makes progress, but at a window of 2 segments for 10 in the kernel
        monkeypatch.setattr(link_module, "tcp_info",
                            lambda sock: _kernel(next(acked), cwnd=2) if sock is stuck.sock else real(sock))
        client._check_stalls(now=1000.0)
        assert client.hedged_chunks == 1
        await asyncio.wait_for(both, 10)
        assert out == data
        _resume(accepted._streams[stuck.index])
        await _until(lambda: accepted.stats()["duplicate_chunks"] == 1)
    finally:
        await pair.close()


async def test_no_copy_while_chunks_are_queued_or_no_stream_is_idle(monkeypatch):
    pair = await open_pair(2, chunk_size=CHUNK)
    try:
        client, accepted = pair.client, pair.accepted
        both, data, out, stuck, other = await _one_chunk_stuck(pair)
        _pause(accepted._streams[other.index])
        monkeypatch.setattr(link_module, "tcp_info", lambda sock: _kernel(0))  # both stalled
        after = stall_after(client._rtt_s)
        client._check_stalls(now=1000.0)
        client._check_stalls(now=1000.0 + after)
        assert client.hedged_chunks == 0  # no idle stream: nowhere better to send it
        for stream in accepted._streams:
            _resume(stream)
        await asyncio.wait_for(both, 10)
        assert out == data
    finally:
        await pair.close()


async def test_a_copy_still_arriving_when_its_chunk_completed_lands_apart_from_the_receive_buffer():
    # The receiver's two streams both receive chunk 0; the second copy is half read when the first
    # completes the message. Its rest must not land in the buffer its caller got back.
    pair = await open_pair(2)
    try:
        accepted = pair.accepted
        for stream in accepted._streams:
            _pause(stream)  # frames are fed by hand below
        decoders = [FrameDecoder(accepted.place, accepted.limits) for _ in range(2)]
        data = pattern(1000)
        out = bytearray(1000)
        recv = asyncio.ensure_future(accepted.recv_into(out, tag=3))
        await asyncio.sleep(0)
        frame = data_header(3, 0, 1000, 0, 1000, flags=0, raw_len=1000, checksum=0) + data
        for stream, decoder in zip(accepted._streams, decoders):
            stream.decoder = decoder
        assert decoders[1].feed(frame[:-400]) == []  # the late copy: 600 bytes in
        events = decoders[0].feed(frame)
        assert [type(e) for e in events] == [ChunkReceived]
        accepted._streams[0]._dispatch(events[0])
        assert await asyncio.wait_for(recv, 5) == 1000 and out == data
        out[:] = bytes(1000)  # the caller uses its buffer again
        events = decoders[1].feed(frame[-400:])
        accepted._streams[1]._dispatch(events[0])
        assert out == bytes(1000) and accepted.stats()["duplicate_chunks"] == 1
    finally:
        await pair.close()
