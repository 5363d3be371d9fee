"""P-EAGLE: all K depths of every anchor trained in one forward, registered as objective ``"peagle"``.

Source: P-EAGLE (arXiv 2602.01469, Sec. 3-4: parallel groups, COD sampling after PARD arXiv
2504.18583, the training attention mask, Algorithm 1 sequence partition). The slots are built by
``peagle_core.elements.build_peagle_elements``, attend by ``peagle_core.masks`` and are split
into segments by ``peagle_core.partition``.

Per segment of Algorithm 1 (one segment when ``num_partitions == 1``): one forward over the
segment's context (depth-0 keys left of it) and own slots, in ``forward_order`` (by document,
depth, anchor), and one backward of its loss elements' scaled loss sum. The loss is KL (or CE)
averaged over all COD-kept loss elements of the batch with uniform weight (the paper's and the public
ports'), or with weight ``depth_decay ** d`` per element of depth d (a weighted mean; an ablation of
how much of the loss depth 0 carries, issue 26).

Shape legend: N tokens of a packed sequence, M elements, T slots in one forward, K depths,
H drafter hidden, Ht target hidden, Vd draft vocab.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from peagle_core.batch import PackedBatch
from peagle_core.drafter import Eagle3Drafter, unwrap
from peagle_core.elements import Elements, build_peagle_elements, element_hidden, forward_order, pad_elements
from peagle_core.fsdp import run_in_forward
from peagle_core.masks import FLEX_BLOCK, element_mask, resolve_attention
from peagle_core.objectives.base import DepthStats, Objective, ObjectiveConfig, register_objective
from peagle_core.partition import partition_elements


def forward_slots(el: Elements, num_depths: int, *, flex: bool) -> tuple[Elements, torch.Tensor]:
    """The slots of one forward as it runs them: sorted by (doc, depth, anchor) (``forward_order``: a sparse
    block mask) and, for flex attention, padded with filler slots to whole ``FLEX_BLOCK`` blocks (fewer distinct
    shapes for the compiled kernels).

    Returns:
        ``(slots [T'], order [T])``: the slots (``T' >= T`` with fillers last) and the permutation of ``el``.
    """
    order = forward_order(el, num_depths)
    el = el.index(order)
    if flex:
        el = pad_elements(el, -(-el.num_elements // FLEX_BLOCK) * FLEX_BLOCK)
    return el, order


@dataclass(kw_only=True)
class PEagleConfig(ObjectiveConfig):
    """P-EAGLE objective options (arXiv 2602.01469).

    Args:
        num_depths: K, parallel depths trained (depth 0 = next-token prediction).
        cod_ratio: r, COD keep ratio per depth (depth d keeps max(r^d, r_min) of depth 0).
        cod_min_ratio: r_min.
        num_partitions: S, segments of Algorithm 1 (1 = one forward+backward).
        depth_decay: gamma in (0, 1]: a loss element of depth d weighs ``gamma ** d`` and the loss is
            the weighted mean (1.0 = uniform, P-EAGLE Sec. 4).
    """

    num_depths: int = 8
    cod_ratio: float = 0.8
    cod_min_ratio: float = 0.2
    num_partitions: int = 1
    depth_decay: float = 1.0

    def validate(self) -> None:
        """Raises ``ValueError`` naming an out-of-range option."""
        super().validate()
        if self.num_depths < 1:
            raise ValueError(f"num_depths={self.num_depths} must be >= 1")
        if not 0.0 < self.cod_ratio <= 1.0:
            raise ValueError(f"cod_ratio={self.cod_ratio} must be in (0, 1]")
        if not 0.0 <= self.cod_min_ratio <= 1.0:
            raise ValueError(f"cod_min_ratio={self.cod_min_ratio} must be in [0, 1]")
        if self.num_partitions < 1:
            raise ValueError(f"num_partitions={self.num_partitions} must be >= 1")
        if not 0.0 < self.depth_decay <= 1.0:
            raise ValueError(f"depth_decay={self.depth_decay} must be in (0, 1]")


@register_objective("peagle")
class PEagleObjective(Objective):
    """P-EAGLE: all K depths of every anchor in one forward (per segment), KL/CE averaged over
    the COD-kept loss elements with uniform weight (P-EAGLE Sec. 4; public ports) or weight
    ``depth_decay ** d`` at depth d."""

    config_cls = PEagleConfig
    cfg: PEagleConfig

    @property
    def num_depths(self) -> int:
        """K, the parallel depths trained."""
        return self.cfg.num_depths

    def depth_weights(self, depth: torch.Tensor) -> torch.Tensor:
        """``[m]`` float32 loss weight ``depth_decay ** d`` of elements of depth ``depth [m]`` (int64)."""
        return torch.full(depth.shape, self.cfg.depth_decay, dtype=torch.float32, device=depth.device) ** depth

    def check_drafter(self, drafter: Eagle3Drafter) -> None:
        """Raises ``ValueError`` for a head without ``mask_token_id`` / ``mask_hidden``."""
        if not drafter.parallel_drafting or drafter.config.mask_token_id is None:
            raise ValueError("the P-EAGLE objective needs a head with mask_token_id and mask_hidden "
                             "(DrafterConfig(mask_token_id=...)); use method='eagle3' for an EAGLE-3 head")

    def build_elements(self, batch: PackedBatch, drafter: nn.Module) -> Elements:
        """P-EAGLE parallel groups, COD-sampled, sorted by segment key (``build_peagle_elements``)."""
        d = unwrap(drafter)
        self.check_drafter(d)
        batch.validate(aux_width=d.config.fc_input_size, target_hidden_size=d.config.target_hidden_size)
        return build_peagle_elements(batch, self.cfg.num_depths, d.config.mask_token_id,
                                     cod_ratio=self.cfg.cod_ratio, cod_min_ratio=self.cfg.cod_min_ratio,
                                     generator=self.generator)

    def _segment(
        self, drafter: nn.Module, batch: PackedBatch, el: Elements, W_t: torch.Tensor, denom: float,
        stats: DepthStats, num_context: int = 0,
    ) -> torch.Tensor:
        """One forward over elements ``el`` = ``num_context`` keys-only context slots, then the
        segment's own slots; returns the scaled loss sum of the own loss elements (a zero that
        still reaches every parameter when there is none)."""
        d = unwrap(drafter)
        attention = resolve_attention(self.cfg.attention, el.anchor.device)
        own = torch.arange(el.num_elements, device=el.anchor.device) >= num_context  # [T]
        el, order = forward_slots(el, self.num_depths, flex=attention == "flex")
        own = own[order]
        if el.num_elements > own.numel():  # filler slots own no loss
            own = torch.cat([own, own.new_zeros(el.num_elements - own.numel())])
        T = el.num_elements
        hidden = element_hidden(d, batch, el)  # [T, H]
        mask = element_mask(el, attention=attention, block_mask=self.cfg.block_mask)
        normed, _ = drafter(el.input_ids[None], hidden[None], el.position[None], attn_mask=mask)
        stats.num_forward_slots += T
        rows = torch.nonzero(el.loss & own).flatten()
        if rows.numel() == 0:
            return (normed.sum() + d.lm_head.weight.sum()) * 0.0
        sub = el.index(rows)
        scale = self.depth_weights(sub.depth) / denom
        return self._loss_rows(d, batch, normed[0, rows], sub, W_t, scale, stats)

    def loss_count(self, batch: PackedBatch, elements: Elements) -> float:
        """The summed weight of the COD-kept loss elements of the batch (their number when
        ``depth_decay`` is 1)."""
        if self.cfg.depth_decay == 1.0:
            return float(elements.num_loss_elements)
        return float(self.depth_weights(elements.depth[elements.loss]).double().sum())

    def _prepare(
        self, drafter: nn.Module, batch: PackedBatch, target_lm_head: torch.Tensor,
        loss_scale_denominator: float | None, elements: Elements | None,
    ) -> tuple[Eagle3Drafter, Elements, torch.Tensor, float]:
        """``(unwrapped head, elements, W_t [Vd, Ht], loss divisor)`` of one batch."""
        d = unwrap(drafter)
        el = self.build_elements(batch, drafter) if elements is None else elements
        W_t = self._target_head(target_lm_head, d)
        return d, el, W_t, self._denominator(batch, el, loss_scale_denominator)

    def forward_backward(
        self,
        drafter: nn.Module,
        batch: PackedBatch,
        *,
        target_lm_head: torch.Tensor,
        loss_scale_denominator: float | None = None,
        no_sync: Callable[[], contextlib.AbstractContextManager] | None = None,
        elements: Elements | None = None,
    ) -> dict[str, float]:
        """One forward+backward per segment of Algorithm 1 (see ``Objective.forward_backward``)."""
        _, el, W_t, denom = self._prepare(drafter, batch, target_lm_head, loss_scale_denominator, elements)
        segments = partition_elements(el, self.cfg.num_partitions, num_anchors=batch.num_tokens)
        # Segments without loss elements contribute no gradient: skip them. The last one that runs
        # does its backward outside no_sync (DDP all-reduce); if none has a loss, run the first
        # with a zero loss so every rank still calls backward once.
        todo = [s for s in segments if bool(el.loss[s.own].any())] or segments[:1]
        stats = DepthStats(self.num_depths, el.anchor.device)
        total = 0.0
        for i, seg in enumerate(todo):
            last = i == len(todo) - 1
            ctx = no_sync() if (no_sync is not None and not last) else contextlib.nullcontext()
            with ctx:
                loss = run_in_forward(drafter, self._segment, batch, el.index(seg.indices), W_t, denom,
                                      stats, num_context=int(seg.context.numel()))
                loss.backward()
            total += float(loss.detach())
        return stats.metrics(total)

    def compute_loss(
        self,
        drafter: nn.Module,
        batch: PackedBatch,
        *,
        target_lm_head: torch.Tensor,
        loss_scale_denominator: float | None = None,
        elements: Elements | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """All slots in one forward, no partition, no backward (see ``Objective.compute_loss``)."""
        _, el, W_t, denom = self._prepare(drafter, batch, target_lm_head, loss_scale_denominator, elements)
        stats = DepthStats(self.num_depths, el.anchor.device)
        loss = run_in_forward(drafter, self._segment, batch, el, W_t, denom, stats)
        return loss, stats.metrics(float(loss.detach()))


__all__ = ["PEagleConfig", "PEagleObjective", "forward_slots"]
