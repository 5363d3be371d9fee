"""Sequence partitioning of P-EAGLE training (arXiv 2602.01469, Algorithm 1).

The elements of one packed sequence (see ``peagle_core.elements``) are split into S segments
over anchors with boundaries ``{0, L/S, 2L/S, ..., L}`` (L = sequence length, integer division):

* a depth-0 element ``(a, 0)`` belongs to the segment containing ``a``;
* a depth-d element ``(a, d)``, d >= 1, belongs to the segment containing ``a + 1`` (every depth
  >= 1 element of an anchor inherits its parent's segment);
* each segment's forward also takes every depth-0 element left of its lower boundary as
  key/value context: these slots are recomputed (as queries without loss) so that the keys of
  all layers equal the unpartitioned ones.

One forward+backward per segment with losses divided by the batch's total number of loss
elements then sums to exactly the unpartitioned gradient, while the attention of one forward
covers only ``(context + own)`` slots instead of all of them. Elements are sorted by segment key
(``Elements.seg_key``), so each segment's own elements are a contiguous slice.

Shape legend: M elements, S segments, L anchors (tokens of the packed sequence).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from peagle_core.elements import Elements


def segment_boundaries(num_anchors: int, num_partitions: int) -> list[int]:
    """``[0, L//S, 2L//S, ..., L]`` (S+1 integers).

    Raises:
        ValueError: ``num_partitions < 1`` or ``num_anchors < 0``.
    """
    if num_partitions < 1:
        raise ValueError(f"num_partitions={num_partitions} must be >= 1")
    if num_anchors < 0:
        raise ValueError(f"num_anchors={num_anchors} must be >= 0")
    return [(s * num_anchors) // num_partitions for s in range(num_partitions + 1)]


@dataclass
class Segment:
    """One segment of Algorithm 1.

    Args:
        index: segment number s.
        lo, hi: anchor boundaries; own elements have ``lo <= seg_key < hi`` (the last segment
            also takes any key >= hi).
        start, end: the own elements are ``elements[start:end]``.
        context: ``[C]`` int64 element indices of the depth-0 elements with anchor < ``lo``
            (keys-only context, recomputed in this segment's forward).
    """

    index: int
    lo: int
    hi: int
    start: int
    end: int
    context: torch.Tensor

    @property
    def own(self) -> slice:
        """The slice of the own elements, ``start:end``."""
        return slice(self.start, self.end)

    @property
    def indices(self) -> torch.Tensor:
        """``[C + end - start]`` element indices of this segment's forward: context, then own."""
        own = torch.arange(self.start, self.end, device=self.context.device)
        return torch.cat([self.context, own])

    @property
    def num_forward_slots(self) -> int:
        """Slots of this segment's forward: context plus own."""
        return int(self.context.numel()) + self.end - self.start


def partition_elements(el: Elements, num_partitions: int, *, num_anchors: int | None = None) -> list[Segment]:
    """Split sorted elements into ``num_partitions`` segments (Algorithm 1).

    Args:
        el: elements sorted by ``seg_key`` (as ``build_peagle_elements`` returns them).
        num_partitions: S >= 1.
        num_anchors: L, the packed sequence length (default: largest segment key + 1).

    Returns:
        S segments in order (some may own no element when S is large).

    Raises:
        ValueError: ``num_partitions < 1`` or elements not sorted by ``seg_key``.
    """
    key = el.seg_key
    if key.numel() > 1 and bool((key[1:] < key[:-1]).any()):
        raise ValueError("elements must be sorted by seg_key (use build_peagle_elements)")
    L = num_anchors if num_anchors is not None else (int(key.max()) + 1 if key.numel() else 0)
    bounds = segment_boundaries(L, num_partitions)
    cuts = torch.searchsorted(key, torch.tensor(bounds, device=key.device, dtype=key.dtype)).tolist()
    cuts[0], cuts[-1] = 0, key.numel()
    is0 = el.depth == 0
    out = []
    for s in range(num_partitions):
        start, end = cuts[s], cuts[s + 1]
        context = torch.nonzero(is0[:start]).flatten()
        out.append(Segment(index=s, lo=bounds[s], hi=bounds[s + 1], start=start, end=end, context=context))
    return out


__all__ = ["Segment", "partition_elements", "segment_boundaries"]
