"""Row formats that cross the capture stages: conversation rows in, tokenized rows between the
tokenize and model-step stages (Arrow ``list<>`` columns), captured samples out as Ray Data columns.

Key names come from :mod:`peagle_core.samples` and :mod:`peagle_core.shards` (one source): a tokenized row is
``{sample_id str, input_ids int32 [N], loss_mask uint8 [N]}``, a captured sample adds
``aux [N, 3*Ht]`` and ``final_hidden [N, Ht]``.

Shape legend: N tokens of one sample, Ht target hidden.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from peagle_core.samples import INPUT_IDS, LOSS_MASK, SAMPLE_KEYS
from peagle_core.shards import MANIFEST_COLUMNS

log = logging.getLogger(__name__)

SAMPLE_ID = MANIFEST_COLUMNS[0]  # "sample_id": a sample's key in rows, shards and the manifest
TOKENIZED_KEYS = (SAMPLE_ID, INPUT_IDS, LOSS_MASK)  # a tokenized row: the model step's input


def conversation_rows(conversations: Iterable[Mapping[str, Any]] | Any) -> list[dict[str, Any]]:
    """Conversations as plain rows ``{sample_id, id, messages: [{role, content}]}`` in input order.

    ``conversations``: a ``datasets.Dataset``, a Ray Dataset (read whole with ``take_all``) or an
    iterable of rows with ``id`` and ``messages``. ``sample_id`` is ``id``, suffixed ``#k`` for its
    k-th repeat, so it is unique; extra keys and message fields other than role/content are dropped.
    The materialized capture cuts its shard tasks from these rows, and the pipeline's streaming path
    sizes its epochs from them, so both see the same conversations.

    Raises:
        ValueError: a row without ``id`` or ``messages`` (naming its position).
    """
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
            raise ValueError(f"conversation row {i} lacks 'id'/'messages'; load prompts with pipelines.data.prompts")
        rid = str(r["id"])
        sid = rid if not seen[rid] else f"{rid}#{seen[rid]}"
        seen[rid] += 1
        out.append({SAMPLE_ID: sid, "id": rid, "messages": [{"role": m["role"], "content": m["content"]}
                                                             for m in r["messages"]]})
    if len(out) != len(seen):
        log.warning("%d duplicate conversation ids renamed with a #k suffix", len(out) - len(seen))
    return out


def rows_from_batch(batch) -> list[dict[str, Any]]:
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


def ragged_to_arrow(arrays: Sequence[np.ndarray], dtype) -> Any:
    """1-D arrays as one Arrow ``list<dtype>`` array (one flat buffer + offsets, no per-token Python)."""
    import pyarrow as pa

    lengths = np.fromiter((len(a) for a in arrays), dtype=np.int64, count=len(arrays))
    offsets = np.zeros(len(arrays) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values = np.concatenate(arrays).astype(dtype, copy=False) if len(arrays) else np.zeros(0, dtype)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))


def ragged_from_arrow(array) -> list[np.ndarray]:
    """Inverse of :func:`ragged_to_arrow`: an Arrow list array (or chunked) -> list of 1-D numpy views."""
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
        SAMPLE_ID: pa.array([str(r[SAMPLE_ID]) for r in tokenized], pa.string()),
        INPUT_IDS: ragged_to_arrow([np.asarray(r[INPUT_IDS]) for r in tokenized], np.int32),
        LOSS_MASK: ragged_to_arrow([np.asarray(r[LOSS_MASK]) for r in tokenized], np.uint8),
    })


def tokenized_from_batch(batch) -> list[dict[str, Any]]:
    """Tokenized rows from a Ray Data batch: a ``pyarrow.Table`` as made by :func:`tokenized_to_arrow`,
    or a dict of columns (``batch_format="numpy"``: ragged columns as object arrays)."""
    if hasattr(batch, "column"):
        ids, mask = ragged_from_arrow(batch.column(INPUT_IDS)), ragged_from_arrow(batch.column(LOSS_MASK))
        sids = batch.column(SAMPLE_ID).to_pylist()
    else:
        sids, ids, mask = list(batch[SAMPLE_ID]), list(batch[INPUT_IDS]), list(batch[LOSS_MASK])
    return [{SAMPLE_ID: str(s), INPUT_IDS: i, LOSS_MASK: m} for s, i, m in zip(sids, ids, mask)]


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy()


def samples_to_columns(samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Samples as Ray Data columns (variable-shaped tensors; bf16 as float32, exact: numpy has no bf16)."""
    cols: dict[str, Any] = {SAMPLE_ID: np.array([s[SAMPLE_ID] for s in samples], dtype=object)}
    for key in SAMPLE_KEYS:
        cols[key] = [_to_numpy(s[key]) if isinstance(s[key], torch.Tensor) else s[key] for s in samples]
    return cols
