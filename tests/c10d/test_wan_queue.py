"""The per-link hand-over of striped routes (``WanQueue``): a rank's routes over its WAN link go one
after another in the order they joined, whatever order their pieces arrive in."""
import asyncio
import types

import pytest

from wanlink.c10d.striped_p2p import RELAY_WINDOW, WanQueue, hand_over, relay_pieces
from wanlink.sched.stripes import piece_header


@pytest.mark.asyncio
async def test_a_route_waits_for_every_route_ahead_to_queue_its_last_piece():
    wan = WanQueue()
    first, second, third = wan.join(0, 1), wan.join(1, 1), wan.join(0, 2)
    await first.turn()  # nobody ahead
    waiting = asyncio.ensure_future(third.turn())
    await asyncio.sleep(0.01)
    assert not waiting.done()
    second.leave()  # out of order: the third still waits for the first
    await asyncio.sleep(0.01)
    assert not waiting.done()
    first.leave()
    await asyncio.wait_for(waiting, 1)
    await second.turn()  # (left already: its own turn is no wait)
    third.leave()
    assert [key for *key, _start, _end in wan.log] == [[0, 1], [0, 2]]  # (the second never started)
    await asyncio.wait_for(wan.join(2, 3).turn(), 1)  # all left: a new route goes at once


@pytest.mark.asyncio
async def test_a_cancelled_waiter_leaves_the_routes_ahead_in_place():
    wan = WanQueue()
    first, second, third = wan.join(0, 1), wan.join(0, 2), wan.join(0, 3)
    waiting = asyncio.ensure_future(second.turn())
    await asyncio.sleep(0.01)
    waiting.cancel()
    second.leave()  # (a route that fails leaves)
    await asyncio.gather(waiting, return_exceptions=True)
    behind = asyncio.ensure_future(third.turn())
    await asyncio.sleep(0.01)
    assert not behind.done()  # still behind the first, whose place the cancel did not touch
    first.leave()
    await asyncio.wait_for(behind, 1)


class Wire:
    """A link whose bytes on a tag have left the host (``on_wire``) when the test says so (None:
    its kernel cannot say), with a round trip of ``rtt`` seconds."""

    def __init__(self, rtt: float = 0.2):
        self.left, self.rtt = False, rtt

    def on_wire(self, tag: int) -> bool | None:
        return self.left

    def min_rtt_s(self) -> float:
        return self.rtt


@pytest.mark.asyncio
async def test_the_route_behind_starts_once_the_route_ahead_has_left_the_host_before_it_is_written():
    """The hand-over does not wait for the route ahead's last piece to be written (at most 1 MiB
    unacknowledged, a round trip later): the link would run empty in between."""
    wan, link = WanQueue(), Wire()
    ahead, behind = wan.join(0, 1), wan.join(0, 2)
    await ahead.turn()
    written = asyncio.get_running_loop().create_future()  # the route ahead's last send
    handing = asyncio.ensure_future(hand_over(ahead, link, 7, [written]))
    waiting = asyncio.ensure_future(behind.turn())
    await asyncio.sleep(0.02)
    assert not waiting.done()  # its bytes still wait in the kernel's buffers
    link.left = True
    await asyncio.wait_for(waiting, 1)
    assert not handing.done() and not written.done()  # (it still waits for its send)
    written.set_result(None)
    await asyncio.wait_for(handing, 1)


@pytest.mark.asyncio
async def test_where_the_link_cannot_say_the_route_behind_starts_once_the_sends_are_written_or_failed():
    wan, link = WanQueue(), Wire()
    link.left = None
    for outcome in (None, ConnectionError("gone")):
        ahead, behind = wan.join(0, 1), wan.join(0, 2)
        written = asyncio.get_running_loop().create_future()
        handing = asyncio.ensure_future(hand_over(ahead, link, 7, [written]))
        waiting = asyncio.ensure_future(behind.turn())
        await asyncio.sleep(0.02)
        assert not waiting.done()
        if outcome is None:
            written.set_result(None)
        else:
            written.set_exception(outcome)
        await asyncio.wait_for(waiting, 1)
        await asyncio.gather(handing, return_exceptions=True)
        assert handing.exception() is outcome
        behind.leave()


@pytest.mark.asyncio
async def test_sends_written_with_bytes_still_unsent_in_the_kernel_hold_the_route_behind_for_at_most_a_round_trip():
    """A last piece under 1 MiB is written once it is in the kernel, unsent: the route behind waits
    until it has left (its bytes would slow the tail down), or a round trip if other bytes keep the
    kernel's buffers full."""
    wan = WanQueue()
    for link in (Wire(rtt=10.0), Wire(rtt=0.1)):
        ahead, behind = wan.join(0, 1), wan.join(0, 2)
        written = asyncio.get_running_loop().create_future()
        written.set_result(None)
        handing = asyncio.ensure_future(hand_over(ahead, link, 7, [written]))
        waiting = asyncio.ensure_future(behind.turn())
        await asyncio.sleep(0.05)
        assert not waiting.done()
        if link.rtt > 1:
            link.left = True
        await asyncio.wait_for(waiting, 1)
        await asyncio.wait_for(handing, 1)
        behind.leave()


class Pieces:
    """An inbound link holding a route's pieces (headers, payloads, its end), each received at once."""

    def __init__(self, sizes):
        self.limits = types.SimpleNamespace(max_transfer_size=1 << 30)
        self.messages, offset = [], 0
        for size in sizes:
            self.messages += [piece_header(offset, size), bytes([len(self.messages) % 251]) * size]
            offset += size
        self.messages.append(piece_header(0, 0))
        self.received = 0

    async def recv_into(self, buffer, tag: int) -> None:
        buffer[:] = self.messages[self.received]
        self.received += 1


class Outbound(Wire):
    """An outbound link that records what is sent on it; each send is written when the test says."""

    def __init__(self):
        super().__init__()
        self.sent, self.written = [], []

    async def send(self, buffer, tag: int, until: str) -> None:
        self.sent.append(bytes(buffer))
        done = asyncio.get_running_loop().create_future()
        self.written.append(done)
        await done


@pytest.mark.asyncio
async def test_a_carrier_lands_a_window_of_pieces_while_the_routes_ahead_hold_its_wan_link():
    wan, inbound, outbound = WanQueue(), Pieces([4, 5, 6, 7, 8, 9]), Outbound()
    ahead = wan.join(0, 1)
    forwarded = []
    relay = asyncio.ensure_future(relay_pieces(inbound, outbound, 7, wan.join(1, 1), "test relay", forwarded.append))
    await asyncio.sleep(0.02)
    assert inbound.received == 2 * RELAY_WINDOW + 1 and outbound.sent == []  # a window landed (and the next header)
    ahead.leave()
    await asyncio.sleep(0.02)
    assert outbound.sent == inbound.messages[:2 * RELAY_WINDOW]  # in order, header before piece
    while not relay.done():
        for done in outbound.written:
            if not done.done():
                done.set_result(None)
        outbound.left = True
        await asyncio.sleep(0.005)
    await relay
    assert outbound.sent == inbound.messages and forwarded == [4, 5, 6, 7, 8, 9]
