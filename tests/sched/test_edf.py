"""Chunking and the EDF queue."""
import pytest

from wanlink.errors import ConfigError, ProtocolError
from wanlink.sched.chunking import (
    DEFAULT_CHUNK_SIZE, MAX_CHUNK_SIZE, MIN_CHUNK_SIZE, OutgoingTransfer, chunk_size_from, deadline_key,
)
from wanlink.sched.edf import EDFQueue


def transfer(tag, size, chunk=4, deadline=0):
    return OutgoingTransfer(tag, 0, memoryview(bytes(range(size))), chunk, deadline)


def test_chunks_cover_the_message_exactly():
    t = transfer(1, 10, chunk=4)
    assert [(c.offset, len(c.view)) for c in t.chunks] == [(0, 4), (4, 4), (8, 2)]
    assert b"".join(bytes(c.view) for c in t.chunks) == bytes(range(10))


def test_empty_message_is_one_empty_chunk():
    t = transfer(1, 0)
    assert [(c.offset, len(c.view)) for c in t.chunks] == [(0, 0)]


def test_acks_complete_a_transfer_and_duplicates_are_ignored():
    t = transfer(1, 10, chunk=4)
    assert t.ack(4, 4) and not t.ack(4, 4)
    assert t.ack(0, 4) and not t.complete
    assert t.ack(8, 2) and t.complete and t.acked_bytes == 10
    with pytest.raises(ProtocolError):
        t.ack(5, 4)


def test_edf_order_with_fifo_among_equal_deadlines():
    q = EDFQueue()
    late, early_a, early_b = transfer(1, 8, deadline=5), transfer(2, 8, deadline=1), transfer(3, 4, deadline=1)
    for t in (late, early_a, early_b):
        for c in t.chunks:
            q.push(c)
    order = []
    while (c := q.pop()) is not None:
        order.append((c.tag, c.offset))
    assert order == [(2, 0), (2, 4), (3, 0), (1, 0), (1, 4)]


def test_fcfs_ignores_deadlines_and_keeps_a_requeued_chunk_first():
    q = EDFQueue("fcfs")
    late, early = transfer(1, 8, deadline=(5, 0)), transfer(2, 4, deadline=(0, -3))
    for t in (late, early):
        for c in t.chunks:
            q.push(c)
    first = q.pop()
    q.push(first)  # its stream died: back at the head
    assert [(c.tag, c.offset) for c in iter(q.pop, None)] == [(1, 0), (1, 4), (2, 0)]


def test_unknown_chunk_order_is_refused():
    with pytest.raises(ConfigError, match="edf, fcfs"):
        EDFQueue("lifo")


def test_tuple_deadlines_order_by_iteration_then_layer():
    q = EDFQueue()
    for tag, deadline in [(1, (1, 0)), (2, (0, 5)), (3, (0, 2))]:
        q.push(transfer(tag, 1, deadline=deadline).chunks[0])
    assert [q.pop().tag for _ in range(3)] == [3, 2, 1]


def test_requeued_chunk_keeps_its_place():
    q = EDFQueue()
    t = transfer(1, 12)
    for c in t.chunks:
        q.push(c)
    first = q.pop()
    q.push(transfer(2, 4).chunks[0])  # same deadline, arrived later
    q.push(first)  # its stream died: it goes back ahead of later arrivals
    assert [q.pop().offset for _ in range(3)][:1] == [0]
    assert len(q.drain()) == 1 and q.pop() is None


def test_chunk_size_bounds(monkeypatch):
    monkeypatch.setenv("WANLINK_CHUNK_SIZE", str(2 * 1024 * 1024))  # the scheduler never reads it (the edges do)
    assert chunk_size_from(None) == DEFAULT_CHUNK_SIZE
    assert chunk_size_from(MIN_CHUNK_SIZE) == MIN_CHUNK_SIZE
    for bad in (MIN_CHUNK_SIZE - 1, MAX_CHUNK_SIZE + 1, "big", True):
        with pytest.raises(ConfigError, match="chunk size"):
            chunk_size_from(bad)


@pytest.mark.parametrize("bad", ["soon", None, True, (1, "a")])
def test_bad_deadlines_are_refused(bad):
    with pytest.raises(ConfigError):
        deadline_key(bad)
