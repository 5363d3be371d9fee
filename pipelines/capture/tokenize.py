"""The CPU half of capture: conversations -> token ids and loss masks under the target's chat template.

:func:`tokenize_conversation` marks the tokens the target would generate (assistant turns);
:func:`prepare_samples` / :func:`tokenize_rows` add truncation and drops (``DROP_REASONS``), counted;
:func:`tokenize_conversations` and :func:`tokenize_shard_tasks` are the Ray Data ``map_batches``
functions of the streaming and the materialized capture (CPU tasks, no model);
:func:`count_assistant_tokens` turns tokenized samples into the ``[V]`` counts behind d2t/t2d.

Shape legend: N tokens of one sample, V target vocab.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from peagle_core.vocab import count_token_ids
from pipelines.capture.rows import (
    INPUT_IDS,
    LOSS_MASK,
    SAMPLE_ID,
    TOKENIZED_KEYS,
    rows_from_batch,
    tokenized_to_arrow,
)

log = logging.getLogger(__name__)

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
DROP_REASONS = ("too_long", "empty_assistant_turn", "no_assistant_turn", "no_loss_tokens_after_truncation")


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
        sid = row_sample_id(row)
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


def row_sample_id(row: Mapping[str, Any]) -> str:
    """A conversation row's sample id: its ``sample_id``, else its ``id`` (the id capture gives its sample)."""
    return str(row.get(SAMPLE_ID) or row["id"])


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
    :func:`~pipelines.capture.forward.capture_tokenized`. Same drops, truncation and ``stats`` as
    :func:`prepare_samples`.

    Raises:
        ValueError: ``on_too_long`` not truncate|drop, or no chat template (before any tokenization).
    """
    return [
        {SAMPLE_ID: sid, INPUT_IDS: np.asarray(ids, dtype=np.int32), LOSS_MASK: np.asarray(mask, dtype=np.uint8)}
        for sid, ids, mask in prepare_samples(tokenizer, rows, max_length_tokens=max_length_tokens,
                                              on_too_long=on_too_long, stats=stats)
    ]


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
    ``messages``) -> tokenized rows (:func:`~pipelines.capture.rows.tokenized_to_arrow`). Drops are
    logged, not returned.

    Use: ``ds.map_batches(tokenize_conversations, fn_kwargs=dict(tokenizer_path=..., max_length_tokens=...),
    batch_format="pyarrow")`` before the :class:`~pipelines.capture.actors.CaptureActor` stage.
    """
    tokenizer = _cached_tokenizer(tokenizer_path)
    return tokenized_to_arrow(tokenize_rows(tokenizer, rows_from_batch(batch), max_length_tokens=max_length_tokens,
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
    for task in rows_from_batch(batch):
        rows = json.loads(task["conversations"])
        stats: Counter = Counter()
        out["shard_index"].append(int(task["shard_index"]))
        out["conversation_ids"].append(json.dumps([r[SAMPLE_ID] for r in rows]))
        out["samples"].append(tokenized_to_arrow(tokenize_rows(tokenizer, rows, max_length_tokens=max_length_tokens,
                                                               on_too_long=on_too_long, stats=stats)))
        out["tokenize_stats"].append(json.dumps(dict(stats)))
    cols = {k: out[k] for k in ("shard_index", "conversation_ids", "tokenize_stats")}
    for key, typ in zip(TOKENIZED_KEYS, (pa.string(), pa.int32(), pa.uint8())):
        cols[key] = pa.ListArray.from_arrays(
            pa.array(np.cumsum([0] + [t.num_rows for t in out["samples"]]).astype(np.int32)),
            pa.concat_arrays([t.column(key).combine_chunks() for t in out["samples"]])
            if out["samples"] else pa.array([], pa.list_(typ) if key != SAMPLE_ID else typ),
        )
    return pa.table(cols)


def count_assistant_tokens(samples: Iterable[Mapping[str, Any]], vocab_size: int) -> torch.Tensor:
    """``[V]`` int64 counts of the assistant tokens (``loss_mask`` set) of tokenized samples: the input of
    ``peagle_core.vocab.vocab_mapping_from_counts`` (d2t/t2d). The one token counter of peagle.

    ``samples``: mappings with ``input_ids [N]`` and ``loss_mask [N]`` (lists, numpy arrays or tensors),
    e.g. :func:`tokenize_rows` output, captured samples, or a shard's concatenated tokens; read once,
    one at a time (a generator keeps memory flat).

    Raises:
        ValueError: an id outside ``[0, vocab_size)``.
    """
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for s in samples:
        counts += count_token_ids([s[INPUT_IDS]], vocab_size, masks=[s[LOSS_MASK]])
    return counts
