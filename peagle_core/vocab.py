"""Draft-vocabulary pruning: ``d2t`` / ``t2d`` from token counts (EAGLE-3 convention).

vLLM reads ``d2t`` as offsets: ``target_id = draft_id + d2t[draft_id]``
(``vllm/model_executor/models/llama_eagle3.py::compute_logits``); ``t2d`` is a bool mask over the
target vocabulary of the ids kept (ignored by vLLM, used in training to map labels).

Shape legend: V target vocab, Vd draft vocab.
"""

from __future__ import annotations

import torch


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
