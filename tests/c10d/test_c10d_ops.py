"""Every collective of backend "wanlink" against gloo, in one spawned world per world layout.

Each world's default group is wanlink; ``dist.new_group(backend="gloo")`` gives the reference.
Values are small integers (also for floats), so every dtype's result is exact and compared with
``torch.equal``. Non-contiguous inputs are compared with gloo run on contiguous copies.
World 2 uses the default algorithm thresholds (its small collectives take the express path of a
one-host group, docs/c10d.md), world "2 loop" the same on the I/O loop (``WANLINK_EXPRESS=0``, the
path of groups across hosts); world 3 forces rings with many pieces; the site
worlds (``WANLINK_SITE`` per rank: 2 sites x 2 ranks, 2 + 1, 3 + 1) force the site-aware algorithms
(docs/sites.md) with many pieces.
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from tests.support.worlds import run_world

R = dist.ReduceOp
FLOATS = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
INTS = [torch.int8, torch.int32, torch.int64, torch.uint8]
SMALL, BIG = 37, 5003
MANY_PIECES = {"WANLINK_DIRECT_MAX_BYTES": "2048", "WANLINK_PIECE_BYTES": "4096"}
WORLDS = {  # name: (each rank's WANLINK_SITE, "" for unset; the environment of every rank)
    "2": (["", ""], {}),
    "2 loop": (["", ""], {"WANLINK_EXPRESS": "0"}),
    "3": (["", "", ""], MANY_PIECES),
    "sites 2x2": (["a", "a", "b", "b"], MANY_PIECES),
    "sites 2+1": (["a", "a", "b"], MANY_PIECES),
    "sites 3+1": (["a", "b", "a", "a"], MANY_PIECES),
}


def make(seed: int, shape, dtype, strided: bool = False, low: int = -3, high: int = 4) -> torch.Tensor:
    """Deterministic small-integer data; ``strided`` returns a non-contiguous view."""
    generator = torch.Generator().manual_seed(seed)
    full = list(shape)
    if strided:
        full[-1] *= 2
    if dtype == torch.bool:
        data = torch.randint(0, 2, full, generator=generator).bool()
    else:
        lo = 0 if dtype == torch.uint8 else low
        data = torch.randint(lo, high, full, generator=generator).to(dtype)
    return data[..., ::2] if strided else data


def expect_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.equal(actual, expected), f"{what}: {actual.flatten()[:8]} != {expected.flatten()[:8]}"


CASES: dict[str, callable] = {}


def case(name: str, **params):
    def register(fn):
        CASES[name] = functools.partial(fn, **params)
        return fn
    return register


# -- all_reduce ---------------------------------------------------------------------------------
def all_reduce_case(rank, size, gloo, *, dtype, op, numel, strided=False):
    low, high = (1, 3) if op == R.PRODUCT else (-3, 4)
    tensor = make(rank * 7 + 1, (numel,) if not strided else (3, numel), dtype, strided, low, high)
    expected = tensor.contiguous().clone()
    dist.all_reduce(expected, op=R.SUM if op == R.AVG else op, group=gloo)
    if op == R.AVG:
        expected = expected / size if dtype.is_floating_point else torch.div(expected, size, rounding_mode="trunc")
        expected = expected.to(dtype)
    work = dist.all_reduce(tensor, op=op, async_op=True)
    value = work.get_future().wait()
    assert value[0] is tensor or torch.equal(value[0], tensor), "future value is not the reduced tensor"
    work.wait()
    expect_equal(tensor, expected, f"all_reduce {op} {dtype}")


for _dtype in FLOATS:
    for _op in (R.SUM, R.AVG, R.PRODUCT, R.MIN, R.MAX):
        case(f"all_reduce-{_dtype}-{_op}-small", dtype=_dtype, op=_op, numel=SMALL)(all_reduce_case)
    case(f"all_reduce-{_dtype}-sum-big", dtype=_dtype, op=R.SUM, numel=BIG)(all_reduce_case)
for _dtype in INTS:
    for _op in (R.SUM, R.PRODUCT, R.MIN, R.MAX, R.BAND, R.BOR, R.BXOR):
        case(f"all_reduce-{_dtype}-{_op}-small", dtype=_dtype, op=_op, numel=SMALL)(all_reduce_case)
    case(f"all_reduce-{_dtype}-max-big", dtype=_dtype, op=R.MAX, numel=BIG)(all_reduce_case)
case("all_reduce-int64-avg", dtype=torch.int64, op=R.AVG, numel=SMALL)(all_reduce_case)
for _op in (R.SUM, R.MIN, R.MAX, R.PRODUCT, R.BOR, R.BAND):
    case(f"all_reduce-bool-{_op}", dtype=torch.bool, op=_op, numel=SMALL)(all_reduce_case)
case("all_reduce-zero-size", dtype=torch.float32, op=R.SUM, numel=0)(all_reduce_case)
case("all_reduce-noncontiguous-small", dtype=torch.float32, op=R.SUM, numel=5, strided=True)(all_reduce_case)
case("all_reduce-noncontiguous-big", dtype=torch.int32, op=R.MAX, numel=BIG, strided=True)(all_reduce_case)


@case("all_reduce-scalar")
def _(rank, size, gloo):
    tensor = torch.tensor(float(rank + 1))
    dist.all_reduce(tensor)
    expect_equal(tensor, torch.tensor(float(size * (size + 1) // 2)), "0-dim all_reduce")


@case("future-asked-after-wait")
def future_after_wait_case(rank, size, gloo):
    tensor = torch.full((5,), float(rank))
    work = dist.all_reduce(tensor, async_op=True)
    work.wait()  # finished before anyone asked for its future: get_future() completes it at once
    total = work.get_future().then(lambda future: future.value()[0].sum().item())
    assert total.wait() == 5 * sum(range(size)), "the future asked for late has no value"


@case("all_reduce-coalesced")
def _(rank, size, gloo):
    tensors = [make(rank, (5,), torch.float32), make(rank + 9, (2, 3), torch.float32)]
    expected = [t.clone() for t in tensors]
    for t in expected:
        dist.all_reduce(t, group=gloo)
    dist.all_reduce_coalesced(tensors)
    for got, want in zip(tensors, expected):
        expect_equal(got, want, "all_reduce_coalesced")


# -- broadcast, reduce --------------------------------------------------------------------------
def broadcast_case(rank, size, gloo, *, dtype, numel, strided=False):
    for root in range(size):
        tensor = make(rank * 3 + root, (2, numel), dtype, strided)
        expected = tensor.contiguous().clone()
        dist.broadcast(expected, src=root, group=gloo)
        dist.broadcast(tensor, src=root, async_op=True).wait()
        expect_equal(tensor, expected, f"broadcast root {root}")


for _dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.uint8):
    case(f"broadcast-{_dtype}", dtype=_dtype, numel=SMALL)(broadcast_case)
case("broadcast-big", dtype=torch.float16, numel=BIG)(broadcast_case)
case("broadcast-zero-size", dtype=torch.float32, numel=0)(broadcast_case)
case("broadcast-noncontiguous", dtype=torch.float64, numel=BIG, strided=True)(broadcast_case)


def reduce_case(rank, size, gloo, *, dtype, op, numel, strided=False):
    for root in range(size):
        tensor = make(rank + 5 * root, (numel, 2), dtype, strided)
        original = tensor.clone()
        expected = tensor.contiguous().clone()
        dist.reduce(expected, dst=root, op=op, group=gloo)
        dist.reduce(tensor, dst=root, op=op)
        if rank == root:
            expect_equal(tensor, expected, f"reduce root {root}")
        else:
            expect_equal(tensor, original, f"reduce must leave non-root rank {rank} unchanged")


case("reduce-float32-sum", dtype=torch.float32, op=R.SUM, numel=SMALL)(reduce_case)
case("reduce-int32-min-big", dtype=torch.int32, op=R.MIN, numel=BIG)(reduce_case)
case("reduce-bfloat16-max-noncontiguous", dtype=torch.bfloat16, op=R.MAX, numel=BIG, strided=True)(reduce_case)
case("reduce-zero-size", dtype=torch.int8, op=R.SUM, numel=0)(reduce_case)


# -- gathers and scatters -----------------------------------------------------------------------
def all_gather_case(rank, size, gloo, *, dtype, numel, strided=False):
    tensor = make(rank, (numel,), dtype)
    outputs = [make(99, (1, numel), dtype, strided)[0] for _ in range(size)]
    expected = [torch.empty(numel, dtype=dtype) for _ in range(size)]
    dist.all_gather(expected, tensor, group=gloo)
    dist.all_gather(outputs, tensor, async_op=True).wait()
    for k in range(size):
        expect_equal(outputs[k], expected[k], f"all_gather slot {k}")
    flat = torch.empty(size * numel, dtype=dtype)
    flat_expected = torch.empty_like(flat)
    dist.all_gather_into_tensor(flat_expected, tensor, group=gloo)
    dist.all_gather_into_tensor(flat, tensor)
    expect_equal(flat, flat_expected, "all_gather_into_tensor")


for _dtype in (torch.float32, torch.float16, torch.int64, torch.bool):
    case(f"all_gather-{_dtype}", dtype=_dtype, numel=SMALL)(all_gather_case)
case("all_gather-big-noncontiguous-outputs", dtype=torch.bfloat16, numel=BIG, strided=True)(all_gather_case)
case("all_gather-zero-size", dtype=torch.float32, numel=0)(all_gather_case)


def reduce_scatter_case(rank, size, gloo, *, dtype, op, numel):
    inputs = [make(rank * 11 + k, (numel,), dtype) for k in range(size)]
    output, expected = torch.empty(numel, dtype=dtype), torch.empty(numel, dtype=dtype)
    dist.reduce_scatter(expected, [t.clone() for t in inputs], op=op, group=gloo)
    dist.reduce_scatter(output, inputs, op=op, async_op=True).wait()
    expect_equal(output, expected, "reduce_scatter")
    flat = torch.cat(inputs)
    dist.reduce_scatter_tensor(output, flat, op=op)
    expect_equal(output, expected, "reduce_scatter_tensor")
    expect_equal(flat, torch.cat(inputs), "reduce_scatter_tensor must not modify its input")


case("reduce_scatter-float32-sum", dtype=torch.float32, op=R.SUM, numel=SMALL)(reduce_scatter_case)
case("reduce_scatter-int64-max-big", dtype=torch.int64, op=R.MAX, numel=BIG)(reduce_scatter_case)
case("reduce_scatter-bfloat16-sum-big", dtype=torch.bfloat16, op=R.SUM, numel=BIG)(reduce_scatter_case)
case("reduce_scatter-zero-size", dtype=torch.float32, op=R.SUM, numel=0)(reduce_scatter_case)


@case("in-place-chunks")
def _(rank, size, gloo):
    """FSDP-style calls whose output (all_gather) or input (reduce_scatter) holds the other."""
    buffer = torch.zeros(size * 5)
    buffer.view(size, 5)[rank] = make(rank, (5,), torch.float32)
    dist.all_gather_into_tensor(buffer, buffer.view(size, 5)[rank])
    expect_equal(buffer, torch.cat([make(k, (5,), torch.float32) for k in range(size)]), "in-place all_gather")
    full = make(rank + 20, (size * 5,), torch.float32)
    expected = torch.empty(5)
    dist.reduce_scatter_tensor(expected, full.clone(), group=gloo)
    dist.reduce_scatter_tensor(full.view(size, 5)[rank], full)
    expect_equal(full.view(size, 5)[rank], expected, "in-place reduce_scatter_tensor")


def coalesced_all_gather_case(rank, size, gloo, *, numel):
    """all_gather_coalesced, and all_gather_into_tensor (mixed dtypes) in a coalescing manager."""
    inputs = [make(rank, (numel,), torch.float32), make(rank + 5, (2, 3), torch.float32)]
    output_lists = [[make(99, (1, numel), torch.float32, strided=True)[0], torch.empty(2, 3)] for _ in range(size)]
    expected = [[torch.empty_like(t) for _ in range(size)] for t in inputs]
    for want, tensor in zip(expected, inputs):
        dist.all_gather(want, tensor, group=gloo)
    dist.all_gather_coalesced(output_lists, inputs)
    for k in range(size):
        for i in range(len(inputs)):
            expect_equal(output_lists[k][i], expected[i][k], f"all_gather_coalesced rank {k} input {i}")
    sources = [make(rank, (numel,), torch.bfloat16), make(rank + 1, (3,), torch.int64),
               make(rank + 2, (5,), torch.bool)]
    outputs = [torch.empty(size * numel, dtype=torch.bfloat16), torch.empty(size, 3, dtype=torch.int64),
               torch.zeros(size * 5 * 2, dtype=torch.bool)[::2]]
    with dist._coalescing_manager(async_ops=True) as manager:
        for output, source in zip(outputs, sources):
            dist.all_gather_into_tensor(output, source, async_op=True)
    manager.wait()
    for output, source in zip(outputs, sources):
        want = torch.empty(size * source.numel(), dtype=source.dtype)
        dist.all_gather_into_tensor(want, source, group=gloo)
        expect_equal(output.reshape(-1), want, f"coalesced all_gather_into_tensor {source.dtype}")


case("coalesced-all_gather-small", numel=SMALL)(coalesced_all_gather_case)
case("coalesced-all_gather-big", numel=BIG)(coalesced_all_gather_case)


def coalesced_reduce_scatter_case(rank, size, gloo, *, numel):
    """reduce_scatter_tensor in a coalescing manager (FSDP's pattern), SUM and MAX, in place too."""
    for op, dtype in ((R.SUM, torch.float32), (R.MAX, torch.int64)):
        inputs = [make(rank * 3 + i, (size * n,), dtype) for i, n in enumerate((numel, 4, 0))]
        outputs = [torch.empty(n, dtype=dtype) for n in (numel, 4, 0)]
        expected = [torch.empty_like(t) for t in outputs]
        for want, source in zip(expected, inputs):
            dist.reduce_scatter_tensor(want, source.clone(), op=op, group=gloo)
        outputs[0] = inputs[0].view(size, numel)[rank]  # in place: an output inside its own input
        with dist._coalescing_manager():
            for output, source in zip(outputs, inputs):
                dist.reduce_scatter_tensor(output, source, op=op)
        for output, want in zip(outputs, expected):
            expect_equal(output, want, f"coalesced reduce_scatter_tensor {op} {dtype}")


case("coalesced-reduce_scatter-small", numel=SMALL)(coalesced_reduce_scatter_case)
case("coalesced-reduce_scatter-big", numel=BIG)(coalesced_reduce_scatter_case)


@case("reduce_scatter-avg")
def _(rank, size, gloo):
    inputs = [torch.full((4,), float(rank + k)) for k in range(size)]
    output = torch.empty(4)
    dist.reduce_scatter(output, inputs, op=R.AVG)
    expect_equal(output, torch.full((4,), sum(r + rank for r in range(size)) / size), "reduce_scatter AVG")


def gather_scatter_case(rank, size, gloo, *, dtype, numel, strided=False):
    for root in range(size):
        tensor = make(rank + root, (numel,), dtype)
        gathered = [torch.empty(numel, dtype=dtype) for _ in range(size)] if rank == root else None
        expected = [torch.empty(numel, dtype=dtype) for _ in range(size)] if rank == root else None
        dist.gather(tensor, expected, dst=root, group=gloo)
        dist.gather(tensor, gathered, dst=root)
        if rank == root:
            for k in range(size):
                expect_equal(gathered[k], expected[k], f"gather root {root} slot {k}")
        pieces = [make(100 + k + root, (numel,), dtype) for k in range(size)] if rank == root else None
        output = make(5, (1, numel), dtype, strided)[0]
        reference = torch.empty(numel, dtype=dtype)
        dist.scatter(reference, [p.clone() for p in pieces] if pieces else None, src=root, group=gloo)
        dist.scatter(output, pieces, src=root, async_op=True).wait()
        expect_equal(output, reference, f"scatter root {root}")


case("gather_scatter-float32", dtype=torch.float32, numel=SMALL)(gather_scatter_case)
case("gather_scatter-int8-big-noncontiguous", dtype=torch.int8, numel=BIG, strided=True)(gather_scatter_case)
case("gather_scatter-bool", dtype=torch.bool, numel=SMALL)(gather_scatter_case)


@case("all_to_all")
def _(rank, size, gloo):
    inputs = [make(rank * 10 + k, (2, 3), torch.float32) for k in range(size)]
    outputs = [torch.empty(2, 3) for _ in range(size)]
    expected = [torch.empty(2, 3) for _ in range(size)]
    dist.all_to_all(expected, [t.clone() for t in inputs], group=gloo)
    dist.all_to_all(outputs, inputs, async_op=True).wait()
    for k in range(size):
        expect_equal(outputs[k], expected[k], f"all_to_all slot {k}")
    # uneven sizes (gloo refuses these): block k of rank r has k + 1 rows
    uneven_in = [make(rank * 10 + k, (k + 1, 2), torch.int32) for k in range(size)]
    uneven_out = [torch.empty(rank + 1, 2, dtype=torch.int32) for _ in range(size)]
    dist.all_to_all(uneven_out, uneven_in)
    for k in range(size):
        expect_equal(uneven_out[k], make(k * 10 + rank, (rank + 1, 2), torch.int32), f"uneven all_to_all slot {k}")


@case("all_to_all_single")
def _(rank, size, gloo):
    equal_in = make(rank, (size * 3, 4), torch.int64)
    equal_out, equal_expected = torch.empty_like(equal_in), torch.empty_like(equal_in)
    dist.all_to_all_single(equal_expected, equal_in, group=gloo)
    dist.all_to_all_single(equal_out, equal_in)
    expect_equal(equal_out, equal_expected, "all_to_all_single (equal splits)")
    input_splits = [(rank + k) % 3 for k in range(size)]           # rows rank sends to k
    output_splits = [(k + rank) % 3 for k in range(size)]          # rows k sends to rank
    source = make(rank + 50, (sum(input_splits), 5), torch.float16)
    out = torch.empty(sum(output_splits), 5, dtype=torch.float16)
    expected = torch.empty_like(out)
    dist.all_to_all_single(expected, source, output_splits, input_splits, group=gloo)
    dist.all_to_all_single(out, source, output_splits, input_splits, async_op=True).wait()
    expect_equal(out, expected, "all_to_all_single (split sizes)")


# -- synchronisation, point to point, groups ----------------------------------------------------
@case("barrier")
def _(rank, size, gloo):
    dist.barrier()
    dist.barrier(async_op=True).wait()
    from wanlink.c10d import monitored_barrier
    monitored_barrier(wait_all_ranks=True)


@case("send_recv")
def _(rank, size, gloo):
    right, left = (rank + 1) % size, (rank - 1) % size
    outgoing = make(rank, (6,), torch.bfloat16)
    incoming = torch.empty(6, dtype=torch.bfloat16)
    if rank % 2 == 0:
        dist.send(outgoing, right, tag=3)
        dist.recv(incoming, left, tag=3)
    else:
        dist.recv(incoming, left, tag=3)
        dist.send(outgoing, right, tag=3)
    expect_equal(incoming, make(left, (6,), torch.bfloat16), "send/recv")
    first, second = torch.empty(4), torch.empty(4)
    requests = [dist.isend(torch.full((4,), rank + 0.5), right, tag=9),
                dist.isend(torch.full((4,), rank + 0.25), right, tag=9),
                dist.irecv(first, left, tag=9), dist.irecv(second, left, tag=9)]
    for request in requests:
        request.wait()
    expect_equal(first, torch.full((4,), left + 0.5), "isend/irecv FIFO per tag (first)")
    expect_equal(second, torch.full((4,), left + 0.25), "isend/irecv FIFO per tag (second)")
    column = torch.zeros(3, 4)[:, 1]
    ops = [dist.P2POp(dist.isend, make(rank, (3,), torch.float32), right),
           dist.P2POp(dist.irecv, column, left)]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    expect_equal(column, make(left, (3,), torch.float32), "batch_isend_irecv into a non-contiguous view")


@case("recv_anysource")
def _(rank, size, gloo):
    """recv/irecv without src: every message delivered exactly once, its sender reported (global rank)."""
    senders = list(range(1, size)) * 2  # in a world of 2, rank 1 sends twice per tag
    if rank == 0:
        received = []
        for _ in senders:  # blocking recv returns the sender
            tensor = torch.empty(2)
            source = dist.recv(tensor, tag=11)
            received.append((source, int(tensor[0]), int(tensor[1])))
        pending = [(dist.irecv(tensor, tag=12), tensor) for tensor in [torch.empty(2, dtype=torch.int64)
                                                                        for _ in senders]]
        dist.barrier(group=gloo)  # every tag-12 receive is posted before anything is sent on it
        for work, tensor in pending:
            work.wait()
            received.append((work._source_rank(), int(tensor[0]), int(tensor[1])))
        sent = sorted((source, senders[:k].count(source)) for k, source in enumerate(senders))
        for batch in (received[:len(senders)], received[len(senders):]):
            assert all(source == value for source, value, _ in batch), batch
            assert sorted((source, turn) for source, _, turn in batch) == sent, batch
    else:
        for turn in range(senders.count(rank)):
            dist.send(torch.tensor([rank, turn], dtype=torch.float32), 0, tag=11)
        dist.barrier(group=gloo)
        for turn in range(senders.count(rank)):
            dist.send(torch.tensor([rank, turn]), 0, tag=12)
    pair = dist.new_group([0, size - 1], backend="wanlink")
    if rank == 0:
        assert dist.recv(torch.empty(1), group=pair) == size - 1  # the global rank, not the group rank
    elif rank == size - 1:
        dist.send(torch.ones(1), group_dst=0, group=pair)


@case("subgroups")
def _(rank, size, gloo):
    members = [0, size - 1]
    pair = dist.new_group(members, backend="wanlink")
    everyone = dist.new_group(backend="wanlink")
    tensor = torch.full((3,), float(rank + 1))
    if rank in members:
        dist.all_reduce(tensor, group=pair)
        expect_equal(tensor, torch.full((3,), float(1 + size)), "subgroup all_reduce")
        dist.broadcast(tensor, group_src=1, group=pair)
    other = torch.full((2,), float(rank))
    dist.all_reduce(other, group=everyone, op=R.MAX)
    expect_equal(other, torch.full((2,), float(size - 1)), "second world-sized group")
    assert dist.get_backend(pair if rank in members else everyone) == "wanlink"


@case("site_map")
def _(rank, size, gloo):
    import os

    import wanlink
    from wanlink.c10d import site_map

    names = [None] * size
    dist.all_gather_object(names, os.environ.get("WANLINK_SITE"), group=gloo)
    described = site_map()
    cells = {}
    for peer, name in enumerate(names):  # unset: every rank here is on this host, so in its site
        cells.setdefault(name or described["site"], []).append(peer)
    assert described["cells"] == cells and described["site"] == (names[rank] or described["site"]), described
    assert described["local_dp_rank"] == cells[described["site"]].index(rank)
    assert described["site_aware"] == (len(cells) > 1), described  # every site world here pays off
    for link in wanlink.stats().values():
        assert link["site"] == described["site"] and link["peer_site"] == (names[link["peer_rank"]] or link["site"])
    pair = dist.new_group([0, size - 1], backend="wanlink")
    if rank in (0, size - 1):
        together = names[0] == names[-1]
        assert sorted(site_map(pair)["cells"].values()) == ([[0, 1]] if together else [[0], [1]])
        assert site_map(pair)["site_aware"] is False  # two ranks: a ring swaps as much


@case("profiler-ranges")
def _(rank, size, gloo):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        dist.all_reduce(torch.ones(4))
        dist.broadcast(torch.ones(4), src=0)
    names = {event.name for event in profile.events()}
    assert {"wanlink:all_reduce", "wanlink:broadcast"} <= names, sorted(n for n in names if "wanlink" in n)


def run_all_cases(rank: int, size: int) -> dict:
    """Rank body: every case in order (all ranks agree on it); returns case -> error text or None."""
    import traceback

    gloo = dist.new_group(backend="gloo")
    outcomes = {}
    for name, body in CASES.items():
        try:
            body(rank, size, gloo)
            outcomes[name] = None
        except Exception as error:  # noqa: BLE001 - reported per case
            outcomes[name] = f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=4)}"
    dist.barrier(group=gloo)
    return outcomes


@functools.lru_cache(maxsize=None)
def _world(world: str):
    """Run each world once; a failed world is remembered too (not re-run per case)."""
    sites, env = WORLDS[world]
    rank_env = [{"WANLINK_SITE": site} if site else {} for site in sites]
    try:
        return run_world(len(sites), run_all_cases, env=env, rank_env=rank_env, timeout=240), None
    except Exception as error:  # noqa: BLE001 - reported by every case of that world
        return None, error


def world_outcomes(world: str) -> list[dict]:
    outcomes, error = _world(world)
    if error is not None:
        raise error
    return outcomes


@pytest.mark.parametrize("world", list(WORLDS))
@pytest.mark.parametrize("name", list(CASES))
def test_matches_gloo(name, world):
    failures = [f"rank {rank}: {outcome[name]}" for rank, outcome in enumerate(world_outcomes(world))
                if outcome[name] is not None]
    assert not failures, "\n".join(failures)
