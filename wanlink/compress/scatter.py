"""Adding received blocks into a dense accumulator."""
import numpy as np

from wanlink import kernels
from wanlink.errors import ConfigError
from wanlink.kernels.arrays import block_count, block_values_view, check_block_size, flat_view


def _as_peer_list(indices, values) -> list[tuple]:
    if isinstance(indices, (list, tuple)):
        if not isinstance(values, (list, tuple)) or len(values) != len(indices):
            raise ConfigError("pass one values array per indices array (one pair per peer)")
        return list(zip(indices, values))
    return [(indices, values)]


def scatter_add_(dense, indices, values, *, block: int | None = None):
    """Add blocks into ``dense`` (a contiguous float32 tensor or array, reused across calls); returns it.

    ``indices``/``values`` are one peer's sorted int32 block ids and float32 values of shape
    (count, block) — or lists of them, one pair per peer, added in order. ``block`` defaults to
    values.shape[1] (2-D values) or 16. Elements past ``dense``'s end (tail padding) are ignored.
    """
    target = flat_view(dense, np.float32, "dense", writable=True)
    implementation = kernels.active()
    checked = []  # every peer is validated before any is added, so a bad one leaves dense untouched
    for peer, (peer_indices, peer_values) in enumerate(_as_peer_list(indices, values)):
        peer_block = block if block is not None else (peer_values.shape[1] if peer_values.ndim == 2 else 16)
        peer_block = check_block_size(peer_block)
        ids = flat_view(peer_indices, np.int32, f"indices of peer {peer}")
        flat_values = block_values_view(peer_values, ids.shape[0], peer_block, f"values of peer {peer}")
        nblocks = block_count(target.shape[0], peer_block)
        bad = implementation.first_invalid_block_index(ids, nblocks)
        if bad >= 0:
            raise ConfigError(f"indices of peer {peer}: [{bad}] = {int(ids[bad])} is out of [0, {nblocks}) "
                              "or not increasing")
        checked.append((ids, flat_values, peer_block))
    threads = kernels.num_threads()
    for ids, flat_values, peer_block in checked:
        implementation.scatter_add_blocks(target, ids, flat_values, peer_block, threads)
    return dense
