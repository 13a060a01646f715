"""Optimizers for block-sparse gradients."""
from wanlink.optim.sparse_sgd import SparseSGD

__all__ = ["SparseSGD"]
