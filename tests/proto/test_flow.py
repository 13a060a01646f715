"""Receiver-driven flow control with bytes only: SendFlow (sender) against Reassembler (receiver)."""
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wanlink.errors import LimitExceeded, ProtocolError
from wanlink.proto.flow import MIN_EAGER_WINDOW, SendFlow, eager_window
from wanlink.proto.frames import FLAG_EAGER, FrameType, Header
from wanlink.proto.limits import MiB, Limits
from wanlink.proto.reassembly import Reassembler


def pieces(total, chunk):
    """(item, size) per chunk, the item being (offset, length); an empty message is one empty chunk."""
    lengths = [(offset, min(chunk, total - offset)) for offset in range(0, total, chunk)] or [(0, 0)]
    return [(piece, piece[1]) for piece in lengths]


def offsets(released):
    return [(item[0], eager) for item, eager in released]


def test_window_is_one_bandwidth_delay_product_within_bounds():
    budget = 128 * MiB
    assert eager_window(125e6, 0.1, budget) == 12_500_000  # 1 Gbit/s x 100 ms
    assert eager_window(3e9, 50e-6, budget) == MIN_EAGER_WINDOW  # loopback: the floor
    assert eager_window(1.25e9, 0.2, budget) == budget // 2  # 10 Gbit/s x 200 ms: half the budget
    assert eager_window(None, 0.1, budget) == budget // 2  # no estimate yet


def test_small_message_goes_eagerly_in_full():
    flow = SendFlow(max_grants=8, credit=100)
    released, announce = flow.start(1, 0, pieces(30, 10), window=50)
    assert offsets(released) == [(0, True), (10, True), (20, True)] and not announce
    assert flow.credit == 70 and flow.held_messages == 0


def test_large_message_sends_its_window_then_the_rest_on_grant():
    flow = SendFlow(max_grants=8, credit=100)
    released, _ = flow.start(1, 0, pieces(100, 10), window=30)
    assert offsets(released) == [(0, True), (10, True), (20, True)]
    assert offsets(flow.on_grant(1, 0, started=True)) == [(o, False) for o in range(30, 100, 10)]
    assert flow.held_messages == 0 and flow.on_grant(1, 0, started=True) == []  # a re-post after a cancel


def test_receive_posted_first_grants_the_whole_message_ahead():
    flow = SendFlow(max_grants=8, credit=0)
    assert flow.on_grant(4, 2, started=False) == []
    released, announce = flow.start(4, 2, pieces(50, 10), window=10)
    assert offsets(released) == [(o, False) for o in range(0, 50, 10)] and not announce


def test_without_credit_a_message_is_announced_and_waits_in_order():
    flow = SendFlow(max_grants=8, credit=10)
    first, _ = flow.start(1, 0, pieces(30, 10), window=30)
    second, announce = flow.start(2, 0, pieces(10, 10), window=30)
    assert offsets(first) == [(0, True)] and second == [] and announce
    assert flow.waiting_announced() == [(2, 0, 10)]
    assert offsets(flow.on_credit(35)) == [(10, True), (20, True)]  # the older message first
    assert flow.on_credit(35) == [] and flow.on_credit(30) == []  # repeated, overtaken: nothing new
    assert offsets(flow.on_credit(40)) == [(0, True)] and flow.held_messages == 0


def test_message_sent_before_the_first_credit_gets_half_the_budget_as_window_when_it_comes():
    flow = SendFlow(max_grants=8)  # the receiver's budget is not known yet
    released, announce = flow.start(1, 0, pieces(100, 10), window=1)  # (a window from an unknown budget)
    assert released == [] and announce
    assert offsets(flow.on_credit(60)) == [(o, True) for o in range(0, 30, 10)]  # 30 = half the budget
    assert offsets(flow.on_grant(1, 0, started=True)) == [(o, False) for o in range(30, 100, 10)]


def test_grant_releases_chunks_still_waiting_for_credit_without_charging_them():
    flow = SendFlow(max_grants=8, credit=0)
    flow.start(1, 0, pieces(20, 10), window=20)
    assert offsets(flow.on_grant(1, 0, started=True)) == [(0, False), (10, False)]
    assert flow.on_credit(10) == [] and flow.credit == 10 and flow.waiting_announced() == []


def test_a_message_granted_while_it_waited_for_credit_does_not_hold_back_the_next_one():
    """A send-then-receive exchange on both sides must not need the peer's grant while credit is
    left: a message granted in full while it waited for credit leaves the queue of messages waiting
    for credit, so the next small message goes eagerly at once (it used to wait behind the granted
    one until a CREDIT frame came, and none comes once the peer's staged bytes wait on this send)."""
    flow = SendFlow(max_grants=8, credit=100)
    first, _ = flow.start(1, 0, pieces(120, 60), window=200)  # 60 eager now, 60 waits for credit
    assert offsets(first) == [(0, True)] and flow.credit == 40
    assert offsets(flow.on_grant(1, 0, started=True)) == [(60, False)]
    second, announce = flow.start(2, 0, pieces(10, 10), window=200)
    assert offsets(second) == [(0, True)] and not announce and flow.credit == 30
    assert flow.held_messages == 0 and flow.waiting_announced() == []


def test_grants_for_unsent_messages_are_bounded():
    flow = SendFlow(max_grants=2)
    flow.on_grant(1, 0, started=False)
    flow.on_grant(1, 1, started=False)
    with pytest.raises(ProtocolError, match="tag=1 seq=2"):
        flow.on_grant(1, 2, started=False)


def test_impossible_credit_is_a_protocol_error():
    with pytest.raises(ProtocolError, match="credit"):
        SendFlow(max_grants=2).on_credit(2**48 + 1)


def data(tag, seq, total, offset, length, eager):
    return Header(FrameType.DATA, FLAG_EAGER if eager else 0, tag, seq, total, offset, length, length, 0)


def test_chunk_beyond_the_window_of_an_ungranted_message_is_a_protocol_error_naming_the_tag():
    r = Reassembler()
    r.place(data(7, 0, 100, 0, 10, eager=True))
    with pytest.raises(ProtocolError, match=r"\[10, 20\) of tag=7 seq=0 .*ignored flow control"):
        r.place(data(7, 0, 100, 10, 10, eager=False))


def test_eager_bytes_beyond_the_credit_are_a_limit_error_naming_tag_bytes_and_limit():
    r = Reassembler(Limits(max_unexpected_bytes=25))
    for offset in (0, 10):
        r.place(data(3, 0, 100, offset, 10, eager=True))
    with pytest.raises(LimitExceeded, match=r"max_unexpected_bytes exceeded: 30 > 25 .*tag=3 seq=0"):
        r.place(data(3, 0, 100, 20, 10, eager=True))


def test_credit_comes_back_when_staged_bytes_are_claimed_and_at_once_for_posted_buffers():
    r = Reassembler()
    view = r.place(data(1, 0, 20, 0, 10, eager=True))
    r.chunk_done(data(1, 0, 20, 0, 10, eager=True))
    assert r.take_credit() == 0 and r.eager_bytes == 10  # staged: credit held
    r.post(1, memoryview(bytearray(20)))
    assert r.take_credit() == 10 and r.eager_bytes == 0
    r.place(data(1, 0, 20, 10, 10, eager=True))  # sent before the grant arrived; lands in the buffer
    r.chunk_done(data(1, 0, 20, 10, 10, eager=True))
    assert r.take_credit() == 10 and view.nbytes == 10


def test_granted_chunks_of_a_cancelled_receive_are_staged_not_refused():
    r = Reassembler()
    entry = r.post(2, memoryview(bytearray(20)))
    r.unpost(entry)
    r.place(data(2, 0, 20, 0, 20, eager=False))
    r.chunk_done(data(2, 0, 20, 0, 20, eager=False))
    out = bytearray(20)
    assert r.post(2, memoryview(out)).done and r.unexpected_bytes == 0


class World:
    """A sender and a receiver joined by in-order queues of frames (the link, minus sockets)."""

    def __init__(self, budget, chunk, seed):
        self.rng = random.Random(seed)
        self.sender = SendFlow(max_grants=64)
        self.receiver = Reassembler(Limits(max_unexpected_bytes=budget))
        self.chunk, self.budget = chunk, budget
        self.to_receiver, self.to_sender = [], [("credit", budget)]
        self.granted_total = budget
        self.payloads, self.buffers, self.entries = {}, {}, {}
        self.next_seq, self.posted, self.peak_staged = {}, {}, 0

    def send(self, tag, payload, window):
        seq = self.next_seq.get(tag, 0)
        self.next_seq[tag] = seq + 1
        self.payloads[(tag, seq)] = payload
        items = [((tag, seq, offset, length), length) for (offset, length), length in pieces(len(payload), self.chunk)]
        released, _announce = self.sender.start(tag, seq, items, window)
        self.to_receiver += released

    def post(self, tag):
        seq = self.posted.get(tag, 0)
        self.posted[tag] = seq + 1
        size = len(self.payloads[(tag, seq)])
        self.buffers[(tag, seq)] = buf = bytearray(size)
        entry = self.receiver.post(tag, memoryview(buf))
        self.entries[(tag, seq)] = entry
        if not entry.done:
            self.to_sender.append(("grant", tag, seq))
        self._return_credit()

    def _return_credit(self):
        due = self.receiver.take_credit()
        if due:
            self.granted_total += due
            self.to_sender.append(("credit", self.granted_total))

    def step(self):
        """Deliver one frame in either direction (random choice); False when both are idle."""
        ways = [w for w in ("down", "up") if (self.to_receiver if w == "down" else self.to_sender)]
        if not ways:
            return False
        if self.rng.choice(ways) == "down":
            (tag, seq, offset, length), eager = self.to_receiver.pop(0)
            header = data(tag, seq, len(self.payloads[(tag, seq)]), offset, length, eager)
            self.receiver.place(header)[:] = self.payloads[(tag, seq)][offset:offset + length]
            self.receiver.chunk_done(header)
            self.peak_staged = max(self.peak_staged, self.receiver.unexpected_bytes)
            self._return_credit()
        else:
            event = self.to_sender.pop(0)
            if event[0] == "credit":
                self.to_receiver += self.sender.on_credit(event[1])
            else:
                _, tag, seq = event
                self.to_receiver += self.sender.on_grant(tag, seq, started=seq < self.next_seq.get(tag, 0))
        return True


@settings(max_examples=150, deadline=None)
@given(sizes=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 400)), min_size=1, max_size=12),
       late=st.integers(0, 12), seed=st.integers(0, 2**32))
def test_late_receiver_stages_at_most_the_budget_and_every_message_arrives(sizes, late, seed):
    world = World(budget=100, chunk=16, seed=seed)
    for tag, size in sizes:
        world.send(tag, bytes(random.Random(seed + size).randbytes(size)), window=50)
    for _ in range(late * 10):  # the receiver is late: the sender runs alone
        world.step()
    for tag, _size in sizes:
        world.post(tag)
        for _ in range(world.rng.randrange(20)):
            world.step()
    while world.step():
        pass
    assert world.peak_staged <= world.budget
    for key, payload in world.payloads.items():
        assert world.entries[key].done and bytes(world.buffers[key]) == payload
    assert world.receiver.eager_bytes == 0 and world.sender.credit == world.budget  # all credit came back


def test_credit_is_held_back_until_a_batch_is_due_then_returned_whole():
    r = Reassembler()
    for seq in range(3):
        r.post(1, memoryview(bytearray(10)))
        r.place(data(1, seq, 10, 0, 10, eager=True))
        r.chunk_done(data(1, seq, 10, 0, 10, eager=True))
    assert r.take_credit(at_least=40) == 0  # 30 due: kept
    assert r.take_credit(at_least=30) == 30  # a batch: all of it, once
    assert r.take_credit(at_least=1) == 0 and r.take_credit() == 0
