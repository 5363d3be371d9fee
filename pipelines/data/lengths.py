"""Tokens per conversation: how long the training conversations are (the chat template applied), as a distribution.

A head learns to draft after long histories only from long training conversations (issue 42: >= 5% over 4k
tokens). The regenerate stage reports the distribution of its conversations (:func:`conversation_lengths` on a
seeded sample: tokenizing every one of 300k conversations would cost minutes), the capture stage that of the samples
it wrote (exact, after ``data.max_length_tokens``).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

LENGTH_THRESHOLDS = (1024, 2048, 4096)  # tokens: the long-history buckets of the eval (1k / 2k / 4k of history)
LENGTH_SAMPLE = 10_000  # conversations tokenized for the regenerate stage's distribution (shares within ~0.5%)


def length_distribution(lengths: Sequence[int], *, sampled_from: int | None = None) -> dict[str, Any]:
    """``p50``, ``p90``, ``p99``, ``max`` of ``lengths`` (tokens) and ``share_over`` ({threshold: share longer}, for each
    of :data:`LENGTH_THRESHOLDS`); with ``sampled_from``, ``sample`` (how many were measured) and ``of`` (how many
    there are). Empty for no lengths."""
    if not lengths:
        return {}
    import numpy as np

    a = np.asarray(lengths)
    out = {f"p{q}": int(np.percentile(a, q)) for q in (50, 90, 99)} | {
        "max": int(a.max()), "share_over": {str(t): round(float((a > t).mean()), 4) for t in LENGTH_THRESHOLDS}}
    return out | ({"sample": len(lengths), "of": sampled_from} if sampled_from is not None else {})


def conversation_lengths(rows: Sequence[Mapping[str, Any]], tokenizer, *, sample: int = LENGTH_SAMPLE,
                         seed: int = 0) -> list[int]:
    """Tokens of each conversation of a seeded sample of ``rows`` (all of them when there are at most ``sample``):
    the whole conversation in ``tokenizer``'s chat template (what the capture stage tokenizes, before
    ``data.max_length_tokens``)."""
    picked = rows if len(rows) <= sample else random.Random(seed).sample(list(rows), sample)
    texts = [tokenizer.apply_chat_template(list(r["messages"]), tokenize=False) for r in picked]
    return [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]] if texts else []


__all__ = ["LENGTH_SAMPLE", "LENGTH_THRESHOLDS", "conversation_lengths", "length_distribution"]
