"""Model shapes and offline data sets for bench/fidelity.py: digits MLP, digits CNN, a small LM on stdlib source.

Every shape gives a model, per-rank training batches and an evaluation (accuracy in % for the
digits shapes, held-out loss in nats per byte for the language model) from a seed alone, with
no download: scikit-learn's bundled digits and the Python standard library's own source text.
"""
from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

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
    "stdlib-lm": Shape("stdlib-lm", "loss", steps=400, sgd_lr=0.1, adam_lr=2e-3),
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
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(CONTEXT), persistent=False)

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
            starts = torch.arange(0, test_text.numel() - CONTEXT - 1, (test_text.numel() - CONTEXT - 1) // 128)[:128]
            self.test = (torch.stack([test_text[s:s + CONTEXT] for s in starts]),
                         torch.stack([test_text[s + 1:s + CONTEXT + 1] for s in starts]))
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
