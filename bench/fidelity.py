"""Fidelity matrix of the block-sparse path: model shapes x optimizers x staleness x seeds, against dense DDP.

Two ranks over loopback train each shape (SHAPES below: a digits MLP, a digits CNN, a
byte-level transformer LM on standard-library source) with the same seeds in every cell: dense
DDP on gloo, and wanlink's block-sparse hook at 1 % density with staleness 0 and 1. Optimizers:
torch SGD with momentum 0.9 (on the sparse path the momentum moves into the hook:
``BlockSparseState(momentum=0.9)`` + ``SGD(momentum=0)``; a momentum SGD behind a plain state is
refused, and that cell records the message), torch AdamW (beta1 likewise moves into the hook:
``AdamW(betas=(0, 0.999))``; AdamW's own beta1 is refused), and wanlink's SparseSGD
(``sparse_optimizer=True``) with its own momentum ("sparse-sgd") or the hook's ("sparse-sgd-hook").
Prints mean and worst final accuracy (or held-out loss) per cell and whether the worst seed is
within 1 point (2 % relative loss) of dense's mean, and how many seeds' fidelity guard warned
(wanlink/c10d/fidelity_guard.py; a missed cell whose seeds all warned is "warned"; ``--judge-only``
stops each run once its guard has judged and records only the verdict); writes fidelity.{json,png} to --out
(bench/results/ with --publish). Runs are deterministic per seed, so the matrix can be measured in
parts (--shapes/--optimizers/--modes, --name) and merged (--merge A.json B.json ...).

    python3 dev.py bench bench/fidelity.py [--shapes digits-mlp digits-cnn stdlib-lm] [--seeds 5] [--publish]
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist

# -- model shapes and their offline data ---------------------------------------------------------
BATCH = 16  # per rank


@dataclass(frozen=True)
class Shape:
    name: str
    metric: str  # "accuracy" (higher is better, %) or "loss" (lower is better)
    steps: int
    sgd_lr: float
    adam_lr: float


SHAPES = {
    "digits-mlp": Shape("digits-mlp", "accuracy", steps=600, sgd_lr=0.05, adam_lr=1e-3),
    "digits-cnn": Shape("digits-cnn", "accuracy", steps=600, sgd_lr=0.05, adam_lr=2e-3),
    "stdlib-lm": Shape("stdlib-lm", "loss", steps=1200, sgd_lr=0.1, adam_lr=2e-3),
    # the report: a ~24M-parameter MLP on digits (bench/collapse.py; too slow for the matrix)
    "digits-mlp-24m": Shape("digits-mlp-24m", "accuracy", steps=450, sgd_lr=0.01, adam_lr=1e-4),
}
DEFAULT_SHAPES = ("digits-mlp", "digits-cnn", "stdlib-lm")

STDLIB_FILES = ("argparse.py", "inspect.py", "typing.py", "dataclasses.py", "enum.py", "functools.py")
CONTEXT = 32
VOCAB = 128  # ASCII; other bytes map to "?"


def _digits(standardise: bool):
    from bench.convergence import load_split  # scikit-learn's bundled digits, a fixed 80/20 split

    train_x, train_y, test_x, test_y = load_split()
    if standardise:
        mean, std = train_x.mean(0), train_x.std(0) + 1e-6
        train_x, test_x = (train_x - mean) / std, (test_x - mean) / std
    return train_x, train_y, test_x, test_y


class TinyLM(torch.nn.Module):
    """A 2-layer pre-norm causal transformer over bytes (~110k parameters)."""

    def __init__(self, width: int = 64, layers: int = 2, heads: int = 4):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, width)
        self.position = torch.nn.Parameter(torch.zeros(CONTEXT, width))
        layer = torch.nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True,
                                                 norm_first=True)
        self.blocks = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, VOCAB)
        # a constant, not a buffer: DDP broadcasts buffers before every forward (one WAN round trip a step)
        self.mask = torch.nn.Transformer.generate_square_subsequent_mask(CONTEXT)

    def forward(self, tokens):
        hidden = self.embed(tokens) + self.position[: tokens.shape[1]]
        hidden = self.blocks(hidden, mask=self.mask[: tokens.shape[1], : tokens.shape[1]], is_causal=True)
        return self.head(self.norm(hidden))


def stdlib_text() -> torch.Tensor:
    """The bytes of a few standard-library modules, as int64 tokens below VOCAB."""
    root = Path(sysconfig.get_paths()["stdlib"])
    raw = b"".join((root / name).read_bytes() for name in STDLIB_FILES)
    tokens = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.int64)
    return torch.where(tokens < VOCAB, tokens, torch.full_like(tokens, ord("?")))


class Task:
    """One shape's model and data for one rank of a 2-rank run, all fixed by ``seed``."""

    def __init__(self, shape: Shape, seed: int, rank: int, world: int):
        self.shape, self.seed, self.rank, self.world = shape, seed, rank, world
        torch.manual_seed(seed)
        if shape.name == "stdlib-lm":
            self.model = TinyLM()
            text = stdlib_text()
            cut = int(0.9 * text.numel())
            self.train_text, test_text = text[:cut], text[cut:]
            windows = (test_text.numel() - 1) // CONTEXT  # all of the held-out 10 %, ~52k bytes
            self.test = (test_text[:windows * CONTEXT].view(windows, CONTEXT),
                         test_text[1:windows * CONTEXT + 1].view(windows, CONTEXT))
        else:
            cnn = shape.name == "digits-cnn"
            self.model = _digits_cnn() if cnn else _digits_mlp(shape.name)
            train_x, train_y, test_x, test_y = _digits(standardise=not cnn)
            if cnn:
                train_x, test_x = train_x.view(-1, 1, 8, 8), test_x.view(-1, 1, 8, 8)
            self.shard = (train_x[rank::world], train_y[rank::world])
            self.test = (test_x, test_y)

    def batch(self, step: int):
        """The rank's batch for ``step``: its shard reshuffled every epoch, or random LM windows."""
        generator = torch.Generator().manual_seed(1_000_003 * self.seed + 7919 * step + self.rank)
        if self.shape.name == "stdlib-lm":
            starts = torch.randint(0, self.train_text.numel() - CONTEXT - 1, (BATCH,), generator=generator)
            return (torch.stack([self.train_text[s:s + CONTEXT] for s in starts]),
                    torch.stack([self.train_text[s + 1:s + CONTEXT + 1] for s in starts]))
        x, y = self.shard
        per_epoch = len(y) // BATCH
        epoch = torch.Generator().manual_seed(1_000_003 * self.seed + 104_729 * (step // per_epoch) + self.rank)
        order = torch.randperm(len(y), generator=epoch)
        index = order[(step % per_epoch) * BATCH:(step % per_epoch + 1) * BATCH]
        return x[index], y[index]

    def loss(self, output, target):
        return torch.nn.functional.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))

    @torch.no_grad()
    def evaluate(self) -> float:
        """Test accuracy in % (digits) or held-out loss in nats per byte (LM)."""
        x, y = self.test
        output = self.model(x)
        if self.shape.metric == "loss":
            return self.loss(output, y).item()
        return 100.0 * (output.argmax(1) == y).float().mean().item()


def _digits_mlp(name: str):
    widths = (64, 4096, 4096, 1536, 10) if name == "digits-mlp-24m" else (64, 256, 256, 10)
    layers = []
    for fan_in, fan_out in zip(widths[:-1], widths[1:]):
        layers += [torch.nn.Linear(fan_in, fan_out), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def _digits_cnn():
    return torch.nn.Sequential(torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.ReLU(),
                               torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                               torch.nn.Flatten(), torch.nn.Linear(32 * 4 * 4, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 10))


# -- the matrix ------------------------------------------------------------------------------------
DENSITY = 0.01
MOMENTUM = 0.9
WARMUP_STEPS = 50
EVALUATIONS = 10  # points on each curve
# optimizer name -> the dense baseline its cells are compared against
OPTIMIZERS = {"sgd": "sgd", "adamw": "adamw", "sparse-sgd": "sgd", "sparse-sgd-hook": "sgd"}
MODES = ("dense", "sparse s0", "sparse s1")
# What a new user writes and the sparse path refuses (SGD's collapse: bench/collapse.py): each is run once
# per shape and staleness to record the refusal.
UNSAFE = ("sgd, momentum in the optimizer", "adamw, beta1 in the optimizer")
ADAM_BETAS = (0.9, 0.999)
TOLERANCE = {"accuracy": 1.0, "loss": 0.02}  # points; relative
# Learning-rate schedules, the same for every arm: "constant" (each shape's rate throughout), or "cosine":
# linear warm-up over the first LR_WARMUP of the steps, then cosine decay to zero at the last step.
SCHEDULES = ("constant", "cosine")
LR_WARMUP = 0.05


def lr_factor(schedule: str, step: int, steps: int) -> float:
    """The multiple of the shape's learning rate that optimizer step ``step`` (0-based) of ``steps`` uses."""
    if schedule == "constant":
        return 1.0
    warmup = max(1, round(LR_WARMUP * steps))
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1.0 + math.cos(math.pi * (step - warmup + 1) / (steps - warmup + 1)))


class UncheckedMomentumSGD:
    """torch.optim.SGD(momentum)'s update written out (torch's functional ``sgd``), outside torch.optim's step
    hooks: bench/collapse.py uses it to show what the combination the sparse path refuses did."""

    def __init__(self, params, lr: float, momentum: float):
        self.params, self.lr, self.momentum = list(params), lr, momentum
        self.buffers = [None] * len(self.params)
        self.state = {}

    def zero_grad(self):
        for param in self.params:
            param.grad = None

    @torch.no_grad()
    def step(self):
        from torch.optim.sgd import sgd

        with_grad = [i for i, p in enumerate(self.params) if p.grad is not None]
        buffers = [self.buffers[i] for i in with_grad]
        sgd([self.params[i] for i in with_grad], [self.params[i].grad for i in with_grad], buffers, foreach=False,
            weight_decay=0.0, momentum=self.momentum, lr=self.lr, dampening=0.0, nesterov=False, maximize=False)
        for i, buffer in zip(with_grad, buffers):
            self.buffers[i] = buffer

    def momentum_buffers(self):
        return [b for b in self.buffers if b is not None]


def make_training(job: dict, model, group):
    """(ddp, state, optimizer, step function) for one cell."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from wanlink.c10d.sparse_hook import BlockSparseState, block_sparse_hook
    from wanlink.optim import SparseSGD

    shape = SHAPES[job["shape"]]
    dense = job["mode"] == "dense"
    ddp = DDP(model, process_group=group if dense else None, gradient_as_bucket_view=True)
    name = job["optimizer"]
    state = None
    if not dense:
        state = BlockSparseState(density=job.get("density", DENSITY), warmup_steps=job.get("warmup", WARMUP_STEPS),
                                 staleness=int(job["mode"][-1]), sparse_optimizer=name.startswith("sparse-sgd"),
                                 momentum={"sgd": MOMENTUM, "adamw": ADAM_BETAS[0],
                                           "sparse-sgd-hook": MOMENTUM}.get(name, 0.0))
        ddp.register_comm_hook(state, block_sparse_hook)
    if name in ("adamw", UNSAFE[1], "adamw-uncorrected") and (dense or name != "adamw"):
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=shape.adam_lr, betas=ADAM_BETAS)
    elif name == "adamw":  # on the sparse path beta1 is the hook's momentum
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=shape.adam_lr, betas=(0.0, ADAM_BETAS[1]))
    elif name.startswith("sparse-sgd"):  # sparse-sgd-hook: the momentum is the hook's (momentum correction)
        optimizer = SparseSGD(ddp.parameters(), lr=shape.sgd_lr, momentum=0.0 if name.endswith("hook") else MOMENTUM)
    elif name == "sgd-uncorrected":
        optimizer = UncheckedMomentumSGD(ddp.parameters(), lr=shape.sgd_lr, momentum=MOMENTUM)
    elif name == UNSAFE[0] or dense:
        optimizer = torch.optim.SGD(ddp.parameters(), lr=shape.sgd_lr, momentum=MOMENTUM)
    else:  # "sgd" on the sparse path: the momentum is the hook's
        optimizer = torch.optim.SGD(ddp.parameters(), lr=shape.sgd_lr, momentum=0.0)

    def step():
        if name.startswith("sparse-sgd"):
            optimizer.step(sparse_grads=state.sparse_grads())
        elif name == "adamw-uncorrected":  # what the sparse path refuses, measured: around torch.optim's step hooks
            type(optimizer).step.__wrapped__(optimizer)
        else:
            optimizer.step()

    return ddp, state, optimizer, step


def momentum_norm(optimizer, state) -> float:
    """L2 norm of every momentum the update depends on: the optimizer's buffers and the hook's velocities."""
    if isinstance(optimizer, UncheckedMomentumSGD):
        tensors = optimizer.momentum_buffers()
    else:
        tensors = [s[key] for s in optimizer.state.values() for key in ("momentum_buffer", "exp_avg") if key in s]
    if state is not None:
        tensors += state.velocities()
    return float(torch.sqrt(sum((t.double() ** 2).sum() for t in tensors))) if tensors else 0.0


def run_job(job: dict, rank: int, world: int, group) -> dict:
    from wanlink.errors import ConfigError

    shape = SHAPES[job["shape"]]
    task = Task(shape, job["seed"], rank, world)
    try:
        ddp, state, optimizer, step = make_training(job, task.model, group)
    except ConfigError as error:  # a refused combination is a result of the matrix
        return {**job, "refused": f"{type(error).__name__}: {error}"}
    steps = job.get("steps", shape.steps)
    schedule = job.get("schedule", "constant")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: lr_factor(schedule, i, steps)) \
        if schedule != "constant" else None
    every = max(1, steps // EVALUATIONS)
    curve, trace = [], []
    start = time.perf_counter()
    try:
        for iteration in range(steps):
            before = torch.cat([p.detach().reshape(-1) for p in task.model.parameters()]) if job.get("trace") else None
            optimizer.zero_grad()
            x, y = task.batch(iteration)
            loss = task.loss(ddp(x), y)
            loss.backward()
            last = iteration == steps - 1
            step()
            if job.get("judge_only") and state is not None and state.fidelity_guard and state.fidelity_guard.done:
                return {**job, "judged_at": iteration + 1, "guard": _guard_verdict(state),
                        "seconds": time.perf_counter() - start}
            if last and state is not None and state.flush():
                step()
            if scheduler is not None:
                scheduler.step()
            if before is not None:
                after = torch.cat([p.detach().reshape(-1) for p in task.model.parameters()])
                trace.append({"step": iteration, "loss": loss.item(), "update_norm": float((after - before).norm()),
                              "momentum_norm": momentum_norm(optimizer, state)})
            if (iteration + 1) % every == 0 or last:
                curve.append({"step": iteration + 1, "metric": task.evaluate(), "loss": loss.item()})
    except ConfigError as error:  # refused at the first optimizer step
        return {**job, "refused": f"{type(error).__name__}: {error}"}
    except Exception as error:  # noqa: BLE001 - e.g. diverged to NaN: a failed cell, not a crash of the matrix
        return {**job, "failed": f"{type(error).__name__}: {error}", "curve": curve, "trace": trace}
    return {**job, "final": curve[-1]["metric"], "curve": curve, "trace": trace,
            "seconds": time.perf_counter() - start, "bytes_sent": state.bytes_sent if state else None,
            "guard": _guard_verdict(state)}


def _guard_verdict(state) -> dict | None:
    """The sparse state's fidelity guard verdict (rank 0's): when it judged, the gradient ratio, whether it warned."""
    import dataclasses

    verdict = state.fidelity_guard.verdict if state is not None and state.fidelity_guard else None
    return dataclasses.asdict(verdict) if verdict else None


def _worker(rank: int, world: int, init_file: str, jobs: list[dict], results) -> None:
    import wanlink  # noqa: F401 - registers the backend

    torch.set_num_threads(1)
    dist.init_process_group("wanlink", init_method=f"file://{init_file}", rank=rank, world_size=world)
    gloo = dist.new_group(backend="gloo")
    try:
        for job in jobs:
            outcome = run_job(job, rank, world, gloo)
            dist.barrier(gloo)
            if rank == 0:
                results.put(outcome)
    finally:
        dist.destroy_process_group()


def run_jobs(jobs: list[dict], on_result=None) -> list[dict]:
    """Runs the jobs in order on one 2-rank world; ``on_result`` sees each rank-0 result as it comes."""
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    results = context.Queue()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with tempfile.TemporaryDirectory() as tmp:
        world = mp.start_processes(_worker, args=(2, os.path.join(tmp, "rendezvous"), jobs, results), nprocs=2,
                                   start_method="spawn", join=False)
        collected = []
        while len(collected) < len(jobs):
            if not world.processes[0].is_alive() and results.empty():
                world.join()  # raises with the rank's traceback
                raise RuntimeError("a rank exited before finishing its jobs")
            try:
                outcome = results.get(timeout=1.0)
            except Exception:  # noqa: BLE001 - queue.Empty: poll the ranks again
                continue
            collected.append(outcome)
            if on_result:
                on_result(outcome)
        world.join()
    return collected


def matrix_jobs(shapes, seeds, optimizers=(*OPTIMIZERS, *UNSAFE), modes=MODES) -> list[dict]:
    """Every cell's jobs; a dense baseline runs where one of its optimizers is asked for."""
    jobs = []
    for shape in shapes:
        for seed in seeds:
            for baseline in ("sgd", "adamw"):
                if "dense" in modes and any(_baseline(o) == baseline for o in optimizers if o not in UNSAFE):
                    jobs.append({"shape": shape, "seed": seed, "mode": "dense", "optimizer": baseline})
            for mode in (m for m in MODES[1:] if m in modes):
                for optimizer in optimizers:
                    if optimizer in UNSAFE and seed != seeds[0]:
                        continue  # refused: once per shape and staleness is enough
                    jobs.append({"shape": shape, "seed": seed, "mode": mode, "optimizer": optimizer})
    return jobs


def _baseline(optimizer: str) -> str:
    """The dense optimizer a cell is compared against (SparseSGD against dense momentum SGD)."""
    return "adamw" if optimizer.startswith("adamw") else "sgd"


def summarise(runs: list[dict]) -> list[dict]:
    rows = []
    cells = {}
    for run in runs:
        cells.setdefault((run["shape"], run["optimizer"], run["mode"]), []).append(run)
    for (shape_name, optimizer, mode), cell in cells.items():
        shape = SHAPES[shape_name]
        row = {"shape": shape_name, "optimizer": optimizer, "mode": mode, "seeds": len(cell)}
        refused = [r["refused"] for r in cell if "refused" in r]
        if refused:
            rows.append({**row, "verdict": "refused", "message": refused[0]})
            continue
        judged = [r["guard"] for r in cell if r.get("guard")]
        warned = sum(verdict["warned"] for verdict in judged)
        guard = {"warned": f"{warned}/{len(cell)}" if judged else "-",
                 "guard_ratio": [round(v["ratio"], 3) for v in judged]}
        measured = [r for r in cell if "judged_at" not in r]  # --judge-only runs have the guard's verdict alone
        finals = [r.get("final", math.nan) for r in measured]  # a failed seed (NaN) is the worst
        baseline = [r["final"] for r in runs if r["shape"] == shape_name and r["mode"] == "dense"
                    and r["optimizer"] == _baseline(optimizer) and "final" in r]
        if not measured or not baseline:  # nothing to judge against dense: the guard's verdicts
            rows.append({**row, **guard, "mean": statistics.fmean(finals) if finals else math.nan,
                         "worst": (max if shape.metric == "loss" else min)(finals, default=math.nan),
                         "dense_mean": math.nan,
                         "verdict": "warned" if judged and warned == len(cell) else "not warned"})
            continue
        dense_mean = statistics.fmean(baseline) if baseline else math.nan
        failed = [r["failed"] for r in cell if "failed" in r]
        worst = math.nan if failed else min(finals) if shape.metric == "accuracy" else max(finals)
        if shape.metric == "accuracy":
            within = worst >= dense_mean - TOLERANCE["accuracy"]
        else:
            within = worst <= dense_mean * (1 + TOLERANCE["loss"])
        verdict = "ok" if within and not failed else "warned" if judged and warned == len(cell) else "MISSED"
        rows.append({**row, **guard, "metric": shape.metric, "mean": statistics.fmean(finals), "worst": worst,
                     "dense_mean": dense_mean, "verdict": verdict, **({"message": failed[0]} if failed else {})})
    return rows


def plot(runs: list[dict], shapes, output, name: str = "fidelity") -> None:
    """Per shape, the mean curve of each cell over its seeds and the band between its best and worst seed."""
    from bench.reporting import colours, legend_outside, new_figure

    fig, axes = new_figure(1, len(shapes), figsize=(5 * len(shapes), 4), squeeze=False)
    colour = colours(r["optimizer"] for r in runs)
    style = {"dense": "-", "sparse s0": "--", "sparse s1": ":"}
    for ax, shape_name in zip(axes[0], shapes):
        cells = {}
        for result in runs:
            if result["shape"] == shape_name and result.get("curve"):
                cells.setdefault((result["optimizer"], result["mode"]), []).append(result["curve"])
        for (optimizer, mode), curves in cells.items():
            length = min(len(c) for c in curves)
            steps = [p["step"] for p in curves[0][:length]]
            values = [[c[i]["metric"] for c in curves] for i in range(length)]
            ax.plot(steps, [statistics.fmean(v) for v in values], color=colour[optimizer], ls=style[mode], lw=1.2,
                    label=f"{optimizer}, {mode} ({len(curves)} seeds)")
            ax.fill_between(steps, [min(v) for v in values], [max(v) for v in values], color=colour[optimizer],
                            alpha=0.12)
        metric = SHAPES[shape_name].metric
        ax.set_title(shape_name)
        ax.set_xlabel("step")
        ax.set_ylabel("test accuracy (%)" if metric == "accuracy" else "held-out loss (nats/byte)")
        if metric == "accuracy":
            ax.set_ylim(80, 100)
    handles = {}
    for ax in axes[0]:  # every cell of every panel, once
        handles.update(zip(ax.get_legend_handles_labels()[1], ax.get_legend_handles_labels()[0]))
    legend_outside(axes[0][-1], handles=list(handles.values()), labels=list(handles), fontsize=7)
    print("wrote", output.save_figure(fig, name))


def merge(paths) -> tuple[list[dict], list[dict]]:
    """The runs of several fidelity.json files (a later file's run replaces an earlier one of the same
    shape, seed, mode and optimizer), and each file's header: the matrix measured in several calls."""
    import json

    runs, parts = {}, []
    for path in paths:
        data = json.loads(Path(path).read_text())
        header = data.get("header", {})
        parts.extend(data.get("parts") or [])  # a merged file: its own parts, not its merge call
        if not data.get("parts"):
            parts.append({"file": Path(path).name, **{key: header.get(key) for key in
                                                      ("date_utc", "seconds", "load_before", "load_after",
                                                       "command")}})
        for run in data["runs"]:
            runs[(run["shape"], run["seed"], run["mode"], run["optimizer"])] = run
    return list(runs.values()), parts


def main(argv: list[str] | None = None) -> int:
    from bench.reporting import Run, add_output_options, print_table

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES), choices=sorted(SHAPES))
    parser.add_argument("--seeds", type=int, default=5, help="seeds FIRST..FIRST+N-1 per cell")
    parser.add_argument("--first-seed", type=int, default=0, help="FIRST (to add seeds to a matrix measured in parts)")
    parser.add_argument("--optimizers", nargs="+", default=[*OPTIMIZERS, "refused"],
                        choices=[*OPTIMIZERS, "refused", "adamw-uncorrected"],
                        help="refused: the combinations the sparse path refuses (once per shape and staleness); "
                             "adamw-uncorrected: AdamW's own beta1 behind the hook, run around the refusal")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--steps", type=int, help="training steps of every job (default: each shape's own)")
    parser.add_argument("--schedule", default="constant", choices=SCHEDULES,
                        help="learning-rate schedule of every arm (cosine: linear warm-up, cosine decay to zero)")
    parser.add_argument("--judge-only", action="store_true",
                        help="stop each sparse run once its fidelity guard has judged; record the verdict, no metric")
    parser.add_argument("--density", type=float, default=DENSITY, help="density of the sparse cells")
    parser.add_argument("--name", default="fidelity", help="file name of the JSON and PNG")
    parser.add_argument("--merge", nargs="+", type=Path, metavar="JSON",
                        help="measure nothing: merge these runs' fidelity.json files into one table and figure")
    add_output_options(parser)
    args = parser.parse_args(argv)
    run = Run(args)
    started = time.perf_counter()
    if args.merge:
        runs, parts = merge(args.merge)
        shapes = list(dict.fromkeys(r["shape"] for r in runs))
    else:
        optimizers = [o for name in args.optimizers for o in (UNSAFE if name == "refused" else (name,))]
        seeds = list(range(args.first_seed, args.first_seed + args.seeds))
        jobs = matrix_jobs(args.shapes, seeds, optimizers, args.modes)
        jobs = [{**job, **({"steps": args.steps} if args.steps else {}), "density": args.density,
                 "schedule": args.schedule, **({"judge_only": True} if args.judge_only else {})} for job in jobs]

        def progress(outcome):
            result = outcome.get("final", outcome.get("refused", outcome.get("failed", ""))[:60])
            if outcome.get("guard"):
                result = f"{result} (guard: ratio {outcome['guard']['ratio']:.3f}, warned {outcome['guard']['warned']})"
            print(f"  {outcome['shape']} seed {outcome['seed']} {outcome['mode']} {outcome['optimizer']}: {result}",
                  flush=True)

        runs, parts, shapes = run_jobs(jobs, progress), [], args.shapes
    rows = summarise(runs)
    print_table([r for r in rows if r["verdict"] != "refused"],
                [("shape", "shape", ""), ("optimizer", "optimizer", ""), ("mode", "mode", ""), ("seeds", "seeds", "d"),
                 ("mean", "mean", ".2f"), ("worst", "worst", ".3f"), ("dense_mean", "dense mean", ".3f"),
                 ("warned", "guard warned", ""), ("verdict", "within target", "")])
    for row in rows:
        if row["verdict"] == "refused":
            print(f"refused: {row['shape']} / {row['optimizer']} / {row['mode']}: {row['message']}")
    print(f"{(time.perf_counter() - started) / 60:.1f} min; load average before {run.load_before}, "
          f"after {os.getloadavg()}")
    run.save_json(args.name, {"density": args.density, "momentum": MOMENTUM, "adam_betas": ADAM_BETAS,
                              "warmup_steps": WARMUP_STEPS, "shapes": {name: vars(SHAPES[name]) for name in shapes},
                              "parts": parts, "rows": rows, "runs": runs})
    if any(r.get("curve") for r in runs):  # --judge-only runs have no curves
        plot(runs, shapes, run, args.name)
    return 0 if all(r["verdict"] in ("ok", "refused", "warned") for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
