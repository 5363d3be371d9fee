"""Draft vocabulary: token counts (counting, ``token_counts.safetensors``) and ``d2t`` / ``t2d``
from them (EAGLE-3 convention).

vLLM reads ``d2t`` as offsets: ``target_id = draft_id + d2t[draft_id]``
(``vllm/model_executor/models/llama_eagle3.py::compute_logits``); ``t2d`` is a bool mask over the
target vocabulary of the ids kept (ignored by vLLM, used in training to map labels).

Shape legend: V target vocab, Vd draft vocab.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from peagle_core.samples import as_tensor
from peagle_core.shards import ShardError, atomic_write_bytes

TOKEN_COUNTS_NAME = "token_counts.safetensors"


def count_token_ids(
    token_ids: Iterable[Sequence[int] | np.ndarray | torch.Tensor], vocab_size: int,
    masks: Iterable[Any] | None = None,
) -> torch.Tensor:
    """``[V]`` int64 counts of target ids over sequences (only where ``mask`` is set when given).

    Raises:
        ValueError: an id outside ``[0, vocab_size)``.
    """
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    mask_iter = iter(masks) if masks is not None else None
    for ids in token_ids:
        t = as_tensor(np.asarray(ids) if not isinstance(ids, torch.Tensor) else ids).to(torch.int64).reshape(-1)
        if mask_iter is not None:
            t = t[as_tensor(np.asarray(next(mask_iter))).reshape(-1).to(torch.bool)]
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= vocab_size):
            raise ValueError(f"token id {int(t.max())} or {int(t.min())} outside [0, vocab_size={vocab_size})")
        counts += torch.bincount(t, minlength=vocab_size)
    return counts


def save_token_counts(path: str | Path, counts: torch.Tensor, metadata: Mapping[str, Any] | None = None) -> Path:
    """Write ``counts [V]`` int64 as ``token_counts.safetensors`` (key ``counts``), atomically."""
    from safetensors.torch import save

    path = Path(path)
    header = {k: v if isinstance(v, str) else json.dumps(v, sort_keys=True) for k, v in (metadata or {}).items()}
    atomic_write_bytes(path, save({"counts": counts.to(torch.int64).contiguous()}, metadata=header))
    return path


def load_token_counts(path: str | Path) -> torch.Tensor:
    """``counts [V]`` int64 from :func:`save_token_counts` (input of ``vocab_mapping_from_counts``).

    Raises:
        ShardError: missing or corrupt file.
    """
    from safetensors.torch import load_file

    try:
        return load_file(str(path))["counts"]
    except Exception as e:
        raise ShardError(f"token counts {path} missing or corrupt ({type(e).__name__}: {e})") from e


def vocab_mapping_from_counts(
    counts: torch.Tensor, draft_vocab_size: int, *, always_keep: list[int] | tuple[int, ...] = ()
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep the ``draft_vocab_size`` most frequent target tokens.

    Args:
        counts: ``[V]`` token counts over regenerated assistant tokens.
        draft_vocab_size: Vd, number of ids kept.
        always_keep: target ids kept whatever their count (e.g. EOS, the chat template's end-of-turn).

    Returns:
        ``(d2t [Vd] int64 offsets, t2d [V] bool)``; draft ids are the kept target ids in ascending
        order, so ``d2t`` is non-negative and non-decreasing.

    Raises:
        ValueError: ``draft_vocab_size`` outside ``[1, V]``, more ``always_keep`` ids than slots,
            or an ``always_keep`` id outside the vocabulary.
    """
    counts = counts.detach().to(torch.float64).flatten()
    V = counts.numel()
    if not 1 <= draft_vocab_size <= V:
        raise ValueError(f"draft_vocab_size={draft_vocab_size} must be in [1, vocab_size={V}]")
    keep = sorted({int(i) for i in always_keep})
    if any(not 0 <= i < V for i in keep):
        raise ValueError(f"always_keep={keep} has ids outside [0, {V})")
    if len(keep) > draft_vocab_size:
        raise ValueError(f"always_keep has {len(keep)} ids but draft_vocab_size={draft_vocab_size}")
    score = counts.clone()
    score[keep] = float("inf")
    # Stable sort: equal counts keep ascending id order.
    chosen = torch.argsort(-score, stable=True)[:draft_vocab_size]
    chosen, _ = torch.sort(chosen)
    d2t = chosen - torch.arange(draft_vocab_size)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[chosen] = True
    return d2t.to(torch.int64), t2d


def target_to_draft_ids(t2d: torch.Tensor) -> torch.Tensor:
    """``[V]`` int64: draft id of each target id, ``-1`` where the id is not in the draft vocab."""
    out = torch.full(t2d.shape, -1, dtype=torch.int64)
    out[t2d] = torch.arange(int(t2d.sum()))
    return out


__all__ = [
    "TOKEN_COUNTS_NAME",
    "count_token_ids",
    "load_token_counts",
    "save_token_counts",
    "target_to_draft_ids",
    "vocab_mapping_from_counts",
]
