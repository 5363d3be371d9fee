"""The captured-sample contract: key names, hidden-state dtypes, validation and checksums.

A captured sample (one conversation) is a dict::

    sample_id     str
    input_ids     int32      [N]          target token ids (chat template applied)
    loss_mask     uint8/bool [N]          1 on assistant tokens (what the target generated)
    aux           float      [N, 3*Ht]    aux hidden states at vLLM layer ids (input of layer i), concatenated
    final_hidden  float      [N, Ht]      target's last hidden state AFTER its final norm: logits = lm_head(final_hidden)

Why ``final_hidden`` and not the target's draft-vocab log-probs: the loss needs the target
distribution over the draft vocab at every position; storing it costs ``Vd * 2`` bytes/token
(e.g. Vd = 32k -> 64 KiB/token in bf16) against ``Ht * 2`` for the final hidden state
(SmolLM2: 1.1 KiB, Llama-3.1-8B: 8 KiB), i.e. 8-55x less; and the draft vocabulary (d2t) can be
chosen after capture. The trainer recomputes ``lm_head(final_hidden)[:, t2d]`` (Ht x Vd FLOPs per
token, small next to the drafter).

On disk samples live in shards (``peagle_core.shards``); in training they are packed into
``peagle_core.batch.PackedBatch`` es.

Shape legend: N tokens of one sample, Ht target hidden size, Vd draft vocab.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

INPUT_IDS, LOSS_MASK, AUX, FINAL_HIDDEN = "input_ids", "loss_mask", "aux", "final_hidden"
SAMPLE_KEYS = (INPUT_IDS, LOSS_MASK, AUX, FINAL_HIDDEN)  # a captured sample's tensors, in shard order
HIDDEN_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
}


def dtype_name(dtype: torch.dtype | str) -> str:
    """``"float16" | "bfloat16" | "float32"`` for a torch dtype or name.

    Raises:
        ValueError: any other dtype.
    """
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if name not in HIDDEN_DTYPES:
        raise ValueError(f"hidden-state dtype {dtype!r} is not supported; use one of {sorted(HIDDEN_DTYPES)}")
    return name


def as_tensor(x: Any) -> torch.Tensor:
    """``x`` itself if a tensor, else a tensor sharing the memory of ``numpy.ascontiguousarray(x)``."""
    if isinstance(x, torch.Tensor):
        return x
    return torch.from_numpy(np.ascontiguousarray(x))


def _raw_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach().contiguous()
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def sample_checksum(sample: Mapping[str, Any]) -> str:
    """sha256 (hex) over dtype, shape and bytes of ``input_ids, loss_mask, aux, final_hidden``.

    ``loss_mask`` is hashed as uint8 (bool and uint8 masks give the same checksum).
    """
    h = hashlib.sha256()
    for key in SAMPLE_KEYS:
        t = as_tensor(sample[key])
        if key == "loss_mask":
            t = t.to(torch.uint8)
        h.update(f"{key}:{str(t.dtype).removeprefix('torch.')}:{tuple(t.shape)};".encode())
        h.update(_raw_bytes(t))
    return h.hexdigest()


def validate_sample(
    sample: Mapping[str, Any],
    *,
    hidden_size: int | None = None,
    num_aux: int = 3,
    dtype: torch.dtype | str | None = None,
    max_length: int | None = None,
) -> None:
    """Check one captured sample against the contract above, before it is written.

    Raises:
        ValueError: naming the sample id and the field: a missing key; ``input_ids`` not 1-D integer
            or empty; ``loss_mask`` of another length, not 0/1, or all zero (no assistant tokens);
            ``aux`` not ``[N, num_aux*Ht]`` / ``final_hidden`` not ``[N, Ht]``; hidden states of an
            unsupported or unexpected dtype, or holding NaN/Inf; more than ``max_length`` tokens.
    """
    sid = sample.get("sample_id")
    where = f"sample {sid!r}"
    if not isinstance(sid, str) or not sid:
        raise ValueError(f"{where}: sample_id must be a non-empty str, got {type(sid).__name__}")
    missing = [k for k in SAMPLE_KEYS if k not in sample]
    if missing:
        raise ValueError(f"{where}: missing {missing}; a captured sample needs {list(SAMPLE_KEYS)}")
    ids, mask = as_tensor(sample["input_ids"]), as_tensor(sample["loss_mask"])
    aux, fin = as_tensor(sample["aux"]), as_tensor(sample["final_hidden"])
    if ids.dim() != 1 or ids.numel() == 0 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"{where}: input_ids must be a non-empty 1-D integer tensor, got {ids.dtype} {tuple(ids.shape)}")
    n = ids.numel()
    if max_length is not None and n > max_length:
        raise ValueError(f"{where}: {n} tokens > max_length_tokens={max_length}; truncate or drop it first")
    if tuple(mask.shape) != (n,):
        raise ValueError(f"{where}: loss_mask shape {tuple(mask.shape)} != input_ids shape ({n},)")
    if mask.dtype not in (torch.bool, torch.uint8):
        raise ValueError(f"{where}: loss_mask dtype {mask.dtype}; use bool or uint8")
    if mask.dtype == torch.uint8 and bool((mask > 1).any()):
        raise ValueError(f"{where}: loss_mask holds values other than 0/1")
    if not bool(mask.any()):
        raise ValueError(f"{where}: loss_mask is all zero (no assistant tokens); drop empty assistant turns")
    for name, t in (("aux", aux), ("final_hidden", fin)):
        if t.dtype not in HIDDEN_DTYPES.values():
            raise ValueError(f"{where}: {name} dtype {t.dtype}; use one of {sorted(HIDDEN_DTYPES)}")
        if dtype is not None and t.dtype != HIDDEN_DTYPES[dtype_name(dtype)]:
            raise ValueError(f"{where}: {name} dtype {t.dtype} != capture dtype {dtype_name(dtype)}")
        if t.dim() != 2 or t.shape[0] != n:
            raise ValueError(f"{where}: {name} shape {tuple(t.shape)}; expected [{n}, ...] (one row per token)")
    ht = fin.shape[1]
    if hidden_size is not None and ht != hidden_size:
        raise ValueError(f"{where}: final_hidden width {ht} != target hidden_size {hidden_size}")
    if aux.shape[1] != num_aux * ht:
        raise ValueError(f"{where}: aux width {aux.shape[1]} != {num_aux} x hidden {ht} (3 aux layers concatenated)")
    if aux.dtype != fin.dtype:
        raise ValueError(f"{where}: aux dtype {aux.dtype} != final_hidden dtype {fin.dtype}")
    for name, t in (("aux", aux), ("final_hidden", fin)):
        if not bool(torch.isfinite(t).all()):
            num_bad = int((~torch.isfinite(t)).sum())
            raise ValueError(f"{where}: {name} holds {num_bad} NaN/Inf values (target forward overflowed?)")


__all__ = ["AUX", "FINAL_HIDDEN", "HIDDEN_DTYPES", "INPUT_IDS", "LOSS_MASK", "SAMPLE_KEYS", "as_tensor", "dtype_name", "sample_checksum", "validate_sample"]
