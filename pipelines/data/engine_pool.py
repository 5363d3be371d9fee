"""The regenerate stage's pool of engine actors on a Ray cluster: what each engine asks Ray for
(:func:`engine_share`, ``regenerate.engines_per_gpu`` engines sharing one GPU), whether the cluster can hold the
pool at all (:func:`check_pool_fits`), how the conversations are cut into the batches the pool hands out
(:func:`pool_batch_size`), and the lock under which engines of one GPU start (:func:`gpu_start_lock`).
:mod:`pipelines.data.regenerate` runs the pool; :mod:`pipelines.data.selfinstruct` runs one of the same engines for
the self-instruct prompts.

Shape legend: not applicable (orchestration only).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipelines.recipe import RegenerateConfig

log = logging.getLogger(__name__)


def engine_share(regen_cfg: RegenerateConfig, num_cpus_per_worker: float) -> tuple[float, float]:
    """``(CPUs, GPUs)`` of one engine actor of the pool: where the Ray cluster has GPUs, one GPU (the capture
    actors' rule, ``actor_num_gpus``) and ``num_cpus_per_worker`` (a GPU's share of its node's CPUs), both split
    over ``regenerate.engines_per_gpu`` engines (at least 1 CPU each); without GPUs, ``num_cpus_per_worker``
    and 0."""
    from pipelines.capture.actors import actor_num_gpus

    gpus = actor_num_gpus(None)
    k = regen_cfg.engines_per_gpu if gpus else 1
    return (max(1, int(num_cpus_per_worker // k)) if k > 1 else num_cpus_per_worker), gpus / k


def check_pool_fits(regen_cfg: RegenerateConfig, num_engines: int, share: tuple[float, float],
                    cluster: Mapping[str, float]) -> None:
    """Refuse, before any engine starts, a pool of ``num_engines`` engine actors of ``share`` = ``(CPUs, GPUs)``
    each (:func:`engine_share`) that the Ray cluster's total resources ``cluster`` (``ray.cluster_resources()``)
    can never hold: Ray would wait for them without end. With GPUs the pool needs ``ceil(num_engines /
    regenerate.engines_per_gpu)`` GPUs; without, ``num_engines`` x the CPUs of one.

    Raises:
        ValueError: the cluster has fewer GPUs or CPUs than the pool needs (the numbers and the fix).
    """
    num_cpus, num_gpus = share
    if num_gpus:
        need = math.ceil(round(num_engines * num_gpus, 6))
        have = int(cluster.get("GPU", 0))
        if need > have:
            raise ValueError(
                f"regenerate.num_workers={regen_cfg.num_workers}, engines_per_gpu={regen_cfg.engines_per_gpu}: "
                f"{num_engines} engine actors need {need} GPUs; the Ray cluster has {have}: lower "
                f"regenerate.num_workers to {have * regen_cfg.engines_per_gpu} or less, or raise engines_per_gpu")
    need_cpus, have_cpus = num_engines * num_cpus, cluster.get("CPU", 0)
    if need_cpus > have_cpus:
        raise ValueError(
            f"regenerate.num_workers={regen_cfg.num_workers}: {num_engines} engine actors need {need_cpus:g} CPUs "
            f"({num_cpus:g} each); the Ray cluster has {have_cpus:g}{'' if num_gpus else ' and no GPU'}: lower "
            "regenerate.num_workers")


def pool_batch_size(num_rows: int, batch_size: int, num_workers: int) -> int:
    """Conversations per batch the pool hands its ``num_workers`` engines: at most ``batch_size``
    (``regenerate.batch_size``), and as many batches as a multiple of the engines, all of one size, so that no
    engine runs the last batches alone while the others idle. 5,880 conversations in batches of 1,024 made 6
    batches for 4 engines (2x H200, 2026-11-28: together the 4 engines decoded ~35k tok/s from the first answers
    to the end, half of 4 times the rate of each inside its calls); here 8 batches of 735. One engine keeps
    ``batch_size``. At least 1."""
    if num_rows <= 0 or num_workers <= 1:
        return max(1, batch_size)
    batches = math.ceil(num_rows / max(1, batch_size))
    batches = math.ceil(batches / num_workers) * num_workers
    return max(1, math.ceil(num_rows / batches))


GPU_START_LOCK_DIR = Path("/tmp")  # node-local: one lock file per GPU (its CUDA_VISIBLE_DEVICES) of this host


@contextmanager
def gpu_start_lock(shared: bool) -> Iterator[None]:
    """Held while an engine that shares its GPU starts (``regenerate.engines_per_gpu`` > 1): the engines of one GPU
    start one after another. vLLM sizes its KV cache from the whole device's free memory while it profiles, so
    an engine starting beside another charges the other's allocations to itself and may find no memory for its
    cache (vllm-project/vllm#55827). An exclusive ``flock`` on ``GPU_START_LOCK_DIR /
    peagle-engine-start-gpu<CUDA_VISIBLE_DEVICES>.lock``, released when the engine has started (or failed);
    nothing when not ``shared`` or no GPU is assigned."""
    import fcntl
    import os

    gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    if not shared or not gpu:
        yield
        return
    path = GPU_START_LOCK_DIR / f"peagle-engine-start-gpu{gpu.replace(',', '-')}.lock"
    with open(path, "a") as f:
        t0 = time.perf_counter()
        fcntl.flock(f, fcntl.LOCK_EX)
        log.info("engine start on GPU %s: waited %.1f s for the engines before it", gpu, time.perf_counter() - t0)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


__all__ = ["GPU_START_LOCK_DIR", "check_pool_fits", "engine_share", "gpu_start_lock", "pool_batch_size"]
