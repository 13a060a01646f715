"""Copies that sends finishing before their acks keep (sans-I/O): pooled, reused, never shared early."""
from wanlink.sched.chunking import CopyPool, OutgoingTransfer


def written_transfer(payload: bytearray, chunk_size: int) -> OutgoingTransfer:
    transfer = OutgoingTransfer(1, 0, memoryview(payload), chunk_size)
    for chunk in transfer.chunks:
        transfer.written(chunk)
    return transfer


def ack_all(transfer: OutgoingTransfer) -> None:
    for chunk in transfer.chunks:
        transfer.ack(chunk.offset, len(chunk.view))


def test_unacked_chunks_are_copied_into_a_pool_buffer_that_comes_back_once_all_are_acked():
    pool = CopyPool(1 << 20, keep=2)
    payload = bytearray(range(256)) * 4096  # 1 MiB, four chunks
    transfer = written_transfer(payload, 256 * 1024)
    transfer.ack(0, 256 * 1024)  # acknowledged already: not copied
    assert transfer.keep_unacked(pool) == 3 * 256 * 1024
    original = bytes(payload)
    payload[:] = bytes(len(payload))  # the sender reuses its buffer
    assert b"".join(bytes(chunk.view) for chunk in transfer.chunks[1:]) == original[256 * 1024:]
    copy = transfer.chunks[1].view.obj
    assert isinstance(copy, bytearray) and all(chunk.view.obj is copy for chunk in transfer.chunks[1:])
    transfer.release_copy(pool)  # not complete yet: a re-send may still need it
    assert pool.take() is not copy
    ack_all(transfer)
    transfer.release_copy(pool)
    assert pool.take() is copy  # warm: the next settled send copies into it


def test_a_copy_being_written_again_is_not_reused_and_large_copies_stay_private():
    pool = CopyPool(1 << 20, keep=2)
    transfer = written_transfer(bytearray(512 * 1024), 256 * 1024)
    transfer.keep_unacked(pool)
    copy = transfer.chunks[0].view.obj
    transfer.requeued(transfer.chunks[1])  # its stream died: a writer sends it again from the copy
    ack_all(transfer)
    transfer.release_copy(pool)
    assert pool.take() is not copy
    big = written_transfer(bytearray(2 << 20), 1 << 20)
    assert big.keep_unacked(pool) == 2 << 20
    assert all(type(chunk.view.obj) is bytes for chunk in big.chunks)  # more than a pool buffer holds
