"""Storage estimates of a capture: bytes per captured token and per capture, human-readable sizes.

A captured token stores an int32 id, a uint8 loss-mask flag and ``num_aux + 1`` hidden states of
width Ht (the aux states and the final hidden state; see ``peagle_core.samples``).

Shape legend: Ht target hidden size.
"""

from __future__ import annotations

import torch

from peagle_core.samples import HIDDEN_DTYPES, dtype_name

ID_BYTES, MASK_BYTES = 4, 1  # int32 ids, uint8 mask


def bytes_per_token(hidden_size: int, dtype: torch.dtype | str, num_aux: int = 3) -> int:
    """Bytes one captured token takes on disk: int32 id + uint8 mask + (num_aux + 1) x Ht hidden values.

    SmolLM2-135M (Ht = 576) in bf16: 4 + 1 + 4*576*2 = 4613 B; Llama-3.1-8B (Ht = 4096): 32 KiB + 5 B.
    """
    itemsize = HIDDEN_DTYPES[dtype_name(dtype)].itemsize
    return ID_BYTES + MASK_BYTES + (num_aux + 1) * int(hidden_size) * itemsize


def estimate_storage_bytes(
    num_samples: int, mean_len: float, hidden_size: int, dtype: torch.dtype | str = "bfloat16", num_aux: int = 3
) -> int:
    """Storage of a materialized capture: ``num_samples x mean_len tokens x bytes_per_token`` (shard
    headers and the manifest are negligible).

    Example: 30k samples x 64k tokens of GPT-OSS-120B (Ht = 2880) in bf16 -> ~45 TB (SpecForge users
    report 35 TB for that recipe), which is why long-context recipes should stream instead.

    Raises:
        ValueError: negative counts/lengths or a non-positive hidden size.
    """
    if num_samples < 0 or mean_len < 0 or hidden_size <= 0:
        raise ValueError(
            f"estimate_storage_bytes needs num_samples >= 0, mean_len >= 0, hidden_size > 0; got "
            f"{num_samples}, {mean_len}, {hidden_size}"
        )
    return round(num_samples * mean_len * bytes_per_token(hidden_size, dtype, num_aux))


def format_bytes(num_bytes: float) -> str:
    """``1536 -> '1.5 KiB'`` (binary units)."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(value) < 1024 or unit == "PiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


__all__ = ["ID_BYTES", "MASK_BYTES", "bytes_per_token", "estimate_storage_bytes", "format_bytes"]
