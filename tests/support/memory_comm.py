"""An in-memory Comm for the collective algorithms: every member is a coroutine of one event loop."""
import asyncio

import torch

from wanlink.collectives.reduce_ops import reducer_for


class MemoryComm:
    """Members of one world in one event loop, matched like the transport: the k-th send from A
    to B on a piece is received by the k-th recv B posts for A on that piece (strict FIFO)."""

    def __init__(self, world: dict, rank: int, size: int, piece_bytes: int):
        self.world, self.rank, self.size, self.piece_bytes = world, rank, size, piece_bytes
        self.sent_bytes = 0

    def _slot(self, src: int, dst: int, piece: int, counter: str) -> asyncio.Future:
        key = (src, dst, piece)
        index = self.world.setdefault((counter, key), 0)
        self.world[(counter, key)] = index + 1
        slots = self.world.setdefault("slots", {})
        return slots.setdefault((key, index), asyncio.get_running_loop().create_future())

    async def send(self, peer, tensor, piece=0):
        assert peer != self.rank and tensor.is_contiguous()
        if tensor.numel():
            self.sent_bytes += tensor.numel() * tensor.element_size()
            # zero-copy like the transport: the receiver reads the buffer later, then acknowledges
            acknowledged = asyncio.Event()
            self._slot(self.rank, peer, piece, "sent").set_result((tensor, acknowledged))
            await acknowledged.wait()

    async def recv(self, peer, tensor, piece=0):
        assert peer != self.rank and tensor.is_contiguous()
        if tensor.numel():
            slot = self._slot(peer, self.rank, piece, "posted")
            message, acknowledged = await slot
            assert message.numel() == tensor.numel(), "message size differs from the posted buffer"
            await asyncio.sleep(0)  # let the sender run on (it must not touch the buffer meanwhile)
            tensor.copy_(message)
            acknowledged.set()
            slot.consumed = True

    async def compute(self, fn, *args):
        fn(*args)

    def empty(self, numel, dtype):
        return torch.full((numel,), 77, dtype=dtype)  # garbage that must be overwritten


def run_members(size, member, piece_bytes=64):
    """Run ``member(comm)`` for every rank concurrently; return their results in rank order."""
    async def main():
        world = {}
        comms = [MemoryComm(world, rank, size, piece_bytes) for rank in range(size)]
        results = await asyncio.wait_for(asyncio.gather(*(member(comm) for comm in comms)), 20)
        leftovers = [key for key, slot in world.get("slots", {}).items() if not getattr(slot, "consumed", False)]
        assert not leftovers, f"messages nobody received: {leftovers}"
        return results
    return asyncio.run(main())


def data(rank, numel, dtype=torch.float32):
    generator = torch.Generator().manual_seed(rank)
    if dtype.is_floating_point:
        return torch.randint(-8, 8, (numel,), generator=generator).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, (numel,), generator=generator).bool()
    return torch.randint(0, 100, (numel,), generator=generator).to(dtype)


def reference(op, tensors):
    result = tensors[0].clone()
    for tensor in tensors[1:]:
        reducer_for(op, result.dtype, "test")(result, tensor)
    return result
