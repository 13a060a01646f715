"""What one rank's training step costs: per-layer compute, gradient buckets, step time (pure data).

``wanlink.plan.profiler.profile_model`` measures a ``Profile`` from a real torch model; the models
(``coarse``, ``simulate``) read it. Saved and loaded as JSON; loading checks every field.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from wanlink.errors import ConfigError

FORMAT = "wanlink.plan.profile/1"


@dataclass(frozen=True)
class Layer:
    name: str
    forward_s: float
    backward_s: float
    grad_bytes: int


@dataclass(frozen=True)
class Bucket:
    """A DDP gradient bucket: its bytes, when (seconds after backward starts) its last gradient is
    ready, and the numel of each gradient in it (the sparse hook sparsifies each on its own)."""

    bytes: int
    ready_s: float
    numels: tuple[int, ...]
    sparsify_s: float = 0.0  # sparsify + encode of this bucket at the profile's density (0 = not measured)


@dataclass(frozen=True)
class Profile:
    model: str
    batch_size: int
    forward_s: float
    backward_s: float
    step_s: float
    buckets: tuple[Bucket, ...]
    layers: tuple[Layer, ...] = ()
    density: float | None = None  # the density sparsify_s was measured at
    threads: int = 1
    iterations: int = 0
    comm_slowdown: float = 1.0  # compute time while the link carries exchanges / compute time alone (measured)
    transport_cpu_s: float = 0.0  # CPU the rank's transport threads spend on one step's exchanges (measured)
    cpu_s: float = 0.0  # training thread's CPU time per step, the sparse hook's included if density (0 = not measured)
    meta: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        _check(self)

    @property
    def grad_bytes(self) -> int:
        return sum(b.bytes for b in self.buckets)

    @property
    def compute_s(self) -> float:
        return self.forward_s + self.backward_s + self.step_s

    def scaled(self, speed: float = 1.0, batch_size: int | None = None) -> "Profile":
        """Compute times for a rank ``speed`` times as fast, at ``batch_size`` (linear in the batch;
        the optimizer step does not depend on it)."""
        batch = self.batch_size if batch_size is None else batch_size
        factor = (batch / self.batch_size) / speed
        buckets = tuple(replace(b, ready_s=b.ready_s * factor) for b in self.buckets)
        layers = tuple(replace(layer, forward_s=layer.forward_s * factor, backward_s=layer.backward_s * factor)
                       for layer in self.layers)
        compute = (self.forward_s + self.backward_s) * factor + self.step_s / speed
        cpu = self.cpu_s * compute / self.compute_s if self.compute_s > 0 else 0.0  # CPU time scales as compute
        return replace(self, batch_size=batch, forward_s=self.forward_s * factor, backward_s=self.backward_s * factor,
                       step_s=self.step_s / speed, buckets=buckets, layers=layers, cpu_s=cpu)

    def while_exchanging(self, busy: "Profile") -> "Profile":
        """This profile with ``comm_slowdown`` measured: ``busy`` is the same step profiled while the
        link carried the training's exchanges (``profile_model(background=...)``); the ratio of their
        forward + backward times is what CPU contention (the transport's threads, whatever else
        shares the cores with it) costs the compute that overlaps communication. The step's CPU time
        (``cpu_s``, where ``busy`` measured it) is taken from ``busy`` too: the same work costs more
        CPU time on cores it shares with other ranks, the transport and an emulator than alone
        (measured on this 2-core box: 22 to 31 ms against 18 ms per step, 4 ranks), and training
        spends what the busy profile does."""
        alone = self.forward_s + self.backward_s
        return replace(self, comm_slowdown=(busy.forward_s + busy.backward_s) / alone if alone > 0 else 1.0,
                       cpu_s=busy.cpu_s or self.cpu_s)

    def to_json(self) -> dict:
        doc = asdict(self)
        doc["format"] = FORMAT
        return doc

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_json(), indent=1))
        return path


def profile_from_json(doc: dict, source: str = "profile") -> Profile:
    if not isinstance(doc, dict):
        raise ConfigError(f"{source}: expected a JSON object")
    if doc.get("format") != FORMAT:
        raise ConfigError(f"{source}: format: expected {FORMAT!r}, got {doc.get('format')!r}")
    try:
        buckets = tuple(Bucket(bytes=b["bytes"], ready_s=b["ready_s"], numels=tuple(b["numels"]),
                               sparsify_s=b.get("sparsify_s", 0.0)) for b in doc["buckets"])
        layers = tuple(Layer(**layer) for layer in doc.get("layers", ()))
        return Profile(model=doc["model"], batch_size=doc["batch_size"], forward_s=doc["forward_s"],
                       backward_s=doc["backward_s"], step_s=doc["step_s"], buckets=buckets, layers=layers,
                       density=doc.get("density"), threads=doc.get("threads", 1),
                       iterations=doc.get("iterations", 0), comm_slowdown=doc.get("comm_slowdown", 1.0),
                       transport_cpu_s=doc.get("transport_cpu_s", 0.0), cpu_s=doc.get("cpu_s", 0.0),
                       meta=doc.get("meta", {}))
    except KeyError as missing:
        raise ConfigError(f"{source}: missing field {missing.args[0]!r}") from None
    except TypeError as error:
        raise ConfigError(f"{source}: malformed entry ({error})") from None
    except ConfigError as error:
        raise ConfigError(f"{source}: {error}") from None


def load_profile(path: str | Path) -> Profile:
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except OSError as error:
        raise ConfigError(f"cannot read profile {path}: {error.strerror}") from None
    except ValueError as error:
        raise ConfigError(f"{path}: not JSON ({error})") from None
    return profile_from_json(doc, str(path))


def _check(profile: Profile) -> None:
    def non_negative(value, name):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value >= 0):
            raise ConfigError(f"{name} must be a finite number >= 0, got {value!r}")

    if not isinstance(profile.batch_size, int) or profile.batch_size < 1:
        raise ConfigError(f"batch_size must be an integer >= 1, got {profile.batch_size!r}")
    for name in ("forward_s", "backward_s", "step_s", "transport_cpu_s", "cpu_s"):
        non_negative(getattr(profile, name), name)
    if isinstance(profile.comm_slowdown, bool) or not isinstance(profile.comm_slowdown, (int, float)) or not (
            math.isfinite(profile.comm_slowdown) and profile.comm_slowdown > 0):
        raise ConfigError(f"comm_slowdown must be a finite number > 0 (compute time while exchanging / alone), "
                          f"got {profile.comm_slowdown!r}")
    if not profile.buckets:
        raise ConfigError("buckets: a profile needs at least one gradient bucket")
    for i, bucket in enumerate(profile.buckets):
        if not isinstance(bucket.bytes, int) or bucket.bytes < 1:
            raise ConfigError(f"buckets[{i}].bytes must be an integer >= 1, got {bucket.bytes!r}")
        non_negative(bucket.ready_s, f"buckets[{i}].ready_s")
        non_negative(bucket.sparsify_s, f"buckets[{i}].sparsify_s")
        if not bucket.numels or any(not isinstance(n, int) or n < 1 for n in bucket.numels):
            raise ConfigError(f"buckets[{i}].numels must list the numel (>= 1) of every gradient in it")
    if profile.density is not None and not (0 < profile.density <= 1):
        raise ConfigError(f"density must be in (0, 1], got {profile.density!r}")
