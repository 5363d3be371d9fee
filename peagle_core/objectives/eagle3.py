"""EAGLE-3 baseline: training-time test (TTT), registered as objective ``"eagle3"``.

Source: EAGLE-3 (arXiv 2503.01840, Sec. 3.2 "training-time test"; SafeAILab/EAGLE
``eagle/traineagle3/cnets.py``), with vLLM's sequential drafting as the inference it simulates
(``vllm/v1/spec_decode/llm_base_proposer.py``; ``Eagle3Drafter.draft_sequential`` here).

T steps (default 7). Step i processes one slot per anchor ``a`` of the packed sequence; slot
``(a, i)``:

* token ``x[a+1+i]`` (ground truth, shifted i to the left, as EAGLE-3 trains);
* hidden state: step 0 ``combine_hidden_states(aux[a])``; step i > 0 the drafter's own
  ``prenorm`` output of slot ``(a, i-1)`` (what vLLM feeds back when drafting sequentially);
* RoPE position ``position_ids[a] + i`` (the position vLLM gives the i-th sequential draft);
* it predicts ``x[a+i+2]`` against ``softmax(target_lm_head(final_hidden[a+i+1]))`` restricted
  to the draft vocabulary, and is a loss element iff that label is an assistant token in a's
  document (same rule as P-EAGLE, ``peagle_core.elements.label_valid``).

Attention: keys of all earlier steps stay in a KV cache (gradients flow through them); query
``(a, i)`` sees ``(a', 0)`` for ``a' <= a`` and ``(a, j)`` for ``j <= i`` in the same document —
the same rule as P-EAGLE's mask, so EAGLE-3's "diagonal" attention over earlier steps is
the element mask of ``peagle_core.masks`` with depth = step (plus each query's own key).

Loss: ``sum_i 0.8^i * (sum of step-i element losses) / n`` with ``n`` = the number of step-0 loss
elements (or ``loss_scale_denominator``). EAGLE-3 divides each step by its own count instead;
the two differ only by the few slots per document whose label runs past the document end.

Shape legend: N tokens, T steps, H drafter hidden, Ht target hidden, Vd draft vocab.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from peagle_core.batch import PackedBatch
from peagle_core.drafter import Eagle3Drafter, unwrap
from peagle_core.drafter_cache import DrafterCache
from peagle_core.elements import Elements, cat_elements, label_valid, pad_elements
from peagle_core.fsdp import run_in_forward
from peagle_core.masks import (
    FLEX_BLOCK,
    BlockMaskBuild,
    dense_element_mask,
    flex_element_mask,
    query_block_slice,
    resolve_attention,
)
from peagle_core.objectives.base import DepthStats, Objective, ObjectiveConfig, register_objective


def build_ttt_elements(batch: PackedBatch, num_steps: int) -> Elements:
    """Slots of all T steps, step-major (``[T * N]`` fields; step i = rows ``i*N:(i+1)*N``).

    ``valid`` is False where the token ``x[a+1+i]`` lies outside a's document (filler slots).

    Raises:
        ValueError: ``num_steps < 1``.
    """
    if num_steps < 1:
        raise ValueError(f"num_steps={num_steps} must be >= 1")
    N, dev = batch.num_tokens, batch.device
    loss = label_valid(batch, num_steps).T.reshape(-1)  # [T*N], step-major
    a = torch.arange(N, device=dev).repeat(num_steps)
    i = torch.arange(num_steps, device=dev).repeat_interleave(N)
    tok = a + 1 + i
    tok_c = tok.clamp(max=N - 1)
    valid = (tok < N) & (batch.doc_ids[tok_c] == batch.doc_ids[a])
    return Elements(
        anchor=a, depth=i, doc=batch.doc_ids[a], position=batch.position_ids[a] + i,
        input_ids=batch.input_ids[tok_c], target_index=(a + i + 1).clamp(max=N - 1), loss=loss & valid,
        valid=valid, seg_key=a,
    )


def ttt_step_mask(q: Elements, k: Elements) -> torch.Tensor:
    """Dense mask of step-i queries ``q`` ([N] slots) over the keys of steps 0..i ``k`` ([(i+1) N]):
    bool ``[1, 1, N, (i+1) N]``. Each query also sees its own key (the last block's diagonal), so
    filler slots never get an empty softmax row. The flex masks of all steps come from
    ``ttt_flex_step_masks``.
    """
    return dense_element_mask(q, k, diagonal=k.num_elements - q.num_elements)


def ttt_flex_step_masks(steps: list[Elements], *, build: BlockMaskBuild = "compiled") -> list:
    """Flex ``BlockMask`` of each step from ONE ``create_block_mask`` over the slots of all T steps.

    Args:
        steps: T step slot sets of equal length ``Np``, a multiple of ``FLEX_BLOCK`` (filler slots
            from ``pad_elements`` where the batch's N is shorter).
        build: how the one mask is built (``flex_element_mask``'s ``build``).

    Returns:
        T masks; mask i: queries ``steps[i]`` ``[Np]`` over the keys of steps 0..i ``[(i+1) Np]``,
        the pattern of ``ttt_step_mask`` (each query also sees its own key).

    One mask over all ``T * Np`` slots is a self-attention mask (``flex_element_mask(q)``, the call
    P-EAGLE's objective makes): a step-i query never attends a later step's key, so step i's mask is
    its rows cut to the first ``(i+1) Np`` keys (``query_block_slice``). Building one mask per step
    with its own key count instead compiled ``create_block_mask`` for new shapes in every step and
    stalled the first EAGLE-3 step on an H100 for minutes (``bench.warmup_compile``).

    Raises:
        ValueError: steps of unequal or unaligned length.
    """
    Np = steps[0].num_elements
    if Np % FLEX_BLOCK or any(s.num_elements != Np for s in steps):
        raise ValueError(f"steps have {[s.num_elements for s in steps]} slots; need equal multiples of {FLEX_BLOCK}")
    whole = flex_element_mask(cat_elements(steps), build=build)
    return [query_block_slice(whole, i * Np, Np, (i + 1) * Np) for i in range(len(steps))]


def ttt_forward(
    drafter: nn.Module, batch: PackedBatch, el: Elements, num_steps: int, *, attention: str = "auto",
    block_mask: BlockMaskBuild = "compiled",
) -> Iterator[tuple[int, Elements, torch.Tensor]]:
    """Run the T steps; yields ``(step i, its slots [N], normed drafter outputs [N, H])``.

    Keys of earlier steps stay in a ``DrafterCache`` with gradients; step i > 0 takes the
    ``prenorm`` output of step i-1 as its hidden state. With flex attention every step runs on
    ``Np`` slots (N rounded up to ``FLEX_BLOCK`` with filler slots) so that the step masks are cut
    from one block mask (``ttt_flex_step_masks``, built as ``block_mask`` says); the fillers' outputs are
    dropped.
    """
    d = unwrap(drafter)
    N = batch.num_tokens
    impl = resolve_attention(attention, batch.device)
    Np = -(-N // FLEX_BLOCK) * FLEX_BLOCK if impl == "flex" else N
    steps = [el.index(slice(i * N, (i + 1) * N)) for i in range(num_steps)]
    padded = [pad_elements(s, Np) for s in steps]
    masks = ttt_flex_step_masks(padded, build=block_mask) if impl == "flex" else None
    cache = DrafterCache(d.config.num_hidden_layers)
    hidden = d.combine_hidden_states(batch.aux)  # [N, H] step-0 hidden states
    hidden = torch.cat([hidden, hidden.new_zeros(Np - N, hidden.shape[-1])]) if Np > N else hidden  # [Np, H]
    for i, (q, qp) in enumerate(zip(steps, padded, strict=True)):
        mask = masks[i] if masks is not None else ttt_step_mask(q, el.index(slice(0, (i + 1) * N)))
        normed, prenorm = drafter(qp.input_ids[None], hidden[None], qp.position[None], attn_mask=mask,
                                  cache=cache, query_valid=qp.valid[None])
        yield i, q, normed[0, :N]
        hidden = prenorm[0]  # [Np, H], fed to step i+1 at the same anchor


@dataclass(kw_only=True)
class Eagle3TTTConfig(ObjectiveConfig):
    """EAGLE-3 TTT options.

    Args:
        num_steps: T, training-time-test steps (EAGLE-3 default 7).
        step_weight: step i is weighted ``step_weight ** i`` (EAGLE-3: 0.8).
    """

    num_steps: int = 7
    step_weight: float = 0.8

    def validate(self) -> None:
        """Raises ``ValueError`` naming an out-of-range option."""
        super().validate()
        if self.num_steps < 1:
            raise ValueError(f"num_steps={self.num_steps} must be >= 1")
        if not self.step_weight > 0:
            raise ValueError(f"step_weight={self.step_weight} must be > 0")


@register_objective("eagle3")
class Eagle3TTTObjective(Objective):
    """EAGLE-3 training-time test; trains a head without ``mask_hidden`` (``mask_token_id=None``),
    exported by ``peagle_core.contract`` in the same vLLM format as P-EAGLE heads."""

    config_cls = Eagle3TTTConfig
    cfg: Eagle3TTTConfig

    @property
    def num_depths(self) -> int:
        """T, the TTT steps (reported as depths in the metrics)."""
        return self.cfg.num_steps

    @property
    def step_weights(self) -> list[float]:
        """``[step_weight ** i for i < T]``."""
        return [self.cfg.step_weight**i for i in range(self.cfg.num_steps)]

    def check_drafter(self, drafter: Eagle3Drafter) -> None:
        """Raises ``ValueError`` for a P-EAGLE head (one with ``mask_hidden``)."""
        if drafter.parallel_drafting:
            raise ValueError("the eagle3 objective trains an EAGLE-3 head: build it with mask_token_id=None "
                             "(mask_hidden would get no gradient and break DDP)")

    def build_elements(self, batch: PackedBatch, drafter: nn.Module) -> Elements:
        """All T steps' slots, step-major (``build_ttt_elements``); no random draw."""
        d = unwrap(drafter)
        self.check_drafter(d)
        batch.validate(aux_width=d.config.fc_input_size, target_hidden_size=d.config.target_hidden_size)
        return build_ttt_elements(batch, self.cfg.num_steps)

    def loss_count(self, batch: PackedBatch, elements: Elements) -> int:
        """The loss elements of TTT step 0 (rows ``0..N-1``); step i weighs ``step_weight ** i``."""
        return int(elements.loss[: batch.num_tokens].sum())

    def _loss(
        self, drafter: nn.Module, batch: PackedBatch, target_lm_head: torch.Tensor,
        loss_scale_denominator: float | None, elements: Elements | None,
    ) -> tuple[torch.Tensor, DepthStats]:
        """``(weighted loss sum (scalar), per-step stats)`` of the T steps.

        Raises:
            ValueError: ``elements`` without ``num_steps * N`` slots, ``loss_scale_denominator <= 0``.
        """
        d = unwrap(drafter)
        el = self.build_elements(batch, drafter) if elements is None else elements
        W_t = self._target_head(target_lm_head, d)
        N, T = batch.num_tokens, self.cfg.num_steps
        if el.num_elements != N * T:
            raise ValueError(f"elements has {el.num_elements} slots; expected num_steps*N = {T}*{N}")
        denom = self._denominator(batch, el, loss_scale_denominator)
        stats = DepthStats(T, batch.device)
        # inside the FSDP root's forward when sharded (peagle_core.fsdp): fc, lm_head are gathered
        return run_in_forward(drafter, self._forward_loss, batch, el, W_t, denom, stats), stats

    def _forward_loss(
        self, drafter: nn.Module, batch: PackedBatch, el: Elements, W_t: torch.Tensor, denom: float,
        stats: DepthStats,
    ) -> torch.Tensor:
        """The T steps and the weighted loss sum (scalar); ``drafter`` is plain or DDP-wrapped."""
        d = unwrap(drafter)
        N, T = batch.num_tokens, self.cfg.num_steps
        total = d.lm_head.weight.sum() * 0.0  # reaches lm_head even without loss elements
        for i, q, normed in ttt_forward(drafter, batch, el, T, attention=self.cfg.attention,
                                               block_mask=self.cfg.block_mask):
            stats.num_forward_slots += N
            rows = torch.nonzero(q.loss).flatten()
            if rows.numel():
                scale = torch.full((rows.numel(),), self.step_weights[i] / denom, device=normed.device,
                                   dtype=torch.float32)
                total = total + self._loss_rows(d, batch, normed[rows], q.index(rows), W_t, scale, stats)
        return total

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
        """One backward through all T steps (a single DDP all-reduce; ``no_sync`` is not needed)."""
        loss, stats = self._loss(drafter, batch, target_lm_head, loss_scale_denominator, elements)
        loss.backward()
        return stats.metrics(float(loss.detach()))

    def compute_loss(
        self,
        drafter: nn.Module,
        batch: PackedBatch,
        *,
        target_lm_head: torch.Tensor,
        loss_scale_denominator: float | None = None,
        elements: Elements | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The weighted T-step loss, no backward (see ``Objective.compute_loss``)."""
        loss, stats = self._loss(drafter, batch, target_lm_head, loss_scale_denominator, elements)
        return loss, stats.metrics(float(loss.detach()))


__all__ = [
    "Eagle3TTTConfig",
    "Eagle3TTTObjective",
    "build_ttt_elements",
    "ttt_flex_step_masks",
    "ttt_forward",
    "ttt_step_mask",
]
