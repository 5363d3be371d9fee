"""Training data on a worker: captured samples packed greedily into ``PackedBatch`` es of at most
``batch_tokens`` tokens, the data position a resume skips to, the epoch length this packing gives,
and a Ray Data row turned into a sample.

Sample format (one row of the capture stage, ``pipelines.capture``; keys ``peagle_core.samples.SAMPLE_KEYS``):
``input_ids [N]`` int, ``loss_mask [N]`` (1 on assistant tokens), ``aux [N, 3*Ht]`` (target aux hidden
states at vLLM's layer ids), ``final_hidden [N, Ht]`` (after the target's final norm).

Shape legend: N tokens of a sample, Ht target hidden.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from peagle_core.batch import PackedBatch, pack_samples
from peagle_core.samples import INPUT_IDS, SAMPLE_KEYS

log = logging.getLogger(__name__)

Sample = Mapping[str, Any]
PackFn = Callable[[list[Sample], int], list[PackedBatch]]  # pack_samples(samples, max_tokens)

__all__ = ["PackFn", "Sample", "estimate_steps_per_epoch", "iter_packed_batches", "row_to_sample", "sample_len"]


def sample_len(s: Sample) -> int:
    """Tokens of one sample (``len(input_ids)``)."""
    return len(s[INPUT_IDS])


def _truncate(s: Sample, n: int) -> dict:
    return {k: (v[:n] if k in SAMPLE_KEYS else v) for k, v in s.items()}


def iter_packed_batches(
    samples: Iterable[Sample],
    batch_tokens: int,
    pack_fn: PackFn = pack_samples,
    *,
    skip_samples: int = 0,
) -> Iterator[tuple[PackedBatch, int]]:
    """Greedy streaming packing: yields ``(PackedBatch, num_samples)`` with at most
    ``batch_tokens`` tokens each, in sample order.

    The first ``skip_samples`` samples are dropped (resume inside an epoch). A sample longer than
    ``batch_tokens`` is truncated to it (warned once). ``num_samples`` counts the samples inside
    the batch, so the running sum is the data position to checkpoint.
    """
    buf: list[Sample] = []
    buf_tokens = 0
    warned = False
    it = iter(samples)
    for _ in range(skip_samples):
        if next(it, None) is None:
            return
    for s in it:
        n = sample_len(s)
        if n == 0:
            continue
        if n > batch_tokens:
            if not warned:
                log.warning("a sample of %d tokens exceeds batch_tokens=%d: truncated (raise batch_tokens "
                            "to keep long samples whole)", n, batch_tokens)
                warned = True
            s, n = _truncate(s, batch_tokens), batch_tokens
        if buf and buf_tokens + n > batch_tokens:
            yield from _pack(buf, batch_tokens, pack_fn)
            buf, buf_tokens = [], 0
        buf.append(s)
        buf_tokens += n
    if buf:
        yield from _pack(buf, batch_tokens, pack_fn)


def _pack(buf: list[Sample], batch_tokens: int, pack_fn: PackFn) -> Iterator[tuple[PackedBatch, int]]:
    batches = pack_fn(buf, batch_tokens)
    # pack_fn gets samples that fit into one batch; should it split them, the samples are
    # attributed to the last batch (the data position then stays exact at batch boundaries).
    for i, b in enumerate(batches):
        yield b, (len(buf) if i == len(batches) - 1 else 0)


def estimate_steps_per_epoch(lengths: Iterable[int], batch_tokens: int, num_workers: int = 1) -> int:
    """Steps per epoch per worker of greedy packing of ``lengths`` into ``batch_tokens``, assuming the
    samples are split evenly over ``num_workers`` (a lower bound is safer: floor)."""
    num_batches, cur = 0, 0
    for n in lengths:
        n = min(int(n), batch_tokens)
        if n == 0:
            continue
        if cur and cur + n > batch_tokens:
            num_batches, cur = num_batches + 1, 0
        cur += n
    num_batches += 1 if cur else 0
    return max(1, num_batches // max(1, num_workers))


def row_to_sample(row: Mapping, float_dtype: torch.dtype = torch.float32) -> dict:
    """A Ray Data row (numpy arrays; float16 after parquet) -> a sample of torch tensors: ``input_ids``
    int64, floating tensors in ``float_dtype``, other keys (``sample_id``) unchanged."""
    out: dict[str, Any] = {}
    for k, v in row.items():
        if k in SAMPLE_KEYS:
            t = torch.as_tensor(v)
            if k == INPUT_IDS:
                t = t.long()
            elif t.is_floating_point():
                t = t.to(float_dtype)
            out[k] = t
        else:
            out[k] = v
    return out
