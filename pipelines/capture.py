"""Capture stage: target aux hidden states for drafter training, with Ray Data.

Per conversation the target's chat template is applied, the tokens it would generate (assistant
turns) are marked in ``loss_mask``, and one target forward records (see :mod:`peagle_core.shards`)::

    input_ids [N] int32, loss_mask [N] uint8, aux [N, 3*Ht], final_hidden [N, Ht]

``aux`` = HF ``hidden_states[i]`` for the aux layer ids (vLLM "input of layer i",
``vllm/model_executor/models/llama_eagle3.py``); ``final_hidden`` is after the target's final norm,
so the trainer gets the target distribution as ``lm_head(final_hidden)`` at ~1/8-1/55 of the bytes
of stored draft-vocab log-probs (reasoning in :mod:`peagle_core.shards`).

Two Ray Data stages: tokenization (chat template, loss mask, truncation; pure CPU,
:func:`tokenize_rows`) runs as ``map_batches`` tasks on CPU workers, and the model step
(:func:`capture_tokenized`: padded batch, target forward, hidden states to host) runs on an actor pool
holding the target on its GPU. :func:`capture_batch` chains both in one process (no Ray).

Two outputs:

* materialized (:func:`run_capture`): shard k holds conversations ``[k*S, (k+1)*S)`` of the input
  order (``S = capture.shard_size_samples``), so the assignment is deterministic. One Ray Data row
  = one shard task; :func:`tokenize_shard_tasks` tokenizes it, a ``CaptureShardActor`` pool captures
  it and writes the shard atomically (hidden states never travel through the object store). A
  re-run keeps every shard whose file is complete, verified and made for the same conversations and
  settings, rewrites the others, and writes ``capture_meta.json`` then ``manifest.parquet`` last:
  the manifest exists only for a finished capture.
* streaming (:func:`capture_stream`): ``map_batches(tokenize_conversations)`` then
  ``map_batches(CaptureActor)`` yield rows of the same schema for the trainer, nothing written to disk.

Backends: ``transformers`` (CPU and GPU; batches grouped by length, ``torch.inference_mode``, one
pinned host buffer per batch copied on a side stream while the next batch runs).
``vllm`` (vLLM >= 0.18 speculative method ``extract_hidden_states`` + ``ExampleHiddenStatesConnector``)
is the GPU-cluster path; it is CUDA-only, so here it raises before any compute.

Shape legend: B batch, T padded tokens, N tokens of one sample, S real tokens of a batch, Ht target
hidden, V target vocab.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from peagle_core import shards
from peagle_core.target import target_forward

if TYPE_CHECKING:
    import ray.data

    from pipelines.recipe import CaptureConfig, DataConfig, TargetConfig

log = logging.getLogger(__name__)

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
DROP_REASONS = ("too_long", "empty_assistant_turn", "no_assistant_turn", "no_loss_tokens_after_truncation")


# ---------------------------------------------------------------------------------------------- tokenization


class ConversationError(ValueError):
    """A conversation that cannot become a training sample; ``reason`` is one of ``DROP_REASONS``."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


def _trim_trailing_non_assistant(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    end = len(messages)
    while end and messages[end - 1]["role"] != "assistant":
        end -= 1
    return messages[:end]


def tokenize_conversation(tokenizer, messages: Sequence[Mapping[str, str]], sample_id: str = "?") -> tuple[list[int], list[int]]:
    """Token ids and loss mask (1 on assistant tokens) of a conversation under the target's chat template.

    Templates with ``{% generation %}`` use ``apply_chat_template(return_assistant_tokens_mask=True)``.
    Otherwise each assistant turn's span is found by rendering the prefixes: it starts where
    ``render(messages[:i], add_generation_prompt=True)`` ends and ends where ``render(messages[:i+1])``
    ends, less trailing whitespace (so ChatML's ``<|im_end|>`` is learned, the ``\\n`` after it is
    not); spans are mapped to tokens through the fast tokenizer's character offsets of the full render.
    Turns after the last assistant turn are dropped (no loss there).

    Raises:
        ConversationError: no assistant turn, or an assistant turn with empty content.
        ValueError: no chat template, or a template whose prefix renders are not prefixes of the full
            render (use a template with ``{% generation %}``).
    """
    messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    for j, m in enumerate(messages):
        if m["role"] == "assistant" and not m["content"].strip():
            raise ConversationError(f"{sample_id}: assistant turn {j} is empty", "empty_assistant_turn")
    messages = _trim_trailing_non_assistant(messages)
    if not messages:
        raise ConversationError(f"{sample_id}: no assistant turn", "no_assistant_turn")
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError("the target tokenizer has no chat_template; set one (capture applies the target's template)")
    if _GENERATION_TAG.search(template):
        enc = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
        return list(enc["input_ids"]), [int(x) for x in enc["assistant_masks"]]

    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        head = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        through = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False).rstrip()
        if not (text.startswith(head) and text.startswith(through) and len(head) < len(through)):
            raise ValueError(
                "the target chat template is not prefix-stable (rendering the first turns is not a prefix of "
                "the full conversation), so assistant spans cannot be found by diffing; use a template with "
                "{% generation %} tags"
            )
        spans.append((len(head), len(through)))
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
    mask = [0] * len(ids)
    for t, (start, end) in enumerate(offsets):
        if end > start and any(a <= start < b for a, b in spans):
            mask[t] = 1
    return ids, mask


def prepare_samples(
    tokenizer,
    rows: Iterable[Mapping[str, Any]],
    *,
    max_length_tokens: int | None,
    on_too_long: str = "truncate",
    stats: Counter | None = None,
) -> list[tuple[str, list[int], list[int]]]:
    """Tokenize rows (``id``/``sample_id``, ``messages``) into ``(sample_id, ids, mask)``; truncate or
    drop those over ``max_length_tokens`` and drop empty/assistant-less ones, counting each in ``stats``
    (keys ``truncated``, ``dropped_<reason>``). Drops are logged with the sample id.

    Raises:
        ValueError: ``on_too_long`` not truncate|drop (before any tokenization).
    """
    if on_too_long not in ("truncate", "drop"):
        raise ValueError(f"capture.on_too_long={on_too_long!r}; use 'truncate' or 'drop'")
    stats = stats if stats is not None else Counter()
    out = []
    for row in rows:
        sid = str(row.get("sample_id") or row["id"])
        stats["num_conversations"] += 1
        try:
            ids, mask = tokenize_conversation(tokenizer, row["messages"], sid)
            if max_length_tokens is not None and len(ids) > max_length_tokens:
                if on_too_long == "drop":
                    raise ConversationError(f"{sid}: {len(ids)} tokens > data.max_length_tokens={max_length_tokens}",
                                            "too_long")
                ids, mask = ids[:max_length_tokens], mask[:max_length_tokens]
                stats["truncated"] += 1
                if not any(mask):
                    raise ConversationError(f"{sid}: no assistant token within the first {max_length_tokens}",
                                            "no_loss_tokens_after_truncation")
        except ConversationError as e:
            stats[f"dropped_{e.reason}"] += 1
            log.info("dropped %s", e)
            continue
        out.append((sid, ids, mask))
    return out


def tokenize_rows(
    tokenizer,
    rows: Iterable[Mapping[str, Any]],
    *,
    max_length_tokens: int | None,
    on_too_long: str = "truncate",
    stats: Counter | None = None,
) -> list[dict[str, Any]]:
    """The CPU half of capture: conversation rows (``id``/``sample_id``, ``messages``) -> tokenized rows
    ``{sample_id str, input_ids int32 [N], loss_mask uint8 [N]}`` (numpy), the input of
    :func:`capture_tokenized`. Same drops, truncation and ``stats`` as :func:`prepare_samples`.

    Raises:
        ValueError: ``on_too_long`` not truncate|drop, or no chat template (before any tokenization).
    """
    return [
        {"sample_id": sid, "input_ids": np.asarray(ids, dtype=np.int32), "loss_mask": np.asarray(mask, dtype=np.uint8)}
        for sid, ids, mask in prepare_samples(tokenizer, rows, max_length_tokens=max_length_tokens,
                                              on_too_long=on_too_long, stats=stats)
    ]


def _ragged_to_arrow(arrays: Sequence[np.ndarray], dtype) -> Any:
    """1-D arrays as one Arrow ``list<dtype>`` array (one flat buffer + offsets, no per-token Python)."""
    import pyarrow as pa

    lengths = np.fromiter((len(a) for a in arrays), dtype=np.int64, count=len(arrays))
    offsets = np.zeros(len(arrays) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values = np.concatenate(arrays).astype(dtype, copy=False) if len(arrays) else np.zeros(0, dtype)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))


def _ragged_from_arrow(array) -> list[np.ndarray]:
    """Inverse of :func:`_ragged_to_arrow`: an Arrow list array (or chunked) -> list of 1-D numpy views."""
    if hasattr(array, "combine_chunks"):
        array = array.combine_chunks()
    if len(array) == 0:
        return []
    lengths = array.value_lengths().to_numpy(zero_copy_only=False)
    values = array.flatten().to_numpy(zero_copy_only=False)
    return np.split(values, np.cumsum(lengths)[:-1])


def tokenized_to_arrow(tokenized: Sequence[Mapping[str, Any]]) -> Any:
    """Tokenized rows as a ``pyarrow.Table`` (``sample_id`` string, ``input_ids`` list<int32>,
    ``loss_mask`` list<uint8>): the block format between the tokenize and model-step stages."""
    import pyarrow as pa

    return pa.table({
        "sample_id": pa.array([str(r["sample_id"]) for r in tokenized], pa.string()),
        "input_ids": _ragged_to_arrow([np.asarray(r["input_ids"]) for r in tokenized], np.int32),
        "loss_mask": _ragged_to_arrow([np.asarray(r["loss_mask"]) for r in tokenized], np.uint8),
    })


def tokenized_from_batch(batch) -> list[dict[str, Any]]:
    """Tokenized rows from a Ray Data batch: a ``pyarrow.Table`` as made by :func:`tokenized_to_arrow`,
    or a dict of columns (``batch_format="numpy"``: ragged columns as object arrays)."""
    if hasattr(batch, "column"):
        ids, mask = _ragged_from_arrow(batch.column("input_ids")), _ragged_from_arrow(batch.column("loss_mask"))
        sids = batch.column("sample_id").to_pylist()
    else:
        sids, ids, mask = list(batch["sample_id"]), list(batch["input_ids"]), list(batch["loss_mask"])
    return [{"sample_id": str(s), "input_ids": i, "loss_mask": m} for s, i, m in zip(sids, ids, mask)]


@functools.lru_cache(maxsize=4)
def _cached_tokenizer(path: str):
    """The target tokenizer, loaded once per Ray worker process (tokenize tasks reuse their worker)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"target tokenizer at {path} has no chat_template; capture needs the target's template")
    return tokenizer


def tokenize_conversations(batch, *, tokenizer_path: str, max_length_tokens: int | None,
                           on_too_long: str = "truncate") -> Any:
    """Ray Data ``map_batches`` function (a CPU task, no model): conversation rows (``id``/``sample_id``,
    ``messages``) -> tokenized rows (:func:`tokenized_to_arrow`). Drops are logged, not returned.

    Use: ``ds.map_batches(tokenize_conversations, fn_kwargs=dict(tokenizer_path=..., max_length_tokens=...),
    batch_format="pyarrow")`` before the :class:`CaptureActor` stage.
    """
    tokenizer = _cached_tokenizer(tokenizer_path)
    return tokenized_to_arrow(tokenize_rows(tokenizer, _rows_from_batch(batch), max_length_tokens=max_length_tokens,
                                            on_too_long=on_too_long))


def tokenize_shard_tasks(batch, *, tokenizer_path: str, max_length_tokens: int | None,
                         on_too_long: str = "truncate") -> Any:
    """Ray Data ``map_batches`` function (a CPU task) of the materialized capture: shard tasks
    (``shard_index``, ``conversations`` JSON) -> one row per shard with ``shard_index``,
    ``conversation_ids`` (JSON, every conversation of the shard, dropped ones too), ``tokenize_stats``
    (JSON Counter: conversations, truncated, dropped_<reason>) and the kept samples as list columns
    ``sample_id`` list<string>, ``input_ids`` list<list<int32>>, ``loss_mask`` list<list<uint8>>.
    """
    import pyarrow as pa

    tokenizer = _cached_tokenizer(tokenizer_path)
    out: dict[str, list] = {"shard_index": [], "conversation_ids": [], "tokenize_stats": [], "samples": []}
    for task in _rows_from_batch(batch):
        rows = json.loads(task["conversations"])
        stats: Counter = Counter()
        out["shard_index"].append(int(task["shard_index"]))
        out["conversation_ids"].append(json.dumps([r["sample_id"] for r in rows]))
        out["samples"].append(tokenized_to_arrow(tokenize_rows(tokenizer, rows, max_length_tokens=max_length_tokens,
                                                               on_too_long=on_too_long, stats=stats)))
        out["tokenize_stats"].append(json.dumps(dict(stats)))
    cols = {k: out[k] for k in ("shard_index", "conversation_ids", "tokenize_stats")}
    for key, typ in (("sample_id", pa.string()), ("input_ids", pa.int32()), ("loss_mask", pa.uint8())):
        cols[key] = pa.ListArray.from_arrays(
            pa.array(np.cumsum([0] + [t.num_rows for t in out["samples"]]).astype(np.int32)),
            pa.concat_arrays([t.column(key).combine_chunks() for t in out["samples"]])
            if out["samples"] else pa.array([], pa.list_(typ) if key != "sample_id" else typ),
        )
    return pa.table(cols)


# ---------------------------------------------------------------------------------------------- model step


def length_batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Indices grouped by length (longest first) into batches of at most ``batch_size``: little padding."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


def _storage_dtype(cfg) -> torch.dtype:
    return shards.HIDDEN_DTYPES[shards.dtype_name(cfg.dtype)]


def _check_tokenized(rows: Sequence[Mapping[str, Any]], dtype: torch.dtype,
                     max_length_tokens: int | None) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """``(sample_id, ids, mask)`` of tokenized rows that pass the token half of
    :func:`peagle_core.shards.validate_sample`, checked with array ops over all rows before any compute.

    Raises:
        ValueError: from ``validate_sample`` (zero-width hidden states stand in), naming the first bad
            sample: empty or non-integer ``input_ids``, ``loss_mask`` of another length or dtype, not
            0/1 or all zero, more than ``max_length_tokens`` tokens.
    """
    sids = [r["sample_id"] for r in rows]
    ids = [np.asarray(r["input_ids"]) for r in rows]
    masks = [np.asarray(r["loss_mask"]) for r in rows]
    ok = all(isinstance(s, str) and s and i.ndim == 1 and i.size and i.dtype.kind in "iu" and m.shape == i.shape
             and m.dtype in (np.uint8, np.bool_) for s, i, m in zip(sids, ids, masks))
    if ok and rows:
        lengths = np.array([len(i) for i in ids])
        flat = np.concatenate(masks).astype(np.uint8, copy=False)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        ok = (not (flat > 1).any() and bool((np.maximum.reduceat(flat, starts) > 0).all())
              and (max_length_tokens is None or int(lengths.max()) <= max_length_tokens))
    if not ok:
        for s, i, m in zip(sids, ids, masks):
            stand_in = torch.empty((len(i) if i.ndim == 1 else 0, 0), dtype=dtype)
            shards.validate_sample({"sample_id": s, "input_ids": i, "loss_mask": m, "aux": stand_in,
                                    "final_hidden": stand_in}, num_aux=0, dtype=dtype, max_length=max_length_tokens)
    return list(zip(sids, ids, masks))


@dataclass
class _PendingBatch:
    """One batch between its device->host copy being queued and the samples being cut from it."""

    index: list[int]  # positions in the input of the batch's samples, batch order
    lengths: np.ndarray  # [B] tokens per sample
    input_ids: torch.Tensor  # [S] int32, S = sum(lengths), sample after sample
    loss_mask: torch.Tensor  # [S] uint8
    hidden: torch.Tensor  # [S*(A+Ht)] storage dtype on the host: [S, A] aux rows, then [S, Ht] final rows
    aux_width: int  # A = len(layer_ids) * Ht
    finite: torch.Tensor | None  # () bool on the host: all hidden states finite (None: not validated)
    copied: Any = None  # torch.cuda.Event recorded after the copy (None on CPU: nothing to wait for)


def capture_tokenized(
    model,
    tokenized: Sequence[Mapping[str, Any]],
    cfg: CaptureConfig,
    layer_ids: Sequence[int],
    *,
    pad_token_id: int = 0,
    max_length_tokens: int | None = None,
    stats: Counter | None = None,
    validate: bool = True,
) -> list[dict[str, Any]]:
    """The model step of capture: tokenized rows (``sample_id``, ``input_ids [N]``, ``loss_mask [N]``,
    e.g. from :func:`tokenize_rows`) -> one captured sample per row, in input order::

        sample_id str, input_ids int32 [N], loss_mask uint8 [N], aux [N, 3*Ht], final_hidden [N, Ht]

    Rows are grouped by length into right-padded ``[B, T]`` batches of ``cfg.batch_size`` (built with
    array ops), run through :func:`peagle_core.target.target_forward` (``return_logits=False``, under
    ``torch.inference_mode``), then the real tokens' hidden states are gathered and cast to
    ``cfg.dtype`` on the device into one packed buffer per batch (aux rows, then final rows) and
    copied to the host once: on CUDA into pinned memory with ``non_blocking=True`` on a side stream,
    so the copy of batch i overlaps the forward of batch i+1, and one wait per batch. Each sample's
    tensors are contiguous views of that batch's host buffers (no per-sample copy); on CPU the packed
    buffer is the host buffer. Values equal the per-sample ``aux.to(dtype)[b, :n]`` slices bit for bit.

    Rows are always checked with the token half of :func:`peagle_core.shards.validate_sample` before
    any forward (array ops, microseconds per row). ``validate``: also check the hidden states for
    NaN/Inf, by one reduction per batch on the device (a failing batch's samples then go through
    ``validate_sample`` on the host, which names the sample). ``stats`` receives ``num_samples``,
    ``num_tokens``, ``num_loss_tokens``.

    Raises:
        ValueError: a malformed tokenized row (before compute), or NaN/Inf in a sample's hidden states
            (naming the sample and the field; the target forward overflowed).
    """
    stats = stats if stats is not None else Counter()
    dtype = _storage_dtype(cfg)
    layer_ids = tuple(int(i) for i in layer_ids)
    rows = _check_tokenized(tokenized, dtype, max_length_tokens)
    if not rows:
        return []
    device = next(model.parameters()).device
    cuda = device.type == "cuda"
    copy_stream = torch.cuda.Stream(device) if cuda else None
    lengths = np.array([len(r[1]) for r in rows], dtype=np.int64)
    results: list[dict[str, Any] | None] = [None] * len(rows)
    pending: _PendingBatch | None = None
    for index in length_batches(lengths.tolist(), cfg.batch_size):
        lens = lengths[index]  # [B]
        t_max = int(lens.max())
        real = np.arange(t_max)[None, :] < lens[:, None]  # [B, T] real (not padding) tokens
        flat_ids = np.concatenate([rows[i][1] for i in index])  # [S] sample after sample
        ids = np.full(real.shape, pad_token_id, dtype=np.int64)  # [B, T]
        ids[real] = flat_ids  # row-major: sample b's tokens land in row b, right-padded
        rows_real = np.flatnonzero(real)  # [S] rows of the flattened [B*T] batch holding real tokens
        host_in = [torch.from_numpy(a) for a in (ids, real.astype(np.int64), rows_real)]
        if cuda:
            host_in = [t.pin_memory() for t in host_in]
        ids_d, attn_d, rows_d = (t.to(device, non_blocking=True) for t in host_in)
        out = target_forward(model, ids_d, layer_ids, attention_mask=attn_d, return_logits=False)
        aux_width, hidden = out.aux.shape[-1], out.final_hidden.shape[-1]
        num_real = len(rows_real)
        packed = torch.empty(num_real * (aux_width + hidden), dtype=dtype, device=device)
        packed[:num_real * aux_width].view(num_real, aux_width).copy_(
            out.aux.reshape(-1, aux_width).index_select(0, rows_d))  # [S, 3*Ht]
        packed[num_real * aux_width:].view(num_real, hidden).copy_(
            out.final_hidden.reshape(-1, hidden).index_select(0, rows_d))  # [S, Ht]
        del out
        finite = torch.isfinite(packed).all() if validate else None
        host, host_finite, copied = packed, finite, None
        if cuda:
            host = torch.empty(packed.shape, dtype=dtype, pin_memory=True)
            host_finite = torch.empty((), dtype=torch.bool, pin_memory=True) if validate else None
            copy_stream.wait_stream(torch.cuda.current_stream(device))  # the forward and the gather first
            with torch.cuda.stream(copy_stream):
                host.copy_(packed, non_blocking=True)
                if validate:
                    host_finite.copy_(finite, non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(copy_stream)
            packed.record_stream(copy_stream)  # not reused by the next batch before the copy is done
            if validate:
                finite.record_stream(copy_stream)
        batch = _PendingBatch(
            index=index, lengths=lens, hidden=host, aux_width=aux_width, finite=host_finite, copied=copied,
            input_ids=torch.from_numpy(flat_ids.astype(np.int32, copy=False)),
            loss_mask=torch.from_numpy(np.concatenate([rows[i][2] for i in index]).astype(np.uint8, copy=False)),
        )
        if pending is not None:  # the previous batch's copy ran while this batch's forward was queued
            _cut_samples(pending, rows, results, stats, dtype, layer_ids, max_length_tokens)
        pending = batch
    _cut_samples(pending, rows, results, stats, dtype, layer_ids, max_length_tokens)
    return [r for r in results if r is not None]


def _cut_samples(batch: _PendingBatch, rows, results: list, stats: Counter, dtype: torch.dtype,
                 layer_ids: tuple[int, ...], max_length_tokens: int | None) -> None:
    """Wait for ``batch``'s host copy, then put one sample (views of the batch buffers) per row into ``results``."""
    if batch.copied is not None:
        batch.copied.synchronize()
    num_real = int(batch.lengths.sum())
    aux = batch.hidden[:num_real * batch.aux_width].view(num_real, batch.aux_width)  # [S, 3*Ht]
    fin = batch.hidden[num_real * batch.aux_width:].view(num_real, -1)  # [S, Ht]
    offsets = np.concatenate([[0], np.cumsum(batch.lengths)])
    samples = []
    for b, i in enumerate(batch.index):
        lo, hi = int(offsets[b]), int(offsets[b + 1])
        samples.append({"sample_id": rows[i][0], "input_ids": batch.input_ids[lo:hi], "loss_mask": batch.loss_mask[lo:hi],
                        "aux": aux[lo:hi], "final_hidden": fin[lo:hi]})
    if batch.finite is not None and not bool(batch.finite):
        for s in samples:  # names the first bad sample and field
            shards.validate_sample(s, hidden_size=fin.shape[-1], num_aux=len(layer_ids), dtype=dtype,
                                   max_length=max_length_tokens)
        raise AssertionError("isfinite reduction and validate_sample disagree")
    for i, s in zip(batch.index, samples):
        results[i] = s
    stats["num_samples"] += len(samples)
    stats["num_tokens"] += num_real
    stats["num_loss_tokens"] += int(batch.loss_mask.sum())


def capture_batch(
    model,
    tokenizer,
    rows: Iterable[Mapping[str, Any]],
    cfg: CaptureConfig,
    layer_ids: Sequence[int],
    *,
    max_length_tokens: int | None = None,
    stats: Counter | None = None,
    validate: bool = True,
) -> list[dict[str, Any]]:
    """Capture the target's hidden states for conversation ``rows`` (``id``, ``messages``); no Ray.

    :func:`tokenize_rows` (``cfg.on_too_long`` over ``max_length_tokens``) then
    :func:`capture_tokenized` (padding with the tokenizer's pad id): one dict per kept conversation,
    in input order::

        sample_id str, input_ids int32 [N], loss_mask uint8 [N], aux [N, 3*Ht], final_hidden [N, Ht]

    hidden states cast to ``cfg.dtype``. ``stats`` (a Counter) receives conversation/token/drop counts.
    The Ray stages run the two halves as separate ``map_batches`` stages (CPU tokenize, model actor).

    Raises:
        ValueError: bad ``cfg``/chat template (before compute), or a sample failing
            :func:`peagle_core.shards.validate_sample` (e.g. NaN/Inf from the target).
    """
    stats = stats if stats is not None else Counter()
    _storage_dtype(cfg)  # a bad dtype fails before tokenization
    tokenized = tokenize_rows(tokenizer, rows, max_length_tokens=max_length_tokens, on_too_long=cfg.on_too_long,
                              stats=stats)
    return capture_tokenized(model, tokenized, cfg, layer_ids, pad_token_id=_pad_id(tokenizer),
                             max_length_tokens=max_length_tokens, stats=stats, validate=validate)


def _pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0


# ---------------------------------------------------------------------------------------------- target loading


@dataclass
class LoadedTarget:
    model: Any
    tokenizer: Any
    path: str
    sha256: str
    layer_ids: tuple[int, ...]
    hidden_size: int
    vocab_size: int


def resolve_target(target_cfg: TargetConfig) -> tuple[Any, dict[str, Any]]:
    """``(TargetAsset, config.json dict)`` of the target (materialized once under PEAGLE_HOME)."""
    from pipelines.assets import ensure_target

    asset = ensure_target(target_cfg.model, target_cfg.dtype)
    config = json.loads((Path(asset.path) / "config.json").read_text())
    config = config.get("text_config", config) if "num_hidden_layers" not in config else config
    return asset, config


def load_target(path: str | Path, dtype: str = "float32", num_threads: int | None = None):
    """``(model, tokenizer)`` from an HF directory; the model in eval mode at ``dtype`` (on CUDA if present).

    Raises:
        ValueError: the tokenizer has no chat template.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if num_threads:
        torch.set_num_threads(num_threads)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"target tokenizer at {path} has no chat_template; capture needs the target's template")
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype))
    if torch.cuda.is_available():
        model = model.to("cuda")
    return model.eval(), tokenizer


def _check_backend(capture_cfg: CaptureConfig) -> None:
    if capture_cfg.backend == "vllm" and not torch.cuda.is_available():
        raise ValueError(
            "capture.backend=vllm uses vLLM's extract_hidden_states method (vLLM >= 0.18), which is CUDA-only; "
            "this machine has no CUDA GPU: use capture.backend=transformers"
        )
    if capture_cfg.backend == "vllm":
        raise NotImplementedError(
            "capture.backend=vllm (extract_hidden_states + ExampleHiddenStatesConnector) is the documented GPU-"
            "cluster path and is not wired yet; use capture.backend=transformers (same output contract)"
        )


# ---------------------------------------------------------------------------------------------- Ray actors


def _rows_from_batch(batch) -> list[dict[str, Any]]:
    """A Ray Data batch (pyarrow Table, pandas DataFrame or dict of columns) as a list of row dicts."""
    if hasattr(batch, "to_pylist"):
        return batch.to_pylist()
    if hasattr(batch, "to_dict"):
        return batch.to_dict("records")
    keys = list(batch)
    n = len(batch[keys[0]]) if keys else 0
    rows = [{k: batch[k][i] for k in keys} for i in range(n)]
    for r in rows:
        if "messages" in r:
            r["messages"] = [dict(m) for m in r["messages"]]
    return rows


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy()


def samples_to_columns(samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Samples as Ray Data columns (variable-shaped tensors; bf16 as float32, exact: numpy has no bf16)."""
    cols: dict[str, Any] = {"sample_id": np.array([s["sample_id"] for s in samples], dtype=object)}
    for key in shards.SAMPLE_KEYS:
        cols[key] = [_to_numpy(s[key]) if isinstance(s[key], torch.Tensor) else s[key] for s in samples]
    return cols


def _num_gpus_per_worker(requested: float | None) -> float:
    """GPUs per capture actor: ``requested``, or 1 when the Ray cluster has GPUs, else 0 (CPU)."""
    if requested is not None:
        return float(requested)
    import ray

    return 1.0 if ray.is_initialized() and ray.cluster_resources().get("GPU", 0) >= 1 else 0.0


def _tokenize_num_cpus(num_gpus: float, num_cpus_per_worker: float, num_workers: int) -> float:
    """CPUs per tokenize task. With GPU actors: 1, so Ray Data runs tokenize tasks on free CPUs in
    parallel with the GPU stage. Without: the actor's CPUs, so Ray Data fuses tokenization into the
    actor (same remote args): on CPU the forward is the bottleneck, and separate tokenize tasks
    could wait forever for CPUs held by the actor pool."""
    if not num_gpus:
        return num_cpus_per_worker
    import ray

    if ray.is_initialized():
        free = ray.cluster_resources().get("CPU", 0) - num_workers * num_cpus_per_worker
        if free < 1:
            log.warning("capture: %d GPU actors x %s CPUs leave %s CPUs for the tokenize stage; it needs >= 1 "
                        "(lower num_cpus_per_worker or add CPUs, else the pipeline waits for CPUs)",
                        num_workers, num_cpus_per_worker, free)
    return 1.0


class CaptureActor:
    """Ray Data ``map_batches`` actor, the model stage: tokenized rows (``sample_id``, ``input_ids``,
    ``loss_mask``, from the :func:`tokenize_conversations` stage) -> captured sample rows.

    Use: ``ds.map_batches(tokenize_conversations, ...).map_batches(CaptureActor, fn_constructor_kwargs=
    dict(...), compute=ray.data.ActorPoolStrategy(size=n), num_gpus=1, batch_size=capture.batch_size,
    batch_format="pyarrow")``. Holds the target for the actor's life (loaded once), ``num_threads``
    torch threads (set it to the actor's CPUs).
    """

    def __init__(self, target_path: str, target_dtype: str, capture_cfg: CaptureConfig, layer_ids: Sequence[int],
                 max_length_tokens: int | None, num_threads: int | None = None):
        self.model, self.tokenizer = load_target(target_path, target_dtype, num_threads=num_threads)
        self.cfg, self.layer_ids, self.max_length_tokens = capture_cfg, tuple(layer_ids), max_length_tokens
        self.stats: Counter = Counter()

    def capture(self, tokenized: Sequence[Mapping[str, Any]], stats: Counter | None = None) -> list[dict[str, Any]]:
        return capture_tokenized(self.model, tokenized, self.cfg, self.layer_ids, pad_token_id=_pad_id(self.tokenizer),
                                 max_length_tokens=self.max_length_tokens,
                                 stats=self.stats if stats is None else stats)

    def __call__(self, batch) -> dict[str, Any]:
        return samples_to_columns(self.capture(tokenized_from_batch(batch)))


class CaptureShardActor(CaptureActor):
    """Materialized capture: each input row is one tokenized shard (from :func:`tokenize_shard_tasks`);
    captures it, writes ``shard-XXXXX.safetensors`` atomically, returns its manifest rows and counts.

    ``crash_after_shards`` (tests only): after that many shards this actor leaves a partial temp file
    behind and raises, as a process killed mid-write would.
    """

    def __init__(self, *args, out_dir: str, shard_metadata: dict[str, Any], crash_after_shards: int | None = None,
                 **kwargs):
        super().__init__(*args, **kwargs)
        self.out_dir, self.shard_metadata = Path(out_dir), shard_metadata
        self.crash_after_shards, self.num_written = crash_after_shards, 0

    def __call__(self, batch) -> dict[str, Any]:
        out: dict[str, list] = {"shard_index": [], "rows": [], "stats": []}
        for r in range(batch.num_rows):
            k = int(batch.column("shard_index")[r].as_py())
            path = self.out_dir / shards.shard_name(k)
            if self.crash_after_shards is not None and self.num_written >= self.crash_after_shards:
                (self.out_dir / f".{path.name}.crash.tmp").write_bytes(b"partial shard")
                raise RuntimeError(f"injected crash before writing {path.name}")
            tokenized = [{"sample_id": s, "input_ids": i, "loss_mask": m} for s, i, m in zip(
                batch.column("sample_id")[r].as_py(), _ragged_from_arrow(batch.column("input_ids")[r].values),
                _ragged_from_arrow(batch.column("loss_mask")[r].values))]
            stats: Counter = Counter(json.loads(batch.column("tokenize_stats")[r].as_py()))
            t0 = time.perf_counter()
            samples = self.capture(tokenized, stats)
            stats["forward_ms"] = round(1000 * (time.perf_counter() - t0))
            meta = {**self.shard_metadata, "conversation_ids": json.loads(batch.column("conversation_ids")[r].as_py()),
                    "stats": dict(stats)}
            manifest_rows = shards.write_shard(path, samples, metadata=meta, validate=False)  # validated above
            self.num_written += 1
            out["shard_index"].append(k)
            out["rows"].append(json.dumps(manifest_rows))
            out["stats"].append(json.dumps(dict(stats)))
        return out


# ---------------------------------------------------------------------------------------------- materialized


@dataclass
class CaptureResult:
    """Outcome of :func:`run_capture`. ``bytes_per_token`` is on-disk size / tokens;
    ``tokens_per_s`` = tokens captured in this run (reused shards excluded) / wall time of the actor
    pool including actor start-up (``meta["forward_tokens_per_s"]`` excludes it)."""

    out_dir: Path
    num_samples: int
    num_tokens: int
    num_loss_tokens: int
    num_shards: int
    num_shards_reused: int
    dropped: dict[str, int]
    num_truncated: int
    bytes_per_token: float
    seconds: float
    tokens_per_s: float
    meta: dict[str, Any] = field(default_factory=dict, repr=False)


def _conversation_rows(conversations) -> list[dict[str, Any]]:
    """Rows with unique ``sample_id`` (``id``, suffixed ``#k`` for the k-th repeat), in input order."""
    if hasattr(conversations, "to_list"):  # datasets.Dataset
        rows = conversations.to_list()
    elif hasattr(conversations, "take_all"):  # ray.data.Dataset
        rows = conversations.take_all()
    else:
        rows = list(conversations)
    seen: Counter = Counter()
    out = []
    for i, r in enumerate(rows):
        if "messages" not in r or "id" not in r:
            raise ValueError(f"conversation row {i} lacks 'id'/'messages'; load prompts with pipelines.prompts")
        rid = str(r["id"])
        sid = rid if not seen[rid] else f"{rid}#{seen[rid]}"
        seen[rid] += 1
        out.append({"sample_id": sid, "id": rid, "messages": [{"role": m["role"], "content": m["content"]}
                                                               for m in r["messages"]]})
    if len(out) != len(seen):
        log.warning("%d duplicate conversation ids renamed with a #k suffix", len(out) - len(seen))
    return out


def _fingerprint(asset_sha: str, layer_ids, capture_cfg, data_cfg, tokenizer_template: str) -> dict[str, Any]:
    return {
        "target_sha256": asset_sha,
        "aux_layer_ids": list(layer_ids),
        "dtype": capture_cfg.dtype,
        "max_length_tokens": data_cfg.max_length_tokens,
        "on_too_long": capture_cfg.on_too_long,
        "shard_size_samples": capture_cfg.shard_size_samples,
        "chat_template_sha256": __import__("hashlib").sha256(tokenizer_template.encode()).hexdigest(),
    }


def _reusable_shard(path: Path, fingerprint: dict[str, Any], conversation_ids: list[str]) -> list[dict] | None:
    """Manifest rows of an existing shard if it is complete, verified and made for exactly these
    conversations and settings; None if absent or stale/corrupt (then it is rewritten).

    Raises:
        ValueError: the shard was made with other settings (another target, layers, dtype...):
            a different capture lives in this directory; nothing is overwritten.
    """
    if not path.exists():
        return None
    try:
        header = shards.shard_header(path)
        got = json.loads(header.get("fingerprint", "null"))
        if got != fingerprint:
            diff = {k: (got or {}).get(k) for k in fingerprint if (got or {}).get(k) != fingerprint[k]}
            raise ValueError(
                f"{path} was captured with other settings ({diff} vs {fingerprint}); use a new out_dir or "
                "delete the old capture"
            )
        if json.loads(header.get("conversation_ids", "[]")) != conversation_ids:
            log.warning("%s holds other conversations (input order changed); rewriting it", path.name)
            return None
        return shards.read_shard(path, verify=True).rows()
    except shards.ShardError as e:
        log.warning("rewriting %s: %s", path.name, e)
        return None


def run_capture(
    conversations,
    target_cfg: TargetConfig,
    capture_cfg: CaptureConfig,
    data_cfg: DataConfig,
    out_dir: str | Path,
    *,
    num_cpus_per_worker: float = 1,
    num_gpus_per_worker: float | None = None,
    use_ray: bool | None = None,
    crash_after_shards: int | None = None,
) -> CaptureResult:
    """Materialized capture of ``conversations`` (``datasets.Dataset``, Ray Dataset or list of rows
    ``{id, messages, ...}``) into ``out_dir``. Resumable: see the module docstring.

    ``use_ray``: two Ray Data stages over shard tasks: :func:`tokenize_shard_tasks` (CPU tasks), then a
    :class:`CaptureShardActor` pool (``capture.num_workers`` actors with ``num_cpus_per_worker`` CPUs
    and ``num_gpus_per_worker`` GPUs each; None = 1 if the Ray cluster has GPUs, else 0); Ray starts
    locally if ``ray.init`` has not run. With False the same two stages run in-process (a GPU box
    without Ray). None = Ray when importable.

    Writes ``shard-XXXXX.safetensors``, ``token_counts.safetensors`` ([V] counts of assistant tokens
    for d2t/t2d), ``capture_meta.json`` and, last, ``manifest.parquet``.

    Raises:
        ValueError: bad config, no chat template, no conversations, or ``out_dir`` holding a capture made
            with other settings (all before the target forward).
    """
    _check_backend(capture_cfg)
    if use_ray is None:
        import importlib.util

        use_ray = importlib.util.find_spec("ray") is not None
    t_start = time.perf_counter()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = _conversation_rows(conversations)
    if not rows:
        raise ValueError("run_capture got no conversations; check data.sources / num_samples")
    asset, config = resolve_target(target_cfg)
    layer_ids = target_cfg.resolve_aux_layer_ids(config["num_hidden_layers"])
    hidden_size, vocab_size = int(config["hidden_size"]), int(config["vocab_size"])
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(asset.path))
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"target tokenizer at {asset.path} has no chat_template")
    fp = _fingerprint(asset.sha256, layer_ids, capture_cfg, data_cfg, tokenizer.chat_template)
    size = capture_cfg.shard_size_samples
    tasks = [rows[i:i + size] for i in range(0, len(rows), size)]
    for k in range(len(tasks), 10**5):  # shards beyond this input (an earlier, larger run): not ours to keep
        extra = out_dir / shards.shard_name(k)
        if not extra.exists():
            break
        raise ValueError(f"{extra} is beyond the {len(tasks)} shards of this input; use a new out_dir")

    done: dict[int, list[dict]] = {}
    shard_stats: dict[int, dict] = {}
    for k, task in enumerate(tasks):
        path = out_dir / shards.shard_name(k)
        reused = _reusable_shard(path, fp, [r["sample_id"] for r in task])
        if reused is not None:
            done[k] = reused
            shard_stats[k] = json.loads(shards.shard_header(path).get("stats", "{}"))
    num_reused = len(done)
    (out_dir / shards.MANIFEST_NAME).unlink(missing_ok=True)  # a manifest marks a finished capture; not yet
    for stray in out_dir.glob(".shard-*.tmp"):
        stray.unlink()  # an interrupted write
    pending = [k for k in range(len(tasks)) if k not in done]
    log.info("capture: %d shards, %d verified and kept, %d to write", len(tasks), num_reused, len(pending))

    t_run = time.perf_counter()
    actor_args = (str(asset.path), target_cfg.dtype, capture_cfg, layer_ids, data_cfg.max_length_tokens)
    actor_kwargs = {"out_dir": str(out_dir), "shard_metadata": {"fingerprint": fp},
                    "crash_after_shards": crash_after_shards}

    def collect(row) -> None:
        k = int(row["shard_index"])
        done[k] = json.loads(row["rows"])
        shard_stats[k] = json.loads(row["stats"])
        log.info("captured %s (%d samples)", shards.shard_name(k), len(done[k]))

    tokenize_kwargs = {"tokenizer_path": str(asset.path), "max_length_tokens": data_cfg.max_length_tokens,
                       "on_too_long": capture_cfg.on_too_long}
    if pending and not use_ray:  # the same two stages, in-process
        import pyarrow as pa

        worker = CaptureShardActor(*actor_args, **actor_kwargs)
        for k in pending:
            task = pa.table({"shard_index": [k], "conversations": [json.dumps(tasks[k])]})
            res = worker(tokenize_shard_tasks(task, **tokenize_kwargs))
            collect({key: v[0] for key, v in res.items()})
    elif pending:
        import ray

        num_workers = max(1, min(capture_cfg.num_workers, len(pending)))
        ds = ray.data.from_items(
            [{"shard_index": k, "conversations": json.dumps(tasks[k])} for k in pending],
            override_num_blocks=len(pending),
        )
        num_gpus = _num_gpus_per_worker(num_gpus_per_worker)
        tokenized = ds.map_batches(tokenize_shard_tasks, fn_kwargs=tokenize_kwargs, batch_size=1,
                                   batch_format="pyarrow",
                                   num_cpus=_tokenize_num_cpus(num_gpus, num_cpus_per_worker, num_workers))
        out = tokenized.map_batches(
            CaptureShardActor,
            fn_constructor_args=actor_args,
            fn_constructor_kwargs={**actor_kwargs, "num_threads": max(1, int(num_cpus_per_worker))},
            compute=ray.data.ActorPoolStrategy(size=num_workers),
            batch_size=1,
            batch_format="pyarrow",
            num_cpus=num_cpus_per_worker,
            num_gpus=num_gpus,
        )
        for row in out.iter_rows():
            collect(row)
    run_s = time.perf_counter() - t_run

    manifest_rows = [r for k in range(len(tasks)) for r in done[k]]
    totals: Counter = Counter()
    for s in shard_stats.values():
        totals.update({k: v for k, v in s.items() if isinstance(v, int)})
    new_tokens = sum(shard_stats[k].get("num_tokens", 0) for k in pending)
    forward_s = sum(shard_stats[k].get("forward_ms", 0) for k in pending) / 1000
    num_tokens = sum(r["length"] for r in manifest_rows)
    disk = sum((out_dir / shards.shard_name(k)).stat().st_size for k in range(len(tasks)))
    counts = count_tokens(out_dir, vocab_size, manifest_rows=manifest_rows)
    shards.save_token_counts(out_dir / shards.TOKEN_COUNTS_NAME, counts,
                             {"target_sha256": asset.sha256, "num_tokens": int(counts.sum())})
    dropped = {r: totals.get(f"dropped_{r}", 0) for r in DROP_REASONS}
    meta = {
        "target_path": str(asset.path),
        "target_sha256": asset.sha256,
        "target_model": target_cfg.model,
        "target_dtype": target_cfg.dtype,
        "aux_layer_ids": list(layer_ids),
        "aux_layer_semantics": "vLLM: input of decoder layer i = HF hidden_states[i]",
        "dtype": capture_cfg.dtype,
        "hidden_size": hidden_size,
        "aux_width": len(layer_ids) * hidden_size,
        "vocab_size": vocab_size,
        "final_hidden": "after the target's final norm: target logits = lm_head(final_hidden)",
        "bytes_per_token": shards.bytes_per_token(hidden_size, capture_cfg.dtype, len(layer_ids)),
        "bytes_per_token_on_disk": disk / max(num_tokens, 1),
        "num_conversations": len(rows),
        "num_samples": len(manifest_rows),
        "num_tokens": num_tokens,
        "num_loss_tokens": int(totals.get("num_loss_tokens", 0)),
        "num_shards": len(tasks),
        "num_truncated": int(totals.get("truncated", 0)),
        "dropped": dropped,
        "fingerprint": fp,
        "capture_tokens_per_s_this_run": new_tokens / run_s if pending and run_s > 0 else None,
        # tokens / time in the model step (batching, forward, copy to host, validate), summed over actors
        "forward_tokens_per_s": new_tokens / forward_s if forward_s > 0 else None,
    }
    shards.write_capture_meta(out_dir, meta)
    shards.write_manifest(out_dir, manifest_rows)  # last: marks the capture finished
    seconds = time.perf_counter() - t_start
    result = CaptureResult(
        out_dir=out_dir, num_samples=len(manifest_rows), num_tokens=num_tokens,
        num_loss_tokens=meta["num_loss_tokens"], num_shards=len(tasks), num_shards_reused=num_reused,
        dropped=dropped, num_truncated=meta["num_truncated"], bytes_per_token=meta["bytes_per_token_on_disk"],
        seconds=seconds, tokens_per_s=new_tokens / run_s if pending and run_s > 0 else 0.0, meta=meta,
    )
    log.info(
        "capture done: %d samples, %d tokens, %s on disk (%.0f B/token), %.0f tokens/s, dropped %s, truncated %d",
        result.num_samples, num_tokens, shards.format_bytes(disk), result.bytes_per_token, result.tokens_per_s,
        dropped, result.num_truncated,
    )
    return result


# ---------------------------------------------------------------------------------------------- token counts


def count_tokens(
    source, vocab_size: int, *, tokenizer=None, manifest_rows: Sequence[Mapping[str, Any]] | None = None,
    max_length_tokens: int | None = None,
) -> torch.Tensor:
    """``[V]`` int64 counts of assistant (loss-mask) tokens, the input of
    ``peagle_core.vocab.vocab_mapping_from_counts`` (d2t/t2d).

    ``source``: a capture directory (reads only ``input_ids``/``loss_mask`` of each shard, lazily; rows
    from ``manifest_rows`` or the manifest) or conversation rows (``id``, ``messages``) with ``tokenizer``
    (the streaming path: no capture on disk).

    Raises:
        ValueError: conversation rows without a tokenizer, or ids outside ``[0, vocab_size)``.
    """
    if isinstance(source, (str, Path)):
        from safetensors import safe_open

        capture_dir = Path(source)
        if manifest_rows is None:
            manifest_rows = shards.load_manifest(capture_dir).to_pylist()
        counts = torch.zeros(vocab_size, dtype=torch.int64)
        for name in dict.fromkeys(r["shard"] for r in manifest_rows):
            with safe_open(str(capture_dir / name), framework="pt") as f:
                ids, mask = f.get_tensor("input_ids"), f.get_tensor("loss_mask")
            counts += shards.count_token_ids([ids], vocab_size, masks=[mask])
        return counts
    if tokenizer is None:
        raise ValueError("count_tokens over conversation rows needs the target tokenizer (tokenizer=...)")
    prepared = prepare_samples(tokenizer, _conversation_rows(source), max_length_tokens=max_length_tokens)
    return shards.count_token_ids([p[1] for p in prepared], vocab_size, masks=[p[2] for p in prepared])


# ---------------------------------------------------------------------------------------------- streaming / reading


def _to_ray_dataset(conversations):
    import ray

    if hasattr(conversations, "map_batches") and hasattr(conversations, "take_all"):
        return conversations
    rows = _conversation_rows(conversations)
    return ray.data.from_items(rows)


def capture_stream(
    conversations_ds,
    target_cfg: TargetConfig,
    capture_cfg: CaptureConfig,
    data_cfg: DataConfig,
    *,
    num_cpus_per_worker: float = 1,
    num_gpus_per_worker: float | None = None,
) -> ray.data.Dataset:
    """Streaming capture: a lazy Ray Dataset of captured rows (``sample_id, input_ids, loss_mask, aux,
    final_hidden``; variable-shaped tensors, hidden states in ``capture.dtype``, bf16 carried as
    float32) that the trainer consumes directly; nothing is written to disk.

    Two stages: :func:`tokenize_conversations` (CPU tasks) then :class:`CaptureActor`
    (``capture.num_workers`` actors, ``num_cpus_per_worker`` CPUs and ``num_gpus_per_worker`` GPUs
    each; None = 1 if the Ray cluster has GPUs, else 0). ``conversations_ds``: a Ray Dataset of
    ``{id, messages}`` rows (or anything :func:`run_capture` accepts). Drop/truncate counts are
    logged by the tokenize tasks, not returned.

    Raises:
        ValueError: bad config (backend, dtype), or an unknown target (before any actor starts).
    """
    import ray

    _check_backend(capture_cfg)
    shards.dtype_name(capture_cfg.dtype)
    if capture_cfg.dtype == "bfloat16":
        log.warning("capture.dtype=bfloat16: streamed rows carry it as float32 (exact; numpy/Arrow have no bf16)")
    asset, config = resolve_target(target_cfg)
    layer_ids = target_cfg.resolve_aux_layer_ids(config["num_hidden_layers"])
    ds = _to_ray_dataset(conversations_ds)
    num_gpus = _num_gpus_per_worker(num_gpus_per_worker)
    tokenized = ds.map_batches(
        tokenize_conversations,
        fn_kwargs={"tokenizer_path": str(asset.path), "max_length_tokens": data_cfg.max_length_tokens,
                   "on_too_long": capture_cfg.on_too_long},
        batch_size=capture_cfg.batch_size,
        batch_format="pyarrow",
        num_cpus=_tokenize_num_cpus(num_gpus, num_cpus_per_worker, capture_cfg.num_workers),
    )
    return tokenized.map_batches(
        CaptureActor,
        fn_constructor_args=(str(asset.path), target_cfg.dtype, capture_cfg, layer_ids, data_cfg.max_length_tokens),
        fn_constructor_kwargs={"num_threads": max(1, int(num_cpus_per_worker))},
        compute=ray.data.ActorPoolStrategy(size=capture_cfg.num_workers),
        batch_size=capture_cfg.batch_size,
        batch_format="pyarrow",
        num_cpus=num_cpus_per_worker,
        num_gpus=num_gpus,
    )


def _read_shard_rows(batch, capture_dir: str, verify: bool) -> dict[str, Any]:
    samples = []
    for name in list(batch["shard"]):
        samples.extend(shards.read_shard(Path(capture_dir) / str(name), verify=verify).samples())
    return samples_to_columns(samples)


def captured_dataset(capture_dir: str | Path, *, verify: bool = True) -> ray.data.Dataset:
    """A materialized capture as a Ray Dataset of sample rows (same schema as :func:`capture_stream`),
    one shard per read task, checksums verified on read.

    Raises:
        ShardError: no manifest (unfinished capture: re-run it). Corrupt shards raise on read, naming the file.
    """
    import ray

    capture_dir = Path(capture_dir)
    names = list(dict.fromkeys(shards.load_manifest(capture_dir).column("shard").to_pylist()))
    ds = ray.data.from_items([{"shard": n} for n in names], override_num_blocks=max(1, len(names)))
    return ds.map_batches(_read_shard_rows, batch_size=1, fn_kwargs={"capture_dir": str(capture_dir), "verify": verify})
