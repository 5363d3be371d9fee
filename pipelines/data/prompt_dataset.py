"""The recipe's prompt dataset: every ``data.sources`` entry loaded (:mod:`pipelines.data.prompts`) and mixed.

Mixing (:func:`load_prompt_dataset`): without ``weight`` on the sources they are concatenated and
``data.num_samples`` is drawn from the union; with weights each source supplies its share of
``data.num_samples`` (largest-remainder rounding), then the mix is shuffled (all with ``data.seed``).

A ``self_instruct`` source has no file: its prompts come from the ``write_prompts`` callable
(the regenerate stage passes ``pipelines.data.selfinstruct.SelfInstructWriter``); without one
:func:`load_prompt_dataset` raises ``ValueError``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from pipelines.data.prompts import (
    SELF_INSTRUCT_NEEDS_ENGINE,
    finish_source,
    flat,
    load_conversations,
    sample,
)
from pipelines.data.rows import KEEP_ANSWERS, rows_dataset

if TYPE_CHECKING:
    import datasets

    from pipelines.recipe import DataConfig, SourceConfig

log = logging.getLogger(__name__)


PromptWriter = Callable[["SourceConfig"], Sequence[dict]]


def load_prompt_dataset(
    data: DataConfig, home: Path | None = None, *, write_prompts: PromptWriter | None = None,
) -> datasets.Dataset:
    """All of ``data.sources`` normalized and mixed (module doc: concatenation, or weighted shares),
    ``data.num_samples`` drawn deterministically (``data.seed``).

    ``write_prompts``: called once per self_instruct source with its SourceConfig, returns its prompt
    rows ``{id, messages, source}`` (:class:`pipelines.data.selfinstruct.SelfInstructWriter`).

    Raises:
        ValueError: a self_instruct source without ``write_prompts``; every error of
            :func:`load_conversations`.
    """
    if write_prompts is None and any(s.kind == "self_instruct" for s in data.sources):
        raise ValueError(SELF_INSTRUCT_NEEDS_ENGINE)
    parts = []
    for s in data.sources:
        if s.kind == "self_instruct":
            parts.append(finish_source(rows_dataset(write_prompts(s)), s, "self_instruct", data.seed))
        else:
            parts.append(load_conversations(s, data.on_bad_row, home, data.seed))
    weights = [s.weight for s in data.sources]
    if any(w is None for w in weights):
        return sample(_concatenate(parts), data.num_samples, data.seed)
    return mix_weighted(parts, weights, data.num_samples, data.seed)


def _concatenate(parts: list[datasets.Dataset]) -> datasets.Dataset:
    """``parts`` one after the other; when some carry ``keep_answers`` (a traffic source), the others
    get it as False."""
    import datasets

    if len(parts) == 1:
        return parts[0]
    if any(KEEP_ANSWERS in p.column_names for p in parts):
        parts = [p if KEEP_ANSWERS in p.column_names else p.add_column(KEEP_ANSWERS, [False] * len(p))
                 for p in parts]
        parts = [p.select_columns(parts[0].column_names) for p in parts]
    return datasets.concatenate_datasets([p if p.features == parts[0].features else p.cast(parts[0].features)
                                          for p in parts])


def weighted_quotas(sizes: Sequence[int], weights: Sequence[float], num_samples: int | None) -> list[int]:
    """Rows to draw from each source: ``num_samples`` split by ``weights`` with largest-remainder
    rounding (the quotas sum to ``num_samples``; ties go to the earlier source), each capped at the
    source's size (with a warning). ``num_samples=None``: the largest total that every source can
    supply at these shares.

    Raises:
        ValueError: a weight <= 0, or lengths differ.
    """
    if len(sizes) != len(weights) or any(w <= 0 for w in weights):
        raise ValueError(f"weights {list(weights)} must be positive, one per source ({len(sizes)})")
    total_w = float(sum(weights))
    shares = [w / total_w for w in weights]
    if num_samples is None:
        num_samples = int(min(n / p for n, p in zip(sizes, shares)) + 1e-9)
    exact = [num_samples * p for p in shares]
    quotas = [int(x) for x in exact]
    by_remainder = sorted(range(len(sizes)), key=lambda i: (-(exact[i] - quotas[i]), i))
    for i in by_remainder[: num_samples - sum(quotas)]:
        quotas[i] += 1
    for i, (q, n) in enumerate(zip(quotas, sizes)):
        if q > n:
            log.warning("source %d has %d usable conversations, fewer than its weighted share %d; using all of "
                        "them (the mix holds fewer than data.num_samples)", i, n, q)
            quotas[i] = n
    return quotas


def mix_weighted(parts: list[datasets.Dataset], weights: Sequence[float], num_samples: int | None,
                 seed: int) -> datasets.Dataset:
    """Each part's weighted share (:func:`weighted_quotas`) drawn with ``seed``, concatenated and shuffled."""
    quotas = weighted_quotas([len(p) for p in parts], weights, num_samples)
    log.info("weighted mix of %d sources: %s conversations (of %s usable)", len(parts), quotas,
             [len(p) for p in parts])
    drawn = [sample(p, q, seed) for p, q in zip(parts, quotas) if q > 0]
    return flat(_concatenate(drawn).shuffle(seed=seed))
