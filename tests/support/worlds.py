"""Spawn a small torch.distributed world on loopback and collect what each rank returns.

Each rank runs ``target(rank, size, *args)`` after ``init_process_group`` over a FileStore; the
parent kills the whole world if it outlives ``timeout`` and reports every rank's traceback.
"""
from __future__ import annotations

import faulthandler
import multiprocessing
import os
import pickle
import tempfile
import time
import traceback
from datetime import timedelta


def _wait_for_every_rank(store, size: int, within_s: float) -> None:
    """Start line: a short ``init_timeout`` times the group, not a slow interpreter start under load."""
    store.add("worlds/imported", 1)
    deadline = time.monotonic() + within_s
    while (arrived := store.add("worlds/imported", 0)) < size:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {arrived} of {size} ranks started within {within_s:.0f} s")
        time.sleep(0.01)


def _rank_main(rank, size, store_path, result_dir, target, args, backend, init_timeout, env, hang_after):
    os.environ.update(env)
    faulthandler.dump_traceback_later(hang_after)  # a hung rank shows where it hangs
    outcome = ("error", "rank exited without a result")
    try:
        import torch.distributed as dist

        import wanlink  # noqa: F401 - registers the backend

        store = dist.FileStore(store_path, size)
        _wait_for_every_rank(store, size, hang_after)
        dist.init_process_group(backend, store=store, rank=rank, world_size=size,
                                timeout=timedelta(seconds=init_timeout))
        outcome = ("ok", target(rank, size, *args))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent
        outcome = ("error", traceback.format_exc())
    with open(os.path.join(result_dir, f"{rank}.pickle"), "wb") as handle:
        pickle.dump(outcome, handle)
    os._exit(0)  # skip interpreter teardown: fast and cannot hang on leftover threads


class WorldFailed(AssertionError):
    """A rank raised, died or the world timed out."""


def run_world(size: int, target, *args, backend: str = "wanlink", timeout: float = 120.0,
              init_timeout: float = 60.0, env: dict | None = None, allow_errors: bool = False,
              rank_env: list[dict] | None = None) -> list:
    """Return every rank's result (``("ok", value)``/``("error", text)`` when ``allow_errors``).

    ``env`` is set in every rank, ``rank_env[rank]`` (e.g. its ``WANLINK_SITE``) in that rank only.
    """
    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="wanlink-world-") as workdir:
        store_path = os.path.join(workdir, "store")
        processes = [context.Process(target=_rank_main, daemon=True,
                                     args=(rank, size, store_path, workdir, target, args, backend,
                                           init_timeout, {"TORCH_DEVICE_BACKEND_AUTOLOAD": "1", **(env or {}),
                                                          **(rank_env[rank] if rank_env else {})},
                                           max(1.0, timeout - 5)))
                     for rank in range(size)]
        for process in processes:
            process.start()
        deadline = time.monotonic() + timeout
        for process in processes:
            process.join(max(0.1, deadline - time.monotonic()))
        hung = [rank for rank, process in enumerate(processes) if process.is_alive()]
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join(5)
        outcomes = []
        for rank in range(size):
            path = os.path.join(workdir, f"{rank}.pickle")
            if os.path.exists(path):
                with open(path, "rb") as handle:
                    outcomes.append(pickle.load(handle))
            else:
                why = "hung (killed at the world timeout)" if rank in hung else \
                    f"died with exit code {processes[rank].exitcode}"
                outcomes.append(("error", f"rank {rank} {why}"))
    if allow_errors:
        return outcomes
    errors = [f"--- rank {rank} ---\n{value}" for rank, (status, value) in enumerate(outcomes) if status != "ok"]
    if errors:
        raise WorldFailed("\n".join(errors))
    return [value for _, value in outcomes]
