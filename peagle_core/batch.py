"""Packed batches: one or more captured samples (documents) concatenated into one sequence, the
unit a training forward runs on.

Each document keeps its own positions (``position_ids`` restart at 0) and id (``doc_ids``); the
attention masks (``peagle_core.masks``) keep documents apart.

Shape legend: N tokens of a packed sequence, Ht target hidden.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from peagle_core.samples import SAMPLE_KEYS


@dataclass
class PackedBatch:
    """One packed sequence of one or more documents (samples), what one forward trains on.

    Args:
        input_ids: ``[N]`` int64 token ids (target vocabulary).
        loss_mask: ``[N]`` bool, True at assistant tokens (the tokens a loss may predict).
        doc_ids: ``[N]`` int64, document index inside the pack (non-decreasing).
        position_ids: ``[N]`` int64, position inside the document (RoPE).
        aux: ``[N, 3*Ht]`` target aux hidden states (vLLM layer ids, "input of layer i").
        final_hidden: ``[N, Ht]`` target last hidden state AFTER the final norm (its
            ``lm_head`` gives the target's next-token logits).
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    doc_ids: torch.Tensor
    position_ids: torch.Tensor
    aux: torch.Tensor
    final_hidden: torch.Tensor

    @property
    def num_tokens(self) -> int:
        """N, tokens of the packed sequence."""
        return int(self.input_ids.shape[0])

    @property
    def device(self) -> torch.device:
        """Device of the tensors (that of ``input_ids``)."""
        return self.input_ids.device

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> PackedBatch:
        """Move to ``device``; ``dtype`` (if given) applies to ``aux`` and ``final_hidden``."""
        return PackedBatch(
            input_ids=self.input_ids.to(device), loss_mask=self.loss_mask.to(device),
            doc_ids=self.doc_ids.to(device), position_ids=self.position_ids.to(device),
            aux=self.aux.to(device, dtype), final_hidden=self.final_hidden.to(device, dtype),
        )

    def validate(self, *, aux_width: int | None = None, target_hidden_size: int | None = None) -> None:
        """Check shapes and dtypes.

        Raises:
            ValueError: naming the field, for mismatched lengths, wrong ranks or widths.
        """
        N = self.num_tokens
        if self.input_ids.dim() != 1 or N < 1:
            raise ValueError(f"input_ids must be a non-empty 1-D tensor [N], got shape {tuple(self.input_ids.shape)}")
        for name in ("loss_mask", "doc_ids", "position_ids"):
            t = getattr(self, name)
            if tuple(t.shape) != (N,):
                raise ValueError(f"{name} has shape {tuple(t.shape)}, expected [N]=({N},) like input_ids")
        for name in ("aux", "final_hidden"):
            t = getattr(self, name)
            if t.dim() != 2 or t.shape[0] != N:
                raise ValueError(f"{name} has shape {tuple(t.shape)}, expected [N={N}, width]")
        if aux_width is not None and self.aux.shape[1] != aux_width:
            raise ValueError(f"aux width {self.aux.shape[1]} != 3*target_hidden_size={aux_width} of the drafter")
        if target_hidden_size is not None and self.final_hidden.shape[1] != target_hidden_size:
            raise ValueError(f"final_hidden width {self.final_hidden.shape[1]} != target_hidden_size={target_hidden_size}")
        if self.loss_mask.dtype != torch.bool:
            raise ValueError(f"loss_mask must be bool, got {self.loss_mask.dtype}")


def pack_samples(samples: Iterable[dict[str, Any]], max_tokens: int) -> list[PackedBatch]:
    """Greedy in-order packing of samples into sequences of at most ``max_tokens`` tokens.

    Args:
        samples: dicts with ``input_ids [n]``, ``loss_mask [n]`` (bool or 0/1), ``aux [n, 3*Ht]``,
            ``final_hidden [n, Ht]`` (tensors or array-likes).
        max_tokens: token budget of one packed sequence.

    Returns:
        Packed sequences; documents keep their order; ``doc_ids`` count from 0 in each pack and
        ``position_ids`` restart at 0 per document. A sample longer than ``max_tokens`` is cut to
        its first ``max_tokens`` tokens (with a warning).

    Raises:
        ValueError: ``max_tokens < 2``, a sample missing a key, or a sample with inconsistent
            lengths (names the sample index and key).
    """
    if max_tokens < 2:
        raise ValueError(f"max_tokens={max_tokens} must be >= 2 (a slot needs a token and a label)")
    keys = SAMPLE_KEYS
    packs: list[PackedBatch] = []
    cur: list[dict[str, torch.Tensor]] = []
    cur_len = 0
    num_cut = 0

    def flush() -> None:
        nonlocal cur, cur_len
        if cur:
            packs.append(PackedBatch(
                input_ids=torch.cat([s["input_ids"] for s in cur]),
                loss_mask=torch.cat([s["loss_mask"] for s in cur]),
                doc_ids=torch.cat([torch.full((len(s["input_ids"]),), i, dtype=torch.long) for i, s in enumerate(cur)]),
                position_ids=torch.cat([torch.arange(len(s["input_ids"])) for s in cur]),
                aux=torch.cat([s["aux"] for s in cur]),
                final_hidden=torch.cat([s["final_hidden"] for s in cur]),
            ))
        cur, cur_len = [], 0

    for i, sample in enumerate(samples):
        missing = [k for k in keys if k not in sample]
        if missing:
            raise ValueError(f"sample {i} lacks {missing}; each sample needs {list(keys)}")
        s = {k: torch.as_tensor(sample[k]) for k in keys}
        s["input_ids"] = s["input_ids"].long().flatten()
        s["loss_mask"] = s["loss_mask"].bool().flatten()
        n = len(s["input_ids"])
        for k in ("loss_mask", "aux", "final_hidden"):
            if s[k].shape[0] != n:
                raise ValueError(f"sample {i}: {k} has {s[k].shape[0]} rows but input_ids has {n} tokens")
        if n == 0:
            continue
        if n > max_tokens:
            s = {k: v[:max_tokens] for k, v in s.items()}
            n = max_tokens
            num_cut += 1
        if cur_len + n > max_tokens:
            flush()
        cur.append(s)
        cur_len += n
    flush()
    if num_cut:
        warnings.warn(f"pack_samples: {num_cut} sample(s) longer than max_tokens={max_tokens} were truncated",
                      stacklevel=2)
    return packs


__all__ = ["PackedBatch", "pack_samples"]
