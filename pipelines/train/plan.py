"""The training plan: everything decided on the driver before any worker starts, computed once.

A :class:`TrainPlan` holds the resolved target, the drafter architecture and the objective config
(both converted by the recipe sections: ``DrafterSpec.to_drafter_config``,
``TrainingConfig.objective_config``), the draft vocabulary (``d2t``/``t2d`` from assistant-token counts),
the epoch length that packing gives and the run's total steps. The pipeline builds it, reports its
sizes, and hands it whole to ``run_train``, which ships it to every worker.

Two sources, one builder each:

* :func:`plan_from_capture`: a materialized capture (manifest lengths, ``token_counts.safetensors``;
  its ``capture_meta.json`` is checked against the drafter first);
* :func:`plan_from_conversations`: streaming capture (nothing on disk): the conversations are
  tokenized once (no target forward) for lengths and counts; :func:`plan_from_tokenized` takes them tokenized
  by the caller (who keeps them for its own capture).

A warm start (``training.init_from``, :mod:`pipelines.train.warm_start`) is checked here against the
drafter, before any data is read, and gives the plan its ``d2t``/``t2d`` (no token counts needed).

Shape legend: V target vocab, Vd draft vocab.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

import torch

from peagle_core import shards
from peagle_core.drafter_config import DrafterConfig
from peagle_core.objectives import ObjectiveConfig
from peagle_core.samples import INPUT_IDS
from peagle_core.vocab import TOKEN_COUNTS_NAME, load_token_counts, vocab_mapping_from_counts
from pipelines.assets import resolve_target
from pipelines.capture import count_assistant_tokens, tokenize_rows
from pipelines.recipe import DrafterSpec, TargetConfig, TrainingConfig
from pipelines.registry.refs import HeadRef
from pipelines.train.data import estimate_steps_per_epoch
from pipelines.train.warm_start import InitHead, check_init_head, resolve_init_from

log = logging.getLogger(__name__)

PARALLEL_STRATEGIES = get_args(TrainingConfig.model_fields["parallel_strategy"].annotation)  # the recipe's Literal

__all__ = [
    "TrainPlan", "check_capture", "plan_from_capture", "plan_from_conversations", "plan_from_tokenized",
    "total_steps",
]


@dataclass(frozen=True, kw_only=True)
class TrainPlan:
    """A training run as decided on the driver (picklable: it crosses the Ray boundary whole).

    Args:
        training, drafter_spec: the recipe sections (``training``, ``drafter``).
        drafter: the drafter architecture for this target.
        objective: the objective config (``PEagleConfig`` or ``Eagle3TTTConfig``); each worker offsets its seed
            by its rank.
        target_dir: the target's HF safetensors directory (readable from every worker node).
        target_name, target_sha256: recorded in the exported head.
        d2t: ``[Vd]`` int64 draft->target offsets, t2d: ``[V]`` bool kept ids (None: full vocabulary).
        num_samples, num_tokens: samples and tokens of one epoch (all workers; None when not counted).
        steps_per_epoch: optimizer steps per worker per epoch, estimated from the sample lengths (None when
            not counted: then ``training.max_steps`` bounds the run).
        total_steps: optimizer steps of the run (cosine horizon and hard stop).
        init_head: the head ``training.init_from`` resolved to (local, checked against ``drafter``; its
            ``d2t``/``t2d`` are the plan's); every worker loads it over the target init. None: from scratch.
    """

    training: TrainingConfig
    drafter_spec: DrafterSpec
    drafter: DrafterConfig
    objective: ObjectiveConfig
    target_dir: Path
    target_name: str
    target_sha256: str | None = None
    d2t: torch.Tensor | None = None
    t2d: torch.Tensor | None = None
    num_samples: int | None = None
    num_tokens: int | None = None
    steps_per_epoch: int | None = None
    total_steps: int
    init_head: InitHead | None = None

    @property
    def fixed_steps_per_epoch(self) -> int | None:
        """The epoch length workers stop at: None with ``max_steps`` (epochs end when a shard runs out),
        else :attr:`steps_per_epoch`."""
        return None if self.training.max_steps else self.steps_per_epoch


def total_steps(training: TrainingConfig, steps_per_epoch: int | None = None, *,
                count_steps_per_epoch: Callable[[], int] | None = None) -> int:
    """Optimizer steps of a run: ``max_steps`` if set, else ``num_epochs * steps_per_epoch``
    (``count_steps_per_epoch()`` is called only when that is needed and ``steps_per_epoch`` is None).

    Raises:
        ValueError: neither ``max_steps`` nor ``num_epochs`` bounds the run.
    """
    if training.max_steps:
        return int(training.max_steps)
    num_epochs = int(training.num_epochs or 0)
    if num_epochs < 1:
        raise ValueError(f"max_steps={training.max_steps} and num_epochs={num_epochs}: set either to bound the run")
    if steps_per_epoch is None and count_steps_per_epoch is not None:
        steps_per_epoch = count_steps_per_epoch()
    return num_epochs * int(steps_per_epoch or 0)


def check_capture(capture_dir: str | Path, dcfg: DrafterConfig, target_sha256: str | None) -> list[int]:
    """Check a capture's meta against the drafter before any worker starts; return sample lengths.

    Raises:
        ValueError: aux layer ids, hidden size or vocab differ, or the capture was made from another
            target (sha256), naming both values.
    """
    meta = shards.load_capture_meta(capture_dir)
    checks = [("aux_layer_ids", list(meta.get("aux_layer_ids") or []), list(dcfg.aux_layer_ids)),
              ("hidden_size", meta.get("hidden_size"), dcfg.target_hidden_size),
              ("vocab_size", meta.get("vocab_size"), dcfg.vocab_size)]
    if target_sha256 and meta.get("target_sha256"):
        checks.append(("target_sha256", meta["target_sha256"], target_sha256))
    for name, got, want in checks:
        if got not in (None, []) and got != want:
            raise ValueError(f"capture {capture_dir} has {name}={got} but training expects {want}: re-capture "
                             "with this target/aux layer ids, or train with the capture's target settings")
    return [int(n) for n in shards.load_manifest(capture_dir).column("length").to_pylist()]


# ---------------------------------------------------------------------------------------------- builders


def plan_from_capture(training: TrainingConfig, drafter: DrafterSpec, target: TargetConfig,
                      capture_dir: str | Path, *, always_keep_token_ids: Iterable[int] = (),
                      init_head: InitHead | None = None) -> TrainPlan:
    """The plan of training on a materialized capture (``pipelines.capture.run_capture``).

    ``init_head``: ``training.init_from`` resolved and made local (``pipelines.train.warm_start``); None
    resolves a local ``init_from`` here (a registry one must be fetched first). Same in the other builders.

    Raises:
        ValueError: a bad configuration, a warm-start head that does not fit the drafter, or a capture
            that does not fit the drafter (:func:`check_capture`).
        ShardError: a pruned draft vocabulary and no readable ``token_counts.safetensors``.
    """
    sizes = _Sizing(training, drafter, target, init_head)
    lengths = check_capture(capture_dir, sizes.drafter, sizes.target_sha256)
    counts = load_token_counts(Path(capture_dir) / TOKEN_COUNTS_NAME) if sizes.needs_counts else None
    return sizes.plan(lengths, counts, always_keep_token_ids)


def plan_from_conversations(training: TrainingConfig, drafter: DrafterSpec, target: TargetConfig,
                            conversations: Iterable[dict[str, Any]], *, max_length_tokens: int | None,
                            on_too_long: str = "truncate", always_keep_token_ids: Iterable[int] = (),
                            init_head: InitHead | None = None) -> TrainPlan:
    """The plan of training on a streaming capture of ``conversations`` (rows ``{id, messages}``): they
    are tokenized as capture tokenizes them (chat template, ``max_length_tokens``, ``on_too_long``), with
    no target forward, for the epoch length and the assistant-token counts.

    Raises:
        ValueError: a bad configuration, or the target tokenizer has no chat template.
    """
    from transformers import AutoTokenizer

    sizes = _Sizing(training, drafter, target, init_head)
    tokenizer = AutoTokenizer.from_pretrained(str(sizes.target_dir))
    samples = tokenize_rows(tokenizer, conversations, max_length_tokens=max_length_tokens, on_too_long=on_too_long)
    return sizes.plan_tokenized(samples, always_keep_token_ids)


def plan_from_tokenized(training: TrainingConfig, drafter: DrafterSpec, target: TargetConfig,
                        samples: Sequence[dict[str, Any]], *, always_keep_token_ids: Iterable[int] = (),
                        init_head: InitHead | None = None) -> TrainPlan:
    """:func:`plan_from_conversations` for conversations the caller tokenized already
    (``pipelines.capture.tokenize_rows``: ``{sample_id, input_ids [N], loss_mask [N]}``), e.g. to keep them for an
    online capture that runs the target only on what it trains (``bench.harness.OnlineRun``).

    Raises:
        ValueError: a bad configuration (checked before the samples are counted).
    """
    return _Sizing(training, drafter, target, init_head).plan_tokenized(samples, always_keep_token_ids)


class _Sizing:
    """The part of a plan that needs no data: the target, the drafter and objective configs, the warm-start
    head, the checks (all before any data is read); :meth:`plan` adds the vocabulary and the step counts.

    Raises:
        ValueError: the recipe sections do not fit the target or each other, or the warm-start head does not
            fit the drafter (naming ``training.init_from`` and every field that differs).
    """

    def __init__(self, training: TrainingConfig, spec: DrafterSpec, target: TargetConfig,
                 init_head: InitHead | None = None) -> None:
        asset, hf_config = resolve_target(target)
        self.training, self.spec = training, spec
        self.drafter = spec.to_drafter_config(hf_config, method=training.method, target=target)
        self.objective = training.objective_config(spec.num_speculative_tokens)
        self.target_dir, self.target_name, self.target_sha256 = Path(asset.path), asset.name, asset.sha256
        if training.parallel_strategy not in PARALLEL_STRATEGIES:
            raise ValueError(f"parallel_strategy={training.parallel_strategy!r}: use 'ddp' (replicated head, the "
                             "default) or 'fsdp' (FSDP2-sharded head, for 8B+ targets with large vocabularies)")
        if training.parallel_strategy == "fsdp" and training.num_workers == 1:
            log.warning("parallel_strategy='fsdp' with training.num_workers=1: nothing to shard, training unsharded")
        self.init_head = self._warm_start(training, init_head)
        self.head_d2t = self.head_t2d = None
        if self.init_head is not None:
            self.head_d2t, self.head_t2d = check_init_head(self.init_head, self.drafter,
                                                           target_sha256=self.target_sha256)

    @staticmethod
    def _warm_start(training: TrainingConfig, init_head: InitHead | None) -> InitHead | None:
        """``init_head``, else ``training.init_from`` resolved (a local head; a registry one must be fetched).

        Raises:
            ValueError: ``init_head`` without (or for another) ``training.init_from``; a bad local head.
        """
        ref = training.init_from
        if init_head is not None and init_head.ref != ref:
            raise ValueError(f"init_head resolves {init_head.ref!r} but training.init_from={ref!r}")
        if ref is None or init_head is not None:
            return init_head
        if HeadRef.is_ref(ref):
            raise ValueError(f"training.init_from={ref!r} is a registry head: download it first "
                             "(pipelines.train.warm_start.resolve_init_from, fetch_init_head; the train stage does)")
        return resolve_init_from(ref)

    @property
    def pruned(self) -> bool:
        """A draft vocabulary smaller than the target's (d2t/t2d)."""
        return self.drafter.draft_vocab_size < self.drafter.vocab_size

    @property
    def needs_counts(self) -> bool:
        """A pruned vocabulary chosen from this run's token counts (a warm start takes the head's instead)."""
        return self.pruned and self.init_head is None

    def plan_tokenized(self, samples: Sequence[dict[str, Any]], always_keep: Iterable[int]) -> TrainPlan:
        """:meth:`plan` from tokenized rows: their lengths and (for a pruned vocabulary) assistant-token counts."""
        counts = count_assistant_tokens(samples, self.drafter.vocab_size) if self.needs_counts else None
        return self.plan([len(s[INPUT_IDS]) for s in samples], counts, always_keep)

    def plan(self, lengths: Sequence[int], counts: torch.Tensor | None, always_keep: Iterable[int]) -> TrainPlan:
        """Raises:
            ValueError: the run has no step (empty data), or a pruned vocabulary without counts."""
        d2t, t2d = self.head_d2t, self.head_t2d
        if self.needs_counts:
            if counts is None:
                raise ValueError(f"draft_vocab_size={self.drafter.draft_vocab_size} < vocab_size="
                                 f"{self.drafter.vocab_size} needs token counts (the capture's token_counts.safetensors)")
            d2t, t2d = vocab_mapping_from_counts(counts, self.drafter.draft_vocab_size, always_keep=tuple(always_keep))
        t = self.training
        steps_per_epoch = estimate_steps_per_epoch(lengths, t.batch_tokens, t.num_workers) if lengths else None
        steps = total_steps(t, steps_per_epoch)
        if steps < 1:
            raise ValueError("the run has 0 steps: the dataset is empty or smaller than one batch per worker")
        return TrainPlan(training=t, drafter_spec=self.spec, drafter=self.drafter, objective=self.objective,
                         target_dir=self.target_dir, target_name=self.target_name, target_sha256=self.target_sha256,
                         d2t=d2t, t2d=t2d, num_samples=len(lengths) if lengths else None,
                         num_tokens=sum(lengths) if lengths else None, steps_per_epoch=steps_per_epoch,
                         total_steps=steps, init_head=self.init_head)
