"""peagle's KV connector for vLLM's ``extract_hidden_states``: hidden states handed back in memory.

vLLM loads it by module path (``kv_transfer_config={"kv_connector": "PeagleHiddenStatesConnector",
"kv_connector_module_path": "pipelines.capture.vllm_connector", "kv_role": "kv_producer",
"kv_connector_extra_config": {"aux_layer_ids": [...], "dtype": "float16"}}``); built by
:class:`pipelines.capture.vllm_backend.VLLMCaptureEngine`, whose docstring says how the states get
into the cache. This module imports vLLM (it subclasses vLLM's reference connector).

Differences from vLLM's ``ExampleHiddenStatesConnector`` (whose scheduler-side block bookkeeping,
cache-group lookup, block-size check and layout request it inherits):

* results stay in memory (no file, no lock file): :meth:`PeagleHiddenStatesConnector.take`, called
  in the engine's process, returns them by the key each request carries in
  ``kv_transfer_params["peagle_capture_key"]``;
* it returns peagle's tensors: aux states reordered to the recipe's layer order, the final norm
  applied to the last layer's output, cast to ``capture.dtype`` on the device, with a NaN/Inf flag;
* device-agnostic copy (:class:`pipelines.capture.vllm_backend.StateCopier`): synchronous on CPU;
  on CUDA asynchronous, on a side stream into pinned host memory, a request reported finished (its
  blocks freed) once its copy's event has completed;
* the cache layout (token dim 1 in vLLM 0.26, 2 in 0.32) is detected from the registered cache
  (:func:`pipelines.capture.vllm_backend.token_dim`); ``get_finished_count`` is 1 and
  ``prefer_cross_layer_blocks`` False in both versions (0.26's reference lacks the first).

Shape legend: N tokens of one request, S stored states per token, Ht target hidden.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
)

from peagle_core.samples import HIDDEN_DTYPES, dtype_name
from pipelines.capture.vllm_backend import (
    CAPTURE_KEY,
    CapturedStates,
    FinishedRequest,
    HiddenStatePlan,
    StateCopier,
    token_dim,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


@dataclass
class PeagleConnectorMetadata(KVConnectorMetadata):
    """The requests the scheduler finished since the last step, for the worker to gather."""

    finished: list[FinishedRequest] = field(default_factory=list)


class PeagleHiddenStatesConnector(ExampleHiddenStatesConnector):
    """Store-only KV connector: each finished capture request's aux and final hidden states, kept in
    memory until :meth:`take` (module docstring). Requests without a capture key are ignored.

    Raises:
        ValueError: (at engine start) ``kv_connector_extra_config`` without ``aux_layer_ids``/``dtype``,
            or a speculative config asking vLLM for other layers than this plan's.
    """

    def __init__(self, vllm_config: VllmConfig, role, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        if "aux_layer_ids" not in extra or "dtype" not in extra:
            raise ValueError(f"{type(self).__name__} needs kv_connector_extra_config aux_layer_ids and dtype; "
                             f"got {extra}")
        self._plan = HiddenStatePlan.for_target(extra["aux_layer_ids"],
                                                vllm_config.model_config.get_total_num_hidden_layers())
        draft = vllm_config.speculative_config.draft_model_config.hf_config
        requested = tuple(getattr(draft, "eagle_aux_hidden_state_layer_ids", None) or ())
        if requested != self._plan.vllm_layer_ids:
            raise ValueError(f"extract_hidden_states asks for layers {list(requested)}; {type(self).__name__} "
                             f"needs {list(self._plan.vllm_layer_ids)} (aux ids + num_hidden_layers, sorted)")
        self._dtype = HIDDEN_DTYPES[dtype_name(extra["dtype"])]
        self._finished: list[FinishedRequest] = []  # scheduler side: not yet sent to the worker
        self._copier: StateCopier | None = None  # worker side, made in register_kv_caches

    @property
    def prefer_cross_layer_blocks(self) -> bool:
        return False  # the hidden-states cache must stay a group of its own

    def get_finished_count(self) -> int:
        return 1  # one worker (no tensor parallelism): one notification per request

    # ---------------------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        super().register_kv_caches(kv_caches)  # finds the cache-only layer's view, checks its block size
        from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionBackend

        from pipelines.capture.target import load_final_norm

        cache, model_config = self._kv_cache, self._vllm_config.model_config
        # vLLM 0.26's backend declares [blocks, block_size, S, Ht]; 0.32 uses the generic layer view
        dim = token_dim(cache.shape, self._block_size, len(self._plan.vllm_layer_ids),
                        tokens_at_dim1="get_kv_cache_shape" in vars(CacheOnlyAttentionBackend))
        norm = load_final_norm(model_config.model, model_config.dtype, cache.device)
        self._copier = StateCopier(self._plan, norm, self._dtype, block_size=self._block_size, token_dim=dim)
        log.info("peagle capture: hidden-states cache %s on %s, tokens at dim %d, block size %d, layers %s, %s",
                 tuple(cache.shape), cache.device, dim, self._block_size, list(self._plan.vllm_layer_ids),
                 "synchronous copy" if cache.device.type != "cuda" else "pinned side-stream copy")

    def wait_for_save(self) -> None:
        pass  # no lock files: results are handed over in memory

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Start gathering the requests the scheduler finished last step; report those whose states are
        on the host (their blocks are freed then)."""
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        if isinstance(meta, PeagleConnectorMetadata):
            self._copier.start(self._kv_cache, meta.finished)
        return self._copier.poll() or None, None

    def take(self, keys: list[str]) -> dict[str, CapturedStates]:
        """The results of ``keys`` gathered so far (waiting for copies in flight), removed from the
        connector. Called by the engine's owner, in the engine's process."""
        return self._copier.take(keys)

    # ---------------------------------------------------------------------------- scheduler side

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta, self._finished = PeagleConnectorMetadata(finished=self._finished), []
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Keep the blocks of a finished capture request (True) until the worker has gathered them."""
        key = (request.kv_transfer_params or {}).get(CAPTURE_KEY)
        if key is None or not block_ids or not request.prompt_token_ids:
            return False, None  # not ours, or never scheduled: nothing to gather
        self._finished.append(FinishedRequest(request.request_id, str(key), len(request.prompt_token_ids),
                                              list(block_ids)))
        return True, None
