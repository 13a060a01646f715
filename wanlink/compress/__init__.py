"""Block-sparse gradient compression: selection with error feedback, the wire codec, and scatter-add.

Kernels come from ``wanlink.kernels`` (compiled when built, NumPy otherwise).
"""
from wanlink.compress.codec import BlockFrame, decode_blocks, encode_blocks, encoded_size
from wanlink.compress.scatter import scatter_add_
from wanlink.compress.sparsifier import BlockSparsifier, BucketSparsifier, NonFiniteGradientError, target_blocks

__all__ = [
    "BlockFrame", "BlockSparsifier", "BucketSparsifier", "NonFiniteGradientError", "decode_blocks", "encode_blocks",
    "encoded_size", "scatter_add_", "target_blocks",
]
