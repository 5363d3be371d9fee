"""Key/value cache of a drafter (reference decoder, TTT training) and the anchor index of a row.

Source: vLLM's proposer keeps the same per-layer keys/values on its own buffers
(``vllm/v1/spec_decode/llm_base_proposer.py``); here the cache grows by concatenation.

Shape legend: B batch, T new slots, S cached key slots, nKV key/value heads, D head dim.
"""

from __future__ import annotations

import torch


def last_valid_index(valid: torch.Tensor) -> torch.Tensor:
    """``valid [B, T]`` bool -> ``[B]`` index of each row's last True (left or right padding).

    Raises:
        ValueError: a row has no valid slot (not checked while a CUDA graph is being captured:
            the check reads the device).
    """
    capturing = valid.is_cuda and torch.cuda.is_current_stream_capturing()
    if not capturing and not bool(valid.any(1).all()):
        raise ValueError("every row needs at least one valid slot (the anchor)")
    T = valid.shape[1]
    return T - 1 - valid.flip(1).to(torch.int8).argmax(1)


class DrafterCache:
    """Per-layer key/value cache with per-slot validity and positions.

    Holds ``k, v [B, nKV, S, D]`` per layer, ``key_positions [B, S]`` and ``key_valid [B, S]``.
    Attention from the cache is position-causal (key allowed iff valid and key position <= query
    position), which equals the P-EAGLE rule as long as only committed depth-0 slots stay cached:
    the drafting helpers append speculative slots and ``crop`` them away afterwards.
    """

    def __init__(self, num_layers: int) -> None:
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers
        self.key_positions: torch.Tensor | None = None  # [B, S]
        self.key_valid: torch.Tensor | None = None  # [B, S]

    @property
    def length(self) -> int:
        return 0 if self.key_positions is None else self.key_positions.shape[1]

    def extend_meta(self, positions: torch.Tensor, valid: torch.Tensor) -> None:
        """Append slot metadata ``positions, valid [B, T]`` (called once per forward)."""
        if self.key_positions is None:
            self.key_positions, self.key_valid = positions, valid
        else:
            self.key_positions = torch.cat([self.key_positions, positions], dim=1)
            self.key_valid = torch.cat([self.key_valid, valid], dim=1)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k[layer] is not None:
            k = torch.cat([self.k[layer], k], dim=2)
            v = torch.cat([self.v[layer], v], dim=2)
        self.k[layer], self.v[layer] = k, v
        return k, v

    def crop(self, length: int) -> None:
        """Drop every slot at index >= ``length`` (speculative slots after drafting)."""
        for i in range(len(self.k)):
            if self.k[i] is not None:
                self.k[i] = self.k[i][:, :, :length]
                self.v[i] = self.v[i][:, :, :length]
        if self.key_positions is not None:
            self.key_positions = self.key_positions[:, :length]
            self.key_valid = self.key_valid[:, :length]

    def select(self, rows: torch.Tensor) -> None:
        """Keep only batch rows ``rows`` (a finished sequence leaves the batch)."""
        for i in range(len(self.k)):
            if self.k[i] is not None:
                self.k[i], self.v[i] = self.k[i][rows], self.v[i][rows]
        if self.key_positions is not None:
            self.key_positions, self.key_valid = self.key_positions[rows], self.key_valid[rows]


__all__ = ["DrafterCache", "last_valid_index"]
