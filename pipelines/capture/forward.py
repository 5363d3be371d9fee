"""The model step of capture: tokenized rows -> the target's aux and final hidden states per sample.

Rows are grouped by length into right-padded batches, run through
:func:`peagle_core.target.target_forward`, and the real tokens' hidden states are cast to
``capture.dtype`` on the device and copied to the host once per batch (on CUDA: pinned memory, a
side stream, so the copy of batch i overlaps the forward of batch i+1). :func:`capture_batch`
chains tokenization and this step in one process (no Ray).

Shape legend: B batch, T padded tokens, N tokens of one sample, S real tokens of a batch,
A aux width (``len(layer_ids) * Ht``), Ht target hidden.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from peagle_core.samples import (
    AUX,
    FINAL_HIDDEN,
    HIDDEN_DTYPES,
    INPUT_IDS,
    LOSS_MASK,
    dtype_name,
    validate_sample,
)
from peagle_core.target import target_forward
from pipelines.capture.rows import SAMPLE_ID
from pipelines.capture.tokenize import tokenize_rows

if TYPE_CHECKING:
    from pipelines.recipe import CaptureConfig


def length_batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Indices grouped by length (longest first) into batches of at most ``batch_size``: little padding."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


def storage_dtype(cfg: CaptureConfig) -> torch.dtype:
    """The torch dtype hidden states are stored in (``capture.dtype``).

    Raises:
        ValueError: ``capture.dtype`` is not one of ``peagle_core.samples.HIDDEN_DTYPES``.
    """
    return HIDDEN_DTYPES[dtype_name(cfg.dtype)]


def pad_id(tokenizer) -> int:
    """The id right-padding a batch: the tokenizer's pad id, else 0 (padding is masked out)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0


def _check_tokenized(rows: Sequence[Mapping[str, Any]], dtype: torch.dtype,
                     max_length_tokens: int | None) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """``(sample_id, ids, mask)`` of tokenized rows that pass the token half of
    :func:`peagle_core.samples.validate_sample`, checked with array ops over all rows before any compute.

    Raises:
        ValueError: from ``validate_sample`` (zero-width hidden states stand in), naming the first bad
            sample: empty or non-integer ``input_ids``, ``loss_mask`` of another length or dtype, not
            0/1 or all zero, more than ``max_length_tokens`` tokens.
    """
    sids = [r[SAMPLE_ID] for r in rows]
    ids = [np.asarray(r[INPUT_IDS]) for r in rows]
    masks = [np.asarray(r[LOSS_MASK]) for r in rows]
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
            validate_sample({SAMPLE_ID: s, INPUT_IDS: i, LOSS_MASK: m, AUX: stand_in, FINAL_HIDDEN: stand_in},
                            num_aux=0, dtype=dtype, max_length=max_length_tokens)
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
    progress: Callable[[int], None] | None = None,
) -> list[dict[str, Any]]:
    """The model step of capture: tokenized rows (``sample_id``, ``input_ids [N]``, ``loss_mask [N]``,
    e.g. from :func:`~pipelines.capture.tokenize.tokenize_rows`) -> one captured sample per row, in
    input order::

        sample_id str, input_ids int32 [N], loss_mask uint8 [N], aux [N, 3*Ht], final_hidden [N, Ht]

    Rows are grouped by length into right-padded ``[B, T]`` batches of ``cfg.batch_size`` (built with
    array ops), run through :func:`peagle_core.target.target_forward` (``return_logits=False``, under
    ``torch.inference_mode``), then the real tokens' hidden states are gathered and cast to
    ``cfg.dtype`` on the device into one packed buffer per batch (aux rows, then final rows) and
    copied to the host once: on CUDA into pinned memory with ``non_blocking=True`` on a side stream,
    so the copy of batch i overlaps the forward of batch i+1, and one wait per batch. Each sample's
    tensors are contiguous views of that batch's host buffers (no per-sample copy); on CPU the packed
    buffer is the host buffer. Values equal the per-sample ``aux.to(dtype)[b, :n]`` slices bit for bit.

    Rows are always checked with the token half of :func:`peagle_core.samples.validate_sample` before
    any forward (array ops, microseconds per row). ``validate``: also check the hidden states for
    NaN/Inf, by one reduction per batch on the device (a failing batch's samples then go through
    ``validate_sample`` on the host, which names the sample). ``stats`` receives ``num_samples``,
    ``num_tokens``, ``num_loss_tokens``; ``progress(n)`` is called as each batch's ``n`` samples are done.

    Raises:
        ValueError: a malformed tokenized row (before compute), or NaN/Inf in a sample's hidden states
            (naming the sample and the field; the target forward overflowed).
    """
    stats = stats if stats is not None else Counter()
    advance = progress or (lambda n: None)
    dtype = storage_dtype(cfg)
    layer_ids = tuple(int(i) for i in layer_ids)
    rows = _check_tokenized(tokenized, dtype, max_length_tokens)
    if not rows:
        return []
    device = next(model.parameters()).device
    copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    lengths = np.array([len(r[1]) for r in rows], dtype=np.int64)
    results: list[dict[str, Any] | None] = [None] * len(rows)
    pending: _PendingBatch | None = None
    for index in length_batches(lengths.tolist(), cfg.batch_size):
        batch = _forward_batch(model, rows, index, lengths[index], layer_ids, dtype, pad_token_id=pad_token_id,
                               copy_stream=copy_stream, validate=validate)
        if pending is not None:  # the previous batch's copy ran while this batch's forward was queued
            _cut_samples(pending, rows, results, stats, dtype, layer_ids, max_length_tokens)
            advance(len(pending.index))
        pending = batch
    _cut_samples(pending, rows, results, stats, dtype, layer_ids, max_length_tokens)
    advance(len(pending.index))
    return [r for r in results if r is not None]


def _forward_batch(model, rows: Sequence[tuple[str, np.ndarray, np.ndarray]], index: list[int], lens: np.ndarray,
                   layer_ids: tuple[int, ...], dtype: torch.dtype, *, pad_token_id: int, copy_stream,
                   validate: bool) -> _PendingBatch:
    """One batch of :func:`capture_tokenized`: pad rows ``index`` (``lens [B]`` tokens each) to ``[B, T]``,
    run the target forward, gather the real tokens' aux and final hidden states in ``dtype`` into one
    packed buffer on the device and queue its copy to the host (``copy_stream``: the CUDA side stream,
    None on CPU, where the packed buffer is the host buffer)."""
    device = next(model.parameters()).device
    cuda = copy_stream is not None
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
    return _PendingBatch(
        index=index, lengths=lens, hidden=host, aux_width=aux_width, finite=host_finite, copied=copied,
        input_ids=torch.from_numpy(flat_ids.astype(np.int32, copy=False)),
        loss_mask=torch.from_numpy(np.concatenate([rows[i][2] for i in index]).astype(np.uint8, copy=False)),
    )


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
        samples.append({SAMPLE_ID: rows[i][0], INPUT_IDS: batch.input_ids[lo:hi], LOSS_MASK: batch.loss_mask[lo:hi],
                        AUX: aux[lo:hi], FINAL_HIDDEN: fin[lo:hi]})
    if batch.finite is not None and not bool(batch.finite):
        for s in samples:  # names the first bad sample and field
            validate_sample(s, hidden_size=fin.shape[-1], num_aux=len(layer_ids), dtype=dtype,
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

    :func:`~pipelines.capture.tokenize.tokenize_rows` (``cfg.on_too_long`` over ``max_length_tokens``)
    then :func:`capture_tokenized` (padding with the tokenizer's pad id): one dict per kept
    conversation, in input order::

        sample_id str, input_ids int32 [N], loss_mask uint8 [N], aux [N, 3*Ht], final_hidden [N, Ht]

    hidden states cast to ``cfg.dtype``. ``stats`` (a Counter) receives conversation/token/drop counts.
    The Ray stages run the two halves as separate ``map_batches`` stages (CPU tokenize, model actor).

    Raises:
        ValueError: bad ``cfg``/chat template (before compute), or a sample failing
            :func:`peagle_core.samples.validate_sample` (e.g. NaN/Inf from the target).
    """
    stats = stats if stats is not None else Counter()
    storage_dtype(cfg)  # a bad dtype fails before tokenization
    tokenized = tokenize_rows(tokenizer, rows, max_length_tokens=max_length_tokens, on_too_long=cfg.on_too_long,
                              stats=stats)
    return capture_tokenized(model, tokenized, cfg, layer_ids, pad_token_id=pad_id(tokenizer),
                             max_length_tokens=max_length_tokens, stats=stats, validate=validate)
