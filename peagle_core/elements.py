"""Drafter slots ("elements") of a packed sequence: label validity, COD sampling, the P-EAGLE
parallel groups, padding and the forward order.

Source: P-EAGLE (arXiv 2602.01469, Sec. 3-4: parallel groups, COD sampling after PARD arXiv
2504.18583, Algorithm 1's segment key); slot layout from vLLM
(``vllm/v1/spec_decode/llm_base_proposer.py``): the drafter slot at position ``p`` holds token
``x[p+1]`` and the target's aux hidden states at ``p``, and predicts ``x[p+2]``.

One *element* is a drafter slot ``(anchor a, depth d)``:

* depth 0: token ``x[a+1]``, hidden ``combine_hidden_states(aux[a])`` (next-token prediction);
* depth d >= 1: token ``mask_token_id``, hidden ``fc(mask_hidden)`` (multi-token prediction);
* RoPE position ``position_ids[a] + d`` (position within the document);
* it predicts ``x[a+d+2]``; the target distribution is
  ``softmax(target_lm_head(final_hidden[a+d+1]))`` restricted to the draft vocabulary.

A *loss element* is an element with ``a+d+2`` inside the same document and
``loss_mask[a+d+2]`` (an assistant token), kept by COD sampling. Every depth-0 element whose
token ``x[a+1]`` exists is in the forward (as a key), with or without a loss.

Element order: elements are sorted by ``(segment key, depth, anchor)`` with segment key = anchor
for depth 0 and anchor + 1 for depth >= 1, so every segment of Algorithm 1 is a contiguous slice
(see ``peagle_core.partition``). The attention rule between elements is in ``peagle_core.masks``.

Shape legend: N tokens of a packed sequence, M elements, K depths, H drafter hidden.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from peagle_core.batch import PackedBatch
from peagle_core.drafter import Eagle3Drafter


def label_valid(batch: PackedBatch, num_depths: int) -> torch.Tensor:
    """``[N, K]`` bool: slot (anchor a, depth d) has a loss label, i.e. ``a+d+2 < N``, in a's
    document, and ``loss_mask[a+d+2]``."""
    N = batch.num_tokens
    a = torch.arange(N, device=batch.device)[:, None]
    t = a + torch.arange(num_depths, device=batch.device)[None] + 2  # [N, K] label index
    inside = t < N
    tc = t.clamp(max=N - 1)
    return inside & (batch.doc_ids[tc] == batch.doc_ids[:, None]) & batch.loss_mask[tc]


def cod_sample(
    valid: torch.Tensor,
    ratio: float,
    min_ratio: float = 0.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """COD (conditional-on-distribution) sampling of loss elements per depth (PARD / P-EAGLE).

    Depth 0 keeps every valid anchor (``n0`` of them). Depth d keeps
    ``n_d = floor(max(ratio**d, min_ratio) * n0)`` anchors, drawn uniformly without replacement
    among the anchors kept at depth d-1 that are valid at depth d (all of them when fewer). The
    count is relative to depth 0 as in PARD and speculators' ``cod_sample``; the nesting
    (kept at d implies kept at d-1) keeps every kept element's shallower slots in the forward.

    Args:
        valid: ``[N, K]`` bool, ``label_valid`` of the batch (or any per-depth validity).
        ratio: r in (0, 1].
        min_ratio: r_min in [0, 1].
        generator: CPU generator for reproducible draws (``torch.randperm``, one call per depth
            with more candidates than slots).

    Returns:
        ``[N, K]`` bool, the kept loss elements.

    Raises:
        ValueError: ``ratio`` outside (0, 1], ``min_ratio`` outside [0, 1], ``valid`` not 2-D.
    """
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"cod_ratio={ratio} must be in (0, 1]")
    if not 0.0 <= min_ratio <= 1.0:
        raise ValueError(f"cod_min_ratio={min_ratio} must be in [0, 1]")
    if valid.dim() != 2:
        raise ValueError(f"valid must be [N, K], got shape {tuple(valid.shape)}")
    K = valid.shape[1]
    kept = torch.zeros_like(valid, dtype=torch.bool)
    kept[:, 0] = valid[:, 0]
    n0 = int(valid[:, 0].sum())
    for d in range(1, K):
        cand = torch.nonzero(kept[:, d - 1] & valid[:, d]).flatten()
        n = min(math.floor(max(ratio**d, min_ratio) * n0 + 1e-9), cand.numel())
        if n == cand.numel():
            chosen = cand
        else:
            perm = torch.randperm(cand.numel(), generator=generator)[:n].to(cand.device)
            chosen = cand[perm]
        kept[chosen, d] = True
    return kept


@dataclass
class Elements:
    """Drafter slots of one packed sequence, sorted by ``(seg_key, depth, anchor)``.

    All fields are ``[M]`` tensors on the batch device.

    Args:
        anchor: anchor position a (index into the packed sequence).
        depth: d (P-EAGLE depth, or the TTT step for EAGLE-3).
        doc: document id of the anchor.
        position: RoPE position ``position_ids[a] + d``.
        input_ids: token of the slot (``x[a+1]`` at depth 0, ``mask_token_id`` otherwise).
        target_index: ``a + d + 1``: row of ``final_hidden`` whose target logits are the label
            distribution (clamped into range where ``loss`` is False).
        loss: True for loss elements.
        valid: False for slots that exist only to fill a shape (never attended, no loss).
        seg_key: anchor for depth 0, anchor + 1 for depth >= 1 (Algorithm 1's segment key).
    """

    anchor: torch.Tensor
    depth: torch.Tensor
    doc: torch.Tensor
    position: torch.Tensor
    input_ids: torch.Tensor
    target_index: torch.Tensor
    loss: torch.Tensor
    valid: torch.Tensor
    seg_key: torch.Tensor

    @property
    def num_elements(self) -> int:
        """M, the number of slots."""
        return int(self.anchor.shape[0])

    @property
    def num_loss_elements(self) -> int:
        """Slots with a loss (``loss.sum()``)."""
        return int(self.loss.sum())

    def index(self, idx: torch.Tensor | slice) -> Elements:
        """The slots ``idx`` (index tensor, bool mask or slice) of every field, in that order."""
        return Elements(**{f.name: getattr(self, f.name)[idx] for f in fields(self)})

    def to(self, device: torch.device | str) -> Elements:
        """Every field moved to ``device``."""
        return Elements(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})

    def as_tuples(self) -> list[tuple[int, int]]:
        """``[(anchor, depth), ...]`` in element order (for tests and debugging)."""
        return list(zip(self.anchor.tolist(), self.depth.tolist()))


def build_peagle_elements(
    batch: PackedBatch,
    num_depths: int,
    mask_token_id: int,
    *,
    cod_ratio: float = 1.0,
    cod_min_ratio: float = 0.0,
    generator: torch.Generator | None = None,
) -> Elements:
    """The P-EAGLE parallel groups of one packed sequence, COD-sampled.

    Depth-0 elements: every anchor whose token ``x[a+1]`` lies in its document (loss element
    iff its label is valid). Depth >= 1 elements: the COD-kept loss elements only.

    Raises:
        ValueError: ``num_depths < 1``.
    """
    if num_depths < 1:
        raise ValueError(f"num_depths={num_depths} must be >= 1")
    N, dev = batch.num_tokens, batch.device
    valid = label_valid(batch, num_depths)
    kept = cod_sample(valid.cpu(), cod_ratio, cod_min_ratio, generator).to(dev)  # [N, K]
    ar = torch.arange(N, device=dev)
    nxt = (ar + 1).clamp(max=N - 1)
    has_token = (ar + 1 < N) & (batch.doc_ids[nxt] == batch.doc_ids)  # [N]
    present = kept.clone()
    present[:, 0] = has_token
    a, d = torch.nonzero(present, as_tuple=True)  # row-major: by anchor then depth
    seg_key = a + (d > 0).long()
    # Sort by (seg_key, depth, anchor): segments of Algorithm 1 become contiguous slices.
    order = torch.argsort(seg_key * (num_depths * (N + 1)) + d * (N + 1) + a)
    a, d, seg_key = a[order], d[order], seg_key[order]
    ids = torch.where(d == 0, batch.input_ids[nxt[a]], torch.full_like(a, mask_token_id))
    return Elements(
        anchor=a, depth=d, doc=batch.doc_ids[a], position=batch.position_ids[a] + d, input_ids=ids,
        target_index=(a + d + 1).clamp(max=N - 1), loss=kept[a, d], valid=torch.ones_like(a, dtype=torch.bool),
        seg_key=seg_key,
    )


def pad_elements(el: Elements, length: int) -> Elements:
    """Append filler slots (``valid=False``, no loss, depth 0 of anchor 0) up to ``length``."""
    n = length - el.num_elements
    if n <= 0:
        return el
    z = el.anchor.new_zeros(n)
    fill = Elements(anchor=z, depth=z, doc=z - 1, position=z, input_ids=z, target_index=z,
                    loss=z.bool(), valid=z.bool(), seg_key=z + int(el.seg_key.max()) if el.num_elements else z)
    return cat_elements([el, fill])


def cat_elements(parts: list[Elements]) -> Elements:
    """The slots of ``parts`` one after another (every field concatenated, ``[sum M_i]``)."""
    return Elements(**{f.name: torch.cat([getattr(p, f.name) for p in parts]) for f in fields(Elements)})


def forward_order(el: Elements, num_depths: int) -> torch.Tensor:
    """``[M]`` permutation sorting elements by ``(doc, depth, anchor)``, the order of a forward.

    The depth-0 keys of a document then form one contiguous causal run, and a depth-d query block
    needs only the depth-0 blocks left of it plus the few blocks of its own anchors at depths < d.
    In Algorithm 1's ``(seg_key, depth, anchor)`` order depth-0 keys are interleaved with deeper
    slots and most of every flex block-mask tile is masked-out work (tile density 0.131 -> 0.073 at
    N=8192, K=8; ``bench/step_breakdown.py``). Attention results do not depend on slot order.
    """
    span = int(el.anchor.max()) + 2 if el.num_elements else 1
    return torch.argsort((el.doc * (num_depths + 1) + el.depth) * span + el.anchor)


def element_hidden(drafter: Eagle3Drafter, batch: PackedBatch, el: Elements) -> torch.Tensor:
    """Hidden-state input ``[M, H]`` of the elements: ``combine_hidden_states(aux[a])`` at depth 0,
    ``mask_slot_hidden()`` (``fc(mask_hidden)``) at depths >= 1 (P-EAGLE Sec. 3)."""
    is0 = el.depth == 0
    h0 = drafter.combine_hidden_states(batch.aux[el.anchor[is0]])  # [M0, H]
    if bool(is0.all()):
        return h0
    mask_h = drafter.mask_slot_hidden().to(h0.dtype).expand(el.num_elements, h0.shape[-1])
    return mask_h.index_put((torch.nonzero(is0).flatten(),), h0)


__all__ = [
    "Elements",
    "build_peagle_elements",
    "cat_elements",
    "cod_sample",
    "element_hidden",
    "forward_order",
    "label_valid",
    "pad_elements",
]
