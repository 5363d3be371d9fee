"""Where a vLLM decoding step's time goes: target forward (the verify pass of speculative decoding),
sampling (rejection sampling with speculation) and drafting, per engine step.

Why: on a small target a GPU decoding step is launch- and overhead-bound, so a speculative step can cost
several target-only steps and speculation loses even at a decent acceptance length. A step's split says
which part to attack (the drafter, the verify forward on K+1 tokens, or the sampler) and is what the
K schedule is fitted from (:mod:`pipelines.evaluate.k_schedule`).

How: :func:`install` wraps four methods of vLLM's V1 model runner (``vllm/v1/worker/gpu_model_runner.py``,
also the base of the CPU runner) on its instance: ``execute_model`` and ``sample_tokens`` (together one
step), ``_model_forward`` (the target forward), ``_sample`` (sampler / rejection sampler) and
``propose_draft_token_ids`` (the drafter's proposal). Each wrapped call is fenced by device synchronizations,
so the phases add up but the step is serialized: measure throughput without these wrappers and the split
with them. They run in the worker process through ``LLM.collective_rpc`` (module-level functions, so they
pickle by reference; vLLM sends callables only with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``, which
``pipelines.evaluate.measure`` sets in its own engine subprocess when asked for a split). vLLM's Model Runner V2 (``vllm/v1/worker/gpu/model_runner.py``) has other methods:
:func:`install` returns False there (start the engine with ``VLLM_USE_V2_MODEL_RUNNER=0`` to split it).

Units: seconds in, milliseconds per step out.
"""

from __future__ import annotations

import time
from typing import Any

# phase -> the model-runner method it wraps; "step" is both halves of vLLM's two-phase step API
PHASES = {"execute_model": "step", "sample_tokens": "step", "_model_forward": "target_forward",
          "_sample": "sample", "propose_draft_token_ids": "draft"}
_ATTR = "_peagle_step_costs"


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def install(worker) -> bool:
    """Wrap the phases of ``worker.model_runner`` (once; later calls only report). Runs in the worker.

    Returns:
        True when the runner is vLLM's V1 runner with every wrapped method, else False (nothing wrapped).
    """
    runner = worker.model_runner
    if _ATTR in runner.__dict__:
        return True
    if not all(callable(getattr(runner, m, None)) for m in PHASES):
        return False
    stats: dict[str, list[float]] = {}
    runner.__dict__[_ATTR] = stats
    for method, phase in PHASES.items():
        original = getattr(runner, method)

        def timed(*args, _original=original, _phase=phase, **kwargs):
            _sync()
            t = time.perf_counter()
            out = _original(*args, **kwargs)
            _sync()
            s = stats.setdefault(_phase, [0, 0.0])
            s[1] += time.perf_counter() - t
            if _phase != "step" or _original.__name__ == "execute_model":
                s[0] += 1
            return out

        setattr(runner, method, timed)
    return True


def reset(worker) -> None:
    """Zero the counters (e.g. after warm-up). Runs in the worker."""
    worker.model_runner.__dict__.get(_ATTR, {}).clear()


def read(worker) -> dict[str, list[float]]:
    """``{phase: [calls, seconds]}`` since the last :func:`reset`. Runs in the worker."""
    return {k: list(v) for k, v in worker.model_runner.__dict__.get(_ATTR, {}).items()}


def per_step_ms(stats: dict[str, list[float]]) -> dict[str, Any]:
    """Milliseconds per engine step of each phase, from :func:`read`'s counters: ``step_ms`` (a whole step),
    ``target_forward_ms``, ``sample_ms``, ``draft_ms`` (0 without speculation), ``other_ms`` (the rest:
    input preparation, bookkeeping) and ``num_steps``. Empty when no step ran."""
    steps = int(stats.get("step", [0, 0.0])[0])
    if not steps:
        return {}
    out: dict[str, Any] = {"num_steps": steps, "step_ms": 1000.0 * stats["step"][1] / steps}
    for phase in ("target_forward", "sample", "draft"):
        out[f"{phase}_ms"] = 1000.0 * stats.get(phase, [0, 0.0])[1] / steps
    out["other_ms"] = out["step_ms"] - out["target_forward_ms"] - out["sample_ms"] - out["draft_ms"]
    return out

