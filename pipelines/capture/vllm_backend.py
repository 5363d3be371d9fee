"""``capture.backend: vllm``: the model step of capture on a vLLM engine (vLLM >= 0.18; written for 0.26 on
CUDA and 0.32 on CPU, tested on the latter).

How the hidden states get out of vLLM:

1. The engine runs the target with the speculative method ``extract_hidden_states``
   (``speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
   "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": L}}}``). vLLM's target
   models then return ``hidden + residual`` at every layer id in ``L`` (id ``i`` = the input of
   decoder layer ``i`` = HF ``hidden_states[i]``; ``_maybe_add_hidden_state`` in vLLM's model files,
   ascending id order), and the ``ExtractHiddenStatesProposer`` writes them, ``[S, Ht]`` per token,
   into the "KV cache" of one cache-only attention layer.
2. ``L`` = the aux layer ids plus ``num_hidden_layers``: the last decoder layer's output before the
   final norm (:class:`HiddenStatePlan`). ``final_hidden`` is that state through the target's own
   final norm module (:func:`pipelines.capture.target.load_final_norm`: the HF norm class of the
   architecture with the checkpoint's weights, the module the transformers backend hooks), applied
   on the engine's device: vLLM exposes only the aux states, not the normed final one.
3. peagle's KV connector (:class:`pipelines.capture.vllm_connector.PeagleHiddenStatesConnector`,
   loaded by vLLM by module path) keeps a finished request's blocks, gathers its ``N`` token rows
   in the next engine step, reorders them, applies the norm, casts to ``capture.dtype`` and hands
   ``aux``/``final_hidden`` back in memory: the engine runs in this process
   (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one GPU, no tensor parallelism), so nothing goes to disk.
4. One prompt per tokenized conversation (its ids as they are), ``max_tokens=1``, greedy, all
   conversations of a call in one ``LLM.generate`` (vLLM's scheduler forms the forward batches),
   prefix caching off (every token is computed, so every token's state is written).

The cache view differs between vLLM versions: ``[num_blocks, block_size, S, Ht]`` in 0.26 (the
cache-only backend's own ``get_kv_cache_shape``) and ``[num_blocks, S, block_size, Ht]`` in 0.32
(the ``LBNHC`` layer view); :func:`token_dim` tells them apart at run time.

Shape legend: N tokens of one sample, S stored states per token (``len(L)``), Ht target hidden,
A aux width (``len(aux_layer_ids) * Ht``).
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

import numpy as np
import torch

from peagle_core.samples import AUX, FINAL_HIDDEN, INPUT_IDS, LOSS_MASK, validate_sample
from pipelines import settings
from pipelines.assets import text_config
from pipelines.capture.forward import _check_tokenized, storage_dtype
from pipelines.capture.rows import SAMPLE_ID

if TYPE_CHECKING:
    from pipelines.recipe import CaptureConfig

CONNECTOR_MODULE = "pipelines.capture.vllm_connector"
CONNECTOR_NAME = "PeagleHiddenStatesConnector"
CAPTURE_KEY = "peagle_capture_key"  # kv_transfer_params key naming a request's result
MAX_DRAIN_STEPS = 64  # engine steps after generate() for the last requests' copies (1-2 in practice)


@dataclass(frozen=True)
class HiddenStatePlan:
    """Which hidden states vLLM stores per token and where peagle's tensors are among them.

    ``vllm_layer_ids``: the ids vLLM is asked for (sorted, unique: vLLM stores them in ascending
    order whatever order it is given); ``aux_slots``: position of each aux layer id, in the given
    order; ``final_slot``: position of id ``num_hidden_layers`` (the pre-norm last hidden state).
    """

    vllm_layer_ids: tuple[int, ...]
    aux_slots: tuple[int, ...]
    final_slot: int

    @classmethod
    def for_target(cls, aux_layer_ids: Sequence[int], num_hidden_layers: int) -> Self:
        """The plan for ``aux_layer_ids`` (vLLM "input of layer i") of a target of ``num_hidden_layers``.

        Raises:
            ValueError: an aux layer id outside ``[0, num_hidden_layers)``.
        """
        aux = tuple(int(i) for i in aux_layer_ids)
        bad = [i for i in aux if not 0 <= i < num_hidden_layers]
        if bad or not aux:
            raise ValueError(f"aux layer ids {list(aux)}: need ids in [0, {num_hidden_layers}) for this target "
                             "(vLLM: input of layer i)")
        ids = tuple(sorted(set(aux) | {num_hidden_layers}))
        return cls(vllm_layer_ids=ids, aux_slots=tuple(ids.index(i) for i in aux),
                   final_slot=ids.index(num_hidden_layers))


def token_dim(shape: Sequence[int], block_size: int, num_states: int, tokens_at_dim1: bool) -> int:
    """The dim of a hidden-states cache view ``shape = [num_blocks, ., ., Ht]`` that indexes the token
    in its block: 1 for vLLM 0.26's ``[num_blocks, block_size, S, Ht]``, 2 for 0.32's
    ``[num_blocks, S, block_size, Ht]``. Read from the shape; only when ``block_size == num_states``
    (both dims fit) from ``tokens_at_dim1`` (whether this vLLM's cache-only backend declares its own
    ``[num_blocks, block_size, S, Ht]`` shape, as 0.26's does).

    Raises:
        ValueError: the shape fits neither layout.
    """
    if len(shape) != 4:
        raise ValueError(f"hidden-states cache of shape {tuple(shape)}: expected 4 dims [blocks, ., ., Ht]")
    at1 = shape[1] == block_size and shape[2] == num_states
    at2 = shape[1] == num_states and shape[2] == block_size
    if at1 and at2:
        return 1 if tokens_at_dim1 else 2
    if at1 or at2:
        return 1 if at1 else 2
    raise ValueError(f"hidden-states cache of shape {tuple(shape)} fits neither [blocks, block_size={block_size}, "
                     f"states={num_states}, Ht] (vLLM 0.26) nor [blocks, states, block_size, Ht] (0.32)")


def slot_ids(block_ids: Sequence[int], block_size: int, num_tokens: int) -> torch.Tensor:
    """``[N]`` int64 cache slots (``block * block_size + offset``) of a request's first ``num_tokens``
    tokens, from its blocks in order."""
    blocks = torch.as_tensor(list(block_ids), dtype=torch.long)
    assert blocks.numel() * block_size >= num_tokens, (len(block_ids), block_size, num_tokens)
    return (blocks[:, None] * block_size + torch.arange(block_size)).reshape(-1)[:num_tokens]


def gather_token_states(cache: torch.Tensor, slots: torch.Tensor, dim: int) -> torch.Tensor:
    """``[N, S, Ht]``: the states stored at ``slots [N]`` of ``cache`` (tokens at ``dim``, see :func:`token_dim`)."""
    block_size = cache.shape[dim]
    if dim == 1:
        return cache[slots // block_size, slots % block_size]
    return cache[slots // block_size, :, slots % block_size]  # advanced dims first: [N, S, Ht]


@dataclass
class CapturedStates:
    """One request's captured tensors on the host: ``aux [N, A]`` and ``final_hidden [N, Ht]`` in the
    storage dtype (contiguous views of the buffer of the requests gathered with it), ``finite``: no
    NaN/Inf in either."""

    aux: torch.Tensor
    final_hidden: torch.Tensor
    finite: bool


@dataclass
class FinishedRequest:
    """A finished request whose states are to be gathered (the connector's scheduler -> worker message):
    vLLM's request id, peagle's result key, its prompt length and its hidden-states cache blocks."""

    req_id: str
    key: str
    num_tokens: int
    block_ids: list[int]


def pack_states(rows: torch.Tensor, plan: HiddenStatePlan, norm: torch.nn.Module,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows [T, S, Ht]`` (vLLM's order; T tokens of one or more requests) -> one ``[T*(A+Ht)]``
    buffer in ``dtype`` on their device: ``aux [T, A]`` (``plan.aux_slots`` in order), then
    ``final_hidden [T, Ht]`` = ``norm(rows[:, final_slot])``; and a ``()`` bool: all finite."""
    n, _, hidden = rows.shape
    num_aux = len(plan.aux_slots)
    packed = torch.empty(n * (num_aux + 1) * hidden, dtype=dtype, device=rows.device)
    slots = torch.as_tensor(plan.aux_slots, device=rows.device)
    packed[:n * num_aux * hidden].view(n, num_aux, hidden).copy_(rows.index_select(1, slots))  # [T, 3, Ht]
    packed[n * num_aux * hidden:].view(n, hidden).copy_(norm(rows[:, plan.final_slot]))  # [T, Ht]
    return packed, torch.isfinite(packed).all()


def unpack_states(packed: torch.Tensor, finite: bool, lengths: Sequence[int], hidden_size: int,
                  num_aux: int) -> list[CapturedStates]:
    """One :class:`CapturedStates` per request (``lengths`` tokens each, in gather order) of a
    :func:`pack_states` buffer on the host: contiguous views, no copy. ``finite``: the buffer's flag
    (when False, each request's own is computed here)."""
    total, width = sum(lengths), num_aux * hidden_size
    aux, fin = packed[:total * width].view(total, width), packed[total * width:].view(total, hidden_size)
    out, lo = [], 0
    for n in lengths:
        a, f = aux[lo:lo + n], fin[lo:lo + n]
        out.append(CapturedStates(a, f, finite or bool(torch.isfinite(a).all() and torch.isfinite(f).all())))
        lo += n
    return out


@dataclass
class _Copy:
    """The device->host copy of one step's requests, in flight on CUDA; ``device`` keeps its source
    buffers alive until it is done."""

    requests: list[FinishedRequest]
    hidden_size: int
    host: torch.Tensor  # [T*(A+Ht)] pinned
    finite: torch.Tensor  # () bool, pinned
    event: Any  # torch.cuda.Event recorded after the copy
    device: tuple[torch.Tensor, ...]


class StateCopier:
    """The worker half of peagle's connector, free of vLLM: gathers the states of the requests finished
    in one engine step from the hidden-states cache in one go (:func:`gather_token_states`,
    :func:`pack_states`: one buffer, one device->host copy) and keeps them on the host until :meth:`take`.

    On CPU the gathered buffer is the result (synchronous). On CUDA the gather, norm and cast run on
    a side stream after the current stream's work (the proposer's cache writes), the buffer is
    copied into pinned host memory without blocking, and the requests count as sent (their blocks may
    be freed and reused) only once that copy's event has completed. Thread-safe.
    """

    def __init__(self, plan: HiddenStatePlan, norm: torch.nn.Module, dtype: torch.dtype, *, block_size: int,
                 token_dim: int):
        self.plan, self.norm, self.dtype, self.block_size, self.token_dim = plan, norm, dtype, block_size, token_dim
        self._lock = threading.Lock()
        self._stream = None  # CUDA side stream, made on first use
        self._in_flight: list[_Copy] = []
        self._results: dict[str, CapturedStates] = {}
        self._sent: set[str] = set()

    @torch.inference_mode()
    def start(self, cache: torch.Tensor, requests: Sequence[FinishedRequest]) -> None:
        """Gather the first ``num_tokens`` token states of each of ``requests`` from ``cache``."""
        if not requests:
            return
        requests = list(requests)
        slots = torch.cat([slot_ids(r.block_ids, self.block_size, r.num_tokens) for r in requests])  # [T]
        with self._lock:
            if cache.device.type != "cuda":
                packed, finite = pack_states(gather_token_states(cache, slots, self.token_dim), self.plan, self.norm,
                                             self.dtype)
                self._complete(requests, packed, bool(finite), cache.shape[-1])
                return
            if self._stream is None:
                self._stream = torch.cuda.Stream(cache.device)
            self._stream.wait_stream(torch.cuda.current_stream(cache.device))
            with torch.cuda.stream(self._stream):
                slots = slots.pin_memory().to(cache.device, non_blocking=True)
                packed, finite = pack_states(gather_token_states(cache, slots, self.token_dim), self.plan, self.norm,
                                             self.dtype)
                host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
                host_finite = torch.empty((), dtype=torch.bool, pin_memory=True)
                host.copy_(packed, non_blocking=True)
                host_finite.copy_(finite, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._stream)
            self._in_flight.append(_Copy(requests, cache.shape[-1], host, host_finite, event, (packed, finite, slots)))

    def poll(self) -> set[str]:
        """The request ids sent since the last call: their states are on the host (blocks may be freed)."""
        with self._lock:
            self._collect(wait=False)
            sent, self._sent = self._sent, set()
            return sent

    def take(self, keys: Sequence[str]) -> dict[str, CapturedStates]:
        """The results of ``keys`` that have been started (waiting for their copies), removed from here."""
        with self._lock:
            self._collect(wait=True)
            return {k: self._results.pop(k) for k in keys if k in self._results}

    def _collect(self, wait: bool) -> None:
        pending = []
        for c in self._in_flight:
            if wait:
                c.event.synchronize()
            elif not c.event.query():
                pending.append(c)
                continue
            self._complete(c.requests, c.host, bool(c.finite), c.hidden_size)
        self._in_flight = pending

    def _complete(self, requests: list[FinishedRequest], host: torch.Tensor, finite: bool, hidden_size: int) -> None:
        states = unpack_states(host, finite, [r.num_tokens for r in requests], hidden_size, len(self.plan.aux_slots))
        for r, st in zip(requests, states):
            self._results[r.key] = st
            self._sent.add(r.req_id)


class VLLMCaptureEngine:
    """One vLLM engine over the target that returns hidden states instead of text (module docstring).

    Created once per capture actor. ``engine_kwargs`` go to ``vllm.LLM`` (through
    :class:`pipelines.data.engines.VLLMEngine`, which defaults ``gpu_memory_utilization`` to 0.5): on CPU
    the pipeline passes ``pipelines.stages.base.engine_settings(recipe).vllm_kwargs`` (eager,
    a quarter of the memory). Context = ``max_length_tokens + 1`` (the prompt and the one sampled token).

    Raises:
        ValueError: ``engine_kwargs`` asking for tensor/pipeline parallelism or multiprocessing (the
            connector hands tensors back in this process), or bad aux layer ids.
        RuntimeError: the engine started without peagle's connector in this process.
    """

    def __init__(self, target_path: str | Path, target_dtype: str, layer_ids: Sequence[int], dtype: str, *,
                 max_length_tokens: int, **engine_kwargs: Any):
        for key in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            if int(engine_kwargs.get(key, 1)) != 1:
                raise ValueError(f"capture.backend=vllm runs one engine per GPU (its connector hands tensors back "
                                 f"in-process); got {key}={engine_kwargs[key]}: drop it, or use capture.num_workers")
        if engine_kwargs.get("distributed_executor_backend") not in (None, "uni"):
            raise ValueError("capture.backend=vllm needs the in-process executor; drop distributed_executor_backend")
        config = text_config(target_path)
        self.plan = HiddenStatePlan.for_target(layer_ids, int(config["num_hidden_layers"]))
        self.hidden_size, self.num_aux, self.dtype = int(config["hidden_size"]), len(self.plan.aux_slots), dtype
        # The worker (and so the connector's results) must live in this process. vLLM reads this at engine
        # creation, and an in-process engine then freezes vLLM's env cache for the process: a capture actor is
        # a process of its own (in-process runs leave later vLLM engines of the process in-process too).
        os.environ.update(settings.VLLM_IN_PROCESS_ENV)
        import vllm.envs
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        getattr(vllm.envs, "disable_envs_cache", lambda: None)()  # an earlier engine here may have frozen it

        from pipelines.data.engines import VLLMEngine

        engine = VLLMEngine(
            target_path, dtype=target_dtype, max_model_len=max_length_tokens + 1, enable_prefix_caching=False,
            speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                "draft_model_config": {"hf_config": {
                                    "eagle_aux_hidden_state_layer_ids": list(self.plan.vllm_layer_ids)}}},
            kv_transfer_config={"kv_connector": CONNECTOR_NAME, "kv_connector_module_path": CONNECTOR_MODULE,
                                "kv_role": "kv_producer",
                                "kv_connector_extra_config": {"aux_layer_ids": [int(i) for i in layer_ids],
                                                              "dtype": dtype}},
            **engine_kwargs,
        )
        self.llm = engine.llm
        if not has_kv_transfer_group():
            raise RuntimeError("the vLLM engine's worker is not in this process (VLLM_ENABLE_V1_MULTIPROCESSING "
                               "was read before capture set it to 0?); capture.backend=vllm cannot get its results")
        self.connector = get_kv_transfer_group()
        self._num_requests = 0

    def capture(self, prompts: Sequence[np.ndarray]) -> list[CapturedStates]:
        """The hidden states of each prompt (``[N]`` token ids), in order: one ``LLM.generate`` call
        over all of them (``max_tokens=1``), then the connector's results.

        Raises:
            RuntimeError: a result did not arrive, or has another length than its prompt.
        """
        from vllm import SamplingParams, TokensPrompt

        keys = [str(self._num_requests + j) for j in range(len(prompts))]
        self._num_requests += len(prompts)
        params = [SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                                 extra_args={"kv_transfer_params": {CAPTURE_KEY: k}}) for k in keys]
        self.llm.generate([TokensPrompt(prompt_token_ids=np.asarray(p).tolist()) for p in prompts], params,
                          use_tqdm=False)
        got: dict[str, CapturedStates] = {}
        for _ in range(MAX_DRAIN_STEPS):  # the last requests' states are gathered in the next engine step
            got.update(self.connector.take([k for k in keys if k not in got]))
            if len(got) == len(keys):
                break
            self.llm.llm_engine.step()
        missing = [k for k in keys if k not in got]
        if missing:
            raise RuntimeError(f"vLLM returned no hidden states for {len(missing)} of {len(keys)} prompts "
                               f"after {MAX_DRAIN_STEPS} engine steps")
        out = [got[k] for k in keys]
        for p, s in zip(prompts, out):
            if s.final_hidden.shape[0] != len(p):
                raise RuntimeError(f"vLLM returned {s.final_hidden.shape[0]} token states for a {len(p)}-token prompt")
        return out


def capture_tokenized_vllm(
    engine: VLLMCaptureEngine,
    tokenized: Sequence[Mapping[str, Any]],
    cfg: CaptureConfig,
    *,
    max_length_tokens: int | None = None,
    stats: Counter | None = None,
    validate: bool = True,
) -> list[dict[str, Any]]:
    """The model step of capture on ``engine``: the contract of
    :func:`pipelines.capture.forward.capture_tokenized` (same rows in, same samples out, in input order)::

        sample_id str, input_ids int32 [N], loss_mask uint8 [N], aux [N, 3*Ht], final_hidden [N, Ht]

    Rows are checked before any compute; ``validate``: a sample with NaN/Inf (flagged by one
    reduction on the engine's device) fails with :func:`peagle_core.samples.validate_sample`'s error.

    Raises:
        ValueError: a malformed tokenized row (before compute), ``cfg.dtype`` other than the engine's,
            or NaN/Inf in a sample's hidden states.
    """
    stats = stats if stats is not None else Counter()
    dtype = storage_dtype(cfg)
    if cfg.dtype != engine.dtype:
        raise ValueError(f"capture.dtype={cfg.dtype} but the vLLM capture engine stores {engine.dtype}")
    rows = _check_tokenized(tokenized, dtype, max_length_tokens)
    if not rows:
        return []
    states = engine.capture([ids for _, ids, _ in rows])
    # ids and masks of all samples in one buffer each (views per sample), as the transformers step does
    input_ids = torch.from_numpy(np.concatenate([ids for _, ids, _ in rows]).astype(np.int32))  # [sum N]
    loss_mask = torch.from_numpy(np.concatenate([m for _, _, m in rows]).astype(np.uint8))  # [sum N]
    offsets = np.concatenate([[0], np.cumsum([len(ids) for _, ids, _ in rows])]).tolist()
    out = []
    for (sid, _, _), s, lo, hi in zip(rows, states, offsets[:-1], offsets[1:]):
        sample = {SAMPLE_ID: sid, INPUT_IDS: input_ids[lo:hi], LOSS_MASK: loss_mask[lo:hi], AUX: s.aux,
                  FINAL_HIDDEN: s.final_hidden}
        if validate and not s.finite:  # names the sample and the field
            validate_sample(sample, hidden_size=engine.hidden_size, num_aux=engine.num_aux, dtype=dtype,
                            max_length=max_length_tokens)
            raise AssertionError("isfinite reduction and validate_sample disagree")
        out.append(sample)
    stats["num_samples"] += len(out)
    stats["num_tokens"] += int(offsets[-1])
    stats["num_loss_tokens"] += int(loss_mask.sum())
    return out
