"""The objective interface every drafter-training objective implements, what they share, and the registry.

An objective turns one packed sequence (``peagle_core.batch.PackedBatch``) into drafter slots
(``peagle_core.elements.Elements``), runs the drafter over them and distills the target's
next-token distribution into the drafter's (``peagle_core.loss.linear_distill_loss``). The
trainer only talks to :class:`Objective`; the built-in ones are ``"peagle"``
(``peagle_core.objectives.peagle``) and ``"eagle3"`` (``peagle_core.objectives.eagle3``), registered
when the package ``peagle_core.objectives`` is imported.

Shape legend: N tokens of a packed sequence, M elements (drafter slots), K depths (P-EAGLE) or
TTT steps (EAGLE-3), H drafter hidden, Ht target hidden, V target vocab, Vd draft vocab.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch
from torch import nn

from peagle_core.batch import PackedBatch
from peagle_core.drafter import Eagle3Drafter
from peagle_core.elements import Elements
from peagle_core.loss import LossImpl, LossKind, linear_distill_loss
from peagle_core.masks import AttentionImpl, BlockMaskBuild

# Metric an objective reports for the drafter slots (anchor, depth) it ran forward in a step.
NUM_FORWARD_SLOTS_KEY = "num_forward_slots"


# --------------------------------------------------------------------------------------------
# Config, target head, metrics
# --------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class ObjectiveConfig:
    """Options shared by every objective.

    Args:
        loss: ``"kl"`` = KL(target || draft) over the draft vocabulary; ``"ce"`` = cross-entropy
            on the target's argmax (restricted to the draft vocabulary).
        attention: ``"auto"`` (flex on CUDA, dense on CPU), ``"dense"`` (SDPA with a bool mask;
            O(T^2) memory) or ``"flex"`` (``BlockMask``; forward-only on CPU in torch 2.13).
        block_mask: how a flex ``BlockMask`` is built (``peagle_core.masks.flex_element_mask``'s ``build``):
            ``"compiled"`` (``create_block_mask``, compiled on CUDA) or ``"blockwise"`` (no compilation).
        loss_impl: ``"auto"`` (Triton on CUDA, chunked torch elsewhere), ``"torch"`` (chunked),
            ``"triton"``, ``"plain"`` (materializes [M, Vd] logits; reference).
        loss_chunk_rows: rows per chunk of the vocabulary projection (memory ~ rows x Vd x 4 B x 3).
        seed: seed of the COD generator.
    """

    loss: LossKind = "kl"
    attention: AttentionImpl = "auto"
    block_mask: BlockMaskBuild = "compiled"
    loss_impl: LossImpl = "auto"
    loss_chunk_rows: int = 1024
    seed: int = 0

    def validate(self) -> None:
        """Check the option values.

        Raises:
            ValueError: naming the option and its allowed values.
        """
        if self.loss not in ("kl", "ce"):
            raise ValueError(f"loss={self.loss!r}: use 'kl' or 'ce'")
        if self.attention not in ("auto", "dense", "flex"):
            raise ValueError(f"attention={self.attention!r}: use 'auto', 'dense' or 'flex'")
        if self.block_mask not in ("compiled", "blockwise"):
            raise ValueError(f"block_mask={self.block_mask!r}: use 'compiled' or 'blockwise'")
        if self.loss_impl not in ("auto", "torch", "triton", "plain"):
            raise ValueError(f"loss_impl={self.loss_impl!r}: use 'auto', 'torch', 'triton' or 'plain'")
        if self.loss_chunk_rows < 1:
            raise ValueError(f"loss_chunk_rows={self.loss_chunk_rows} must be >= 1")


class TargetHead:
    """The target's ``lm_head`` restricted to the draft vocabulary, ``[Vd, Ht]``.

    The KL target is the target distribution restricted to the draft vocabulary and renormalized:
    ``softmax(final_hidden @ W[t2d].T)``. With a full draft vocabulary (``t2d`` all True) this is
    the exact target distribution; with a pruned one, target mass on ids outside the draft
    vocabulary is dropped (EAGLE-3 additionally drops positions whose target argmax is outside
    the draft vocabulary; peagle keeps them, so accuracy is measured against the restricted
    argmax). The restricted copy is cached per weight tensor.
    """

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._weight: torch.Tensor | None = None

    def __call__(self, target_lm_head: torch.Tensor, drafter: Eagle3Drafter) -> torch.Tensor:
        """``[Vd, Ht]`` rows of ``target_lm_head`` (``[V, Ht]``, or already ``[Vd, Ht]``) kept by ``t2d``.

        Raises:
            ValueError: ``target_lm_head`` is not ``[V, Ht]`` or ``[Vd, Ht]`` of the drafter's sizes.
        """
        V, Vd = drafter.config.vocab_size, drafter.config.draft_vocab_size
        W = target_lm_head.detach()
        if W.dim() != 2 or W.shape[1] != drafter.config.target_hidden_size:
            raise ValueError(f"target_lm_head has shape {tuple(W.shape)}, expected [V={V}, Ht={drafter.config.target_hidden_size}]")
        if W.shape[0] == V:
            t2d = drafter.t2d
            key = (W.data_ptr(), W._version, W.device, t2d.data_ptr(), t2d._version, int(t2d.sum()))
            if key != self._key:
                self._weight = W if Vd == V else W[t2d.to(W.device)]
                self._key = key
            return self._weight
        if W.shape[0] == Vd:
            return W  # already restricted to the draft vocabulary
        raise ValueError(f"target_lm_head has {W.shape[0]} rows; expected vocab_size={V} (restricted with t2d) "
                         f"or draft_vocab_size={Vd}")


class DepthStats:
    """Per-depth sums: loss, loss elements, correct argmax (simulated acceptance)."""

    def __init__(self, num_depths: int, device: torch.device) -> None:
        self.loss = torch.zeros(num_depths, dtype=torch.float64, device=device)
        self.count = torch.zeros(num_depths, dtype=torch.float64, device=device)
        self.correct = torch.zeros(num_depths, dtype=torch.float64, device=device)
        self.num_forward_slots = 0

    def add(self, depth: torch.Tensor, row_loss: torch.Tensor, correct: torch.Tensor) -> None:
        """Accumulate ``[m]`` rows: their depth (int64), loss (float) and correct argmax (bool)."""
        K = self.loss.shape[0]
        self.loss += torch.bincount(depth, weights=row_loss.double(), minlength=K)[:K]
        self.count += torch.bincount(depth, minlength=K)[:K].double()
        self.correct += torch.bincount(depth, weights=correct.double(), minlength=K)[:K]

    def metrics(self, loss: float, weights: Sequence[float] | None = None) -> dict[str, float]:
        """``loss`` (the optimized value), ``num_loss_elements``, ``num_forward_slots``, per depth d
        ``loss_d{d}`` (mean), ``acc_d{d}`` (argmax draft == argmax target), ``count_d{d}``, and
        ``sim_acceptance_length`` = 1 + sum_k prod_{j<=k} acc_j (assumes independent depths)."""
        loss_s, count, correct = self.loss.tolist(), self.count.tolist(), self.correct.tolist()
        out: dict[str, float] = {
            "loss": float(loss), "num_loss_elements": float(sum(count)),
            NUM_FORWARD_SLOTS_KEY: float(self.num_forward_slots),
        }
        al, run = 1.0, 1.0
        for d, (ls, c, k) in enumerate(zip(loss_s, count, correct)):
            acc = k / c if c else 0.0
            out[f"loss_d{d}"] = ls / c if c else 0.0
            out[f"acc_d{d}"] = acc
            out[f"count_d{d}"] = c
            run *= acc
            al += run
        out["sim_acceptance_length"] = al
        return out

# --------------------------------------------------------------------------------------------
# The objective interface
# --------------------------------------------------------------------------------------------


class Objective(ABC):
    """A training objective: builds the drafter slots of a packed batch, runs forward and backward.

    This is the whole interface a trainer needs (no other attribute is read):

    * ``method``, ``config_cls``, ``cfg``: registry name, config class, this instance's config;
    * ``num_depths``: K, the depths reported in the metrics (``loss_d{d}``, ``acc_d{d}``, ...);
    * ``check_drafter(drafter)``: refuse a head this objective cannot train;
    * ``build_elements(batch, drafter)``: the slots of one batch (draws from ``generator``);
    * ``loss_count(batch, elements)``: the count the summed loss is divided by by default (sum it
      over ranks for an exact global mean under DDP/FSDP);
    * ``forward_backward(...)``: forward and backward of one batch, returns float metrics;
    * ``compute_loss(...)``: the same loss without backward;
    * ``rng_state()`` / ``set_rng_state(state)``: the COD/sampling generator, checkpointed per rank.

    Subclasses register with ``@register_objective(name)``, set ``config_cls`` and implement the
    abstract methods. Metrics (``DepthStats.metrics``): ``loss``, ``num_loss_elements``,
    ``num_forward_slots`` (``NUM_FORWARD_SLOTS_KEY``), ``loss_d{d}``, ``acc_d{d}``, ``count_d{d}``
    for d < K, ``sim_acceptance_length``; all Python floats.
    """

    method: ClassVar[str] = ""
    config_cls: ClassVar[type[ObjectiveConfig]] = ObjectiveConfig

    def __init__(self, cfg: ObjectiveConfig) -> None:
        """Validate ``cfg`` and seed the CPU generator of the slot sampling with ``cfg.seed``.

        Raises:
            ValueError: an invalid option of ``cfg`` (named).
        """
        cfg.validate()
        self.cfg = cfg
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self._target_head = TargetHead()

    @property
    @abstractmethod
    def num_depths(self) -> int:
        """K: depths (P-EAGLE) or TTT steps (EAGLE-3) reported in the metrics."""

    def check_drafter(self, drafter: Eagle3Drafter) -> None:
        """Refuse a head this objective cannot train (default: accept every head).

        Args:
            drafter: the unwrapped head (``peagle_core.drafter.unwrap``).

        Raises:
            ValueError: the head lacks (or has) what the objective needs, with the fix.
        """

    @abstractmethod
    def build_elements(self, batch: PackedBatch, drafter: nn.Module) -> Elements:
        """The drafter slots of one packed batch (consumes ``generator`` for COD sampling).

        Args:
            batch: one packed sequence of N tokens on the drafter's device.
            drafter: the head, plain or wrapped (DDP, compile, ``ShardedDrafter``).

        Returns:
            ``Elements`` with ``[M]`` fields on ``batch.device``; pass them to ``forward_backward``
            / ``compute_loss`` as ``elements`` to train on exactly these slots.

        Raises:
            ValueError: ``check_drafter`` refuses the head, or ``batch`` does not fit it
                (``PackedBatch.validate``).
        """

    @abstractmethod
    def loss_count(self, batch: PackedBatch, elements: Elements) -> float:
        """The summed weight of the loss elements (their number where each weighs 1) that the summed
        loss is divided by when no ``loss_scale_denominator`` is given (>= 0; the objectives divide by
        at least 1).

        Under DDP/FSDP (gradients averaged over W ranks) sum it over ranks and pass
        ``loss_scale_denominator = max(global_sum, 1) / W`` for an exact global mean.

        Args:
            batch: the packed sequence ``elements`` were built from.
            elements: the result of ``build_elements(batch, ...)``.
        """

    @abstractmethod
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
        """Forward AND backward (gradients accumulate into ``.grad``); returns metrics.

        Args:
            drafter: the head (``Eagle3Drafter``, optionally DDP-wrapped, or FSDP2-sharded as a
                ``peagle_core.fsdp.ShardedDrafter``).
            batch: one packed sequence on the drafter's device.
            target_lm_head: ``[V, Ht]`` frozen target ``lm_head`` weight (or ``[Vd, Ht]`` already
                restricted to the draft vocabulary).
            loss_scale_denominator: divisor of the summed element losses; default =
                ``max(loss_count(batch, elements), 1)``. Under DDP (which averages gradients over
                W ranks) pass ``global_loss_count / W`` for an exact global mean.
            no_sync: callable returning a context manager (``ddp.no_sync``,
                ``ShardedDrafter.no_sync``) entered for every backward but the last, so DDP
                all-reduces (FSDP reduce-scatters) once per batch.
            elements: slots from ``build_elements`` (to count loss elements across ranks first);
                default: built here.

        Returns:
            Float metrics (see the class docstring); ``loss`` is the scaled loss sum optimized.

        Raises:
            ValueError: a bad head, batch, ``target_lm_head`` shape or ``loss_scale_denominator <= 0``.
        """

    @abstractmethod
    def compute_loss(
        self,
        drafter: nn.Module,
        batch: PackedBatch,
        *,
        target_lm_head: torch.Tensor,
        loss_scale_denominator: float | None = None,
        elements: Elements | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Single pass, no backward: ``(loss, metrics)``; ``loss`` is a scalar tensor
        (differentiable when grad is on) equal to what ``forward_backward`` would optimize.
        Arguments as ``forward_backward``."""

    def rng_state(self) -> torch.Tensor:
        """State of ``generator`` (uint8 tensor) to checkpoint: restoring it with
        ``set_rng_state`` makes the next ``build_elements`` draw the same slots."""
        return self.generator.get_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        """Restore ``generator`` from ``rng_state()``."""
        self.generator.set_state(state)

    # Shared helpers of the subclasses --------------------------------------------------------

    def _denominator(self, batch: PackedBatch, el: Elements, loss_scale_denominator: float | None) -> float:
        """The divisor of the summed losses: ``loss_scale_denominator`` or ``max(loss_count, 1)``.

        Raises:
            ValueError: ``loss_scale_denominator <= 0``.
        """
        if loss_scale_denominator is not None:
            denom = float(loss_scale_denominator)
        else:
            denom = float(max(self.loss_count(batch, el), 1))
        if denom <= 0:
            raise ValueError(f"loss_scale_denominator={loss_scale_denominator} must be > 0")
        return denom

    def _loss_rows(
        self, drafter: Eagle3Drafter, batch: PackedBatch, normed: torch.Tensor, el: Elements,
        W_t: torch.Tensor, row_scale: torch.Tensor, stats: DepthStats,
    ) -> torch.Tensor:
        """Loss of loss elements ``el`` (``normed [m, H]`` their drafter outputs, ``W_t [Vd, Ht]``,
        ``row_scale [m]``): the scaled sum (scalar); per-depth sums go into ``stats``."""
        out = linear_distill_loss(
            normed, drafter.lm_head.weight, batch.final_hidden[el.target_index], W_t,
            row_scale=row_scale, kind=self.cfg.loss, impl=self.cfg.loss_impl, chunk_rows=self.cfg.loss_chunk_rows,
        )
        stats.add(el.depth, out.row_loss, out.draft_argmax == out.target_argmax)
        return out.loss


# --------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------

_REGISTRY: dict[str, type[Objective]] = {}


def register_objective(name: str) -> Callable[[type[Objective]], type[Objective]]:
    """Class decorator: register an ``Objective`` subclass as ``name`` (sets ``cls.method``).

    Raises:
        ValueError: ``name`` is already taken by another class.
    """

    def deco(cls: type[Objective]) -> type[Objective]:
        other = _REGISTRY.get(name)
        if other is not None and other.__qualname__ != cls.__qualname__:
            raise ValueError(f"objective {name!r} is already registered by {other.__qualname__}")
        cls.method = name
        _REGISTRY[name] = cls
        return cls

    return deco


def available_objectives() -> list[str]:
    """Registered objective names, sorted (the built-ins: ``eagle3``, ``peagle``)."""
    return sorted(_REGISTRY)


def objective_class(method: str) -> type[Objective]:
    """The class registered as ``method`` (its ``config_cls`` lists the options).

    Raises:
        ValueError: unknown ``method`` (names the registered ones).
    """
    if method not in _REGISTRY:
        raise ValueError(f"method={method!r} is not a registered objective; use one of {sorted(_REGISTRY)}")
    return _REGISTRY[method]


def build_objective(method: str, **cfg: Any) -> Objective:
    """Build a registered objective: ``"peagle"`` (``PEagleObjective``) or ``"eagle3"``
    (``Eagle3TTTObjective``) from its config fields.

    Raises:
        ValueError: unknown ``method`` or unknown/invalid config field (named).
    """
    cls = objective_class(method)
    known = {f.name for f in fields(cls.config_cls)}
    unknown = sorted(set(cfg) - known)
    if unknown:
        raise ValueError(f"unknown {method} objective option(s) {unknown}; known: {sorted(known)}")
    return cls(cls.config_cls(**cfg))


__all__ = [
    "NUM_FORWARD_SLOTS_KEY",
    "DepthStats",
    "Objective",
    "ObjectiveConfig",
    "TargetHead",
    "available_objectives",
    "build_objective",
    "objective_class",
    "register_objective",
]
