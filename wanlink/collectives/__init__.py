"""wanlink.collectives: collective algorithms written against the small ``Comm`` interface.

``direct`` exchanges whole buffers with every peer in one round (few round trips: small tensors);
``ring`` moves pipelined pieces around a ring (each link carries ~2(n-1)/n of the data: large
tensors). Both work on flat, contiguous 1-D CPU tensors and know nothing of sockets or torch.distributed.
"""
from wanlink.collectives.base import Comm, Reducer, piece_bounds
from wanlink.collectives.reduce_ops import REDUCE_OPS, reducer_for

__all__ = ["Comm", "Reducer", "piece_bounds", "REDUCE_OPS", "reducer_for"]
