"""Training stage: fit a P-EAGLE (or EAGLE-3 TTT) drafter on captured target hidden states.

Two layers, as in Ray Train's ``train_func_per_worker`` idiom:

* a plain, Ray-free core — :class:`Trainer` / :func:`run_training` — over an iterable of captured
  samples: packing into ``PackedBatch`` es of ``batch_tokens``, AdamW (betas from the recipe) with
  linear warmup + cosine decay, bf16 autocast on CUDA (float32 on CPU), gradient clipping, metrics
  (loss and accuracy per depth, positions/s, tokens/s), checkpoints every N steps (model,
  optimizer, scheduler, data position = epoch + samples consumed, RNG) and resume. It runs on a
  GPU box without Ray (``import ray`` happens only inside the Ray functions below);
* the Ray Train V2 wrapper — :func:`train_loop_per_worker` and :func:`run_train` — which feeds
  the core from ``ray.train.get_dataset_shard("train")``, wraps the drafter with
  ``ray.train.torch.prepare_model`` (DDP; gloo on CPU, NCCL on GPU) or shards it with FSDP2
  (``peagle_core.fsdp``; see "FSDP" below), turns
  checkpoints into ``ray.train.report(..., checkpoint=Checkpoint.from_directory(d))`` and resumes
  from ``ray.train.get_checkpoint()`` when re-run with the same ``RunConfig(name, storage_path)``.
  Metrics go to MLflow from rank 0 (Train V2 has no ``MLflowLoggerCallback``). The driver exports
  the final head through ``peagle_core.contract.export_head`` into ``<out_dir>/head``.

Sample format (one row of the capture stage, ``pipelines/capture.py``): ``input_ids [N]`` int,
``loss_mask [N]`` (1 on assistant tokens), ``aux [N, 3*Ht]`` (target aux hidden states at vLLM's
layer ids), ``final_hidden [N, Ht]`` (after the target's final norm; ``lm_head(final_hidden)`` are
the target logits the loss distils).

Equal step counts across workers: ``ray.train.report`` is a barrier and DDP all-reduces every
step, so before each step the workers agree (one tiny all-reduce, MIN) whether *all* of them still
have a batch; the epoch ends for everyone when any shard runs out (the tail of the longest shards
is dropped, at most one batch per worker per epoch on balanced shards). ``steps_per_epoch`` can
also be fixed up front.

FSDP: ``training.parallel_strategy: fsdp`` shards the drafter with FSDP2 (``fully_shard``, one unit
per decoder layer plus the root; ``peagle_core.fsdp.shard_drafter``) instead of replicating it with
DDP; gloo on CPU, NCCL on GPU. Ray's ``prepare_model(parallel_strategy="fsdp")`` is FSDP1 and
GPU-only, so the worker moves the drafter with ``prepare_model(parallel_strategy=None)`` and shards
it itself. The objectives run their whole forward-to-loss inside the sharded root's forward
(``peagle_core.fsdp.run_in_forward``: ``fc``, ``mask_hidden`` and ``lm_head`` are used outside
``Eagle3Drafter.forward``), and the sequence partition defers the gradient reduce-scatter to the last
segment (``ShardedDrafter.no_sync``); gradients equal DDP's. Checkpoints hold the full model
(same ``model.safetensors`` as DDP, so the export is unchanged) and the full optimizer state keyed by
parameter name (``torch.distributed.checkpoint.state_dict``); a checkpoint resumes only under the
strategy that wrote it. When to use it: DDP is the default, a drafter is small (one layer plus
embeddings and a draft-vocabulary ``lm_head``); FSDP divides parameter, gradient and AdamW memory by
the number of workers, for 8B+ targets with large vocabularies (Llama-3.1-8B, V=128k, H=4096: a
1-layer head is ~0.8 B parameters, ~13 GB with float32 AdamW state per DDP worker). Activation memory
is cut by sequence partitioning (``num_partitions``) under either strategy.

Shape legend: N tokens of a packed batch, V target vocab, Vd draft vocab, Ht target hidden,
H drafter hidden, K parallel depths.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import shutil
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from peagle_core import fsdp
from peagle_core.drafter import DrafterConfig, Eagle3Drafter
from peagle_core.vocab import vocab_mapping_from_counts

log = logging.getLogger(__name__)

# Checkpoint directory layout (one directory per checkpoint; under Ray, the per-worker
# directories are merged into one by ``ray.train.report``).
MODEL_FILE = "model.safetensors"  # rank 0: drafter state dict (incl. d2t/t2d buffers)
OPTIMIZER_FILE = "optimizer.pt"  # rank 0: AdamW state dict (torch.load(weights_only=True))
SCHEDULER_FILE = "scheduler.pt"  # rank 0: LR scheduler state dict
STATE_FILE = "trainer_state.json"  # rank 0: step, world size, mlflow run id, config
RANK_FILE = "rank_{rank:04d}.pt"  # every rank: data position + RNG states
# objective metric counting the drafter slots (anchor, depth) run forward in a step: "positions"
POSITIONS_KEY = "num_forward_slots"

Sample = Mapping[str, Any]


# ----------------------------------------------------------------------------------------------
# config access (TrainingConfig from pipelines/recipe.py, or any object / dict with its fields)


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def _as_dict(cfg: Any) -> dict:
    if cfg is None:
        return {}
    if isinstance(cfg, Mapping):
        return dict(cfg)
    if hasattr(cfg, "model_dump"):
        return cfg.model_dump(mode="json")
    if hasattr(cfg, "to_dict"):
        return cfg.to_dict()
    return dict(vars(cfg))


# ----------------------------------------------------------------------------------------------
# target weights (safetensors only; never from_pretrained: the target body is not needed here)


def _safetensors_files(target_dir: Path) -> list[Path]:
    files = sorted(target_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"target directory {target_dir} holds no *.safetensors file; point target_dir at an HF "
            "safetensors model directory (pipelines.assets.ensure_target builds one)"
        )
    return files


def load_target_tensor(target_dir: str | os.PathLike, names: Iterable[str]) -> tuple[str, torch.Tensor]:
    """First tensor among ``names`` found in the target's safetensors files (sharded or not).

    Returns:
        ``(name, tensor)`` as stored (dtype unchanged).

    Raises:
        ValueError: none of ``names`` is present (lists the names tried).
    """
    target_dir = Path(target_dir)
    names = list(names)
    files = _safetensors_files(target_dir)
    index = target_dir / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text()).get("weight_map", {}) if index.is_file() else {}
    for name in names:
        candidates = [target_dir / weight_map[name]] if name in weight_map else files
        for path in candidates:
            with safe_open(str(path), framework="pt") as f:
                if name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                    return name, f.get_tensor(name)
    raise ValueError(f"target {target_dir}: none of the tensors {names} found in {[p.name for p in files]}")


def load_target_lm_head(target_dir: str | os.PathLike) -> torch.Tensor:
    """The target's output projection ``[V, Ht]``: ``lm_head.weight``, or the tied
    ``model.embed_tokens.weight`` (``tie_word_embeddings``; SmolLM2 is tied)."""
    return load_target_tensor(target_dir, ["lm_head.weight", "model.embed_tokens.weight"])[1]


def load_target_embed(target_dir: str | os.PathLike) -> torch.Tensor:
    """The target's input embedding ``[V, Ht]`` (``model.embed_tokens.weight``)."""
    return load_target_tensor(target_dir, ["model.embed_tokens.weight", "embed_tokens.weight"])[1]


@torch.no_grad()
def init_drafter_from_target(drafter: Eagle3Drafter, embed: torch.Tensor, lm_head: torch.Tensor) -> None:
    """Copy the target's embeddings and (draft-vocabulary rows of its) lm_head into the drafter.

    Why: the drafter predicts the target's own next tokens from the target's own features, so
    starting from the target's input/output embeddings puts the token spaces in place from step 0
    and the head converges much faster than from random rows (EAGLE/EAGLE-3 reuse the target's
    embedding and head; speculators initialises the draft lm_head from the target's rows of the
    draft vocabulary). ``embed_tokens`` stays trainable (P-EAGLE trains embeddings; the mask token's
    row starts as the target's unused row). Requires ``d2t`` to be installed first.

    Args:
        embed: ``[V, Ht]`` target ``embed_tokens``; lm_head: ``[V, Ht]`` target output projection.

    Raises:
        ValueError: shapes do not fit the drafter (``H != Ht`` or a different vocabulary).
    """
    cfg = drafter.config
    want = (cfg.vocab_size, cfg.hidden_size)
    for name, t in (("embed_tokens", embed), ("lm_head", lm_head)):
        if tuple(t.shape) != want:
            raise ValueError(
                f"target {name} has shape {tuple(t.shape)}, the drafter needs {want} (vocab_size, hidden_size);"
                " build the drafter with DrafterConfig.from_target(target config)"
            )
    drafter.embed_tokens.weight.copy_(embed.to(drafter.embed_tokens.weight.dtype))
    target_ids = torch.arange(cfg.draft_vocab_size, device=drafter.d2t.device) + drafter.d2t  # [Vd]
    drafter.lm_head.weight.copy_(lm_head[target_ids.cpu()].to(drafter.lm_head.weight.dtype))


# ----------------------------------------------------------------------------------------------
# draft vocabulary (d2t / t2d)


def count_tokens(samples: Iterable[Sample], vocab_size: int, *, assistant_only: bool = True) -> torch.Tensor:
    """Token counts ``[V]`` int64 over ``input_ids`` (only ``loss_mask`` positions by default)."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for s in samples:
        ids = torch.as_tensor(s["input_ids"]).long().flatten()
        if assistant_only and s.get("loss_mask") is not None:
            ids = ids[torch.as_tensor(s["loss_mask"]).flatten().bool()]
        counts += torch.bincount(ids, minlength=vocab_size)[:vocab_size]
    return counts


def load_token_counts(path: str | os.PathLike) -> torch.Tensor:
    """``counts [V]`` from a capture directory (its ``token_counts.safetensors``) or that file."""
    from peagle_core.shards import TOKEN_COUNTS_NAME
    from peagle_core.shards import load_token_counts as _load

    p = Path(path)
    return _load(p / TOKEN_COUNTS_NAME if p.is_dir() else p)


def draft_vocab_mapping(
    counts: torch.Tensor, draft_vocab_size: int, *, always_keep: Iterable[int] = ()
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d2t [Vd], t2d [V])`` keeping the most frequent tokens (``peagle_core.vocab``)."""
    return vocab_mapping_from_counts(counts, draft_vocab_size, always_keep=tuple(always_keep))


# ----------------------------------------------------------------------------------------------
# optimizer and schedule


def lr_multiplier(step: int, *, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.0) -> float:
    """Linear warmup from ``1/warmup_steps`` to 1 over ``warmup_steps``, then cosine decay to
    ``min_lr_ratio`` at ``total_steps``. ``step`` counts optimizer steps already taken (0-based)."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, max(0.0, (step - warmup_steps) / decay_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(model: torch.nn.Module, cfg: Any) -> torch.optim.AdamW:
    """AdamW with the recipe's ``lr``, ``betas``, ``weight_decay``; no decay on norms, biases,
    ``mask_hidden`` and embeddings (1-D tensors and ``embed_tokens``). Build it after the model is
    on its device (the fused implementation is picked when the device has one)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or "embed_tokens" in name else decay).append(p)
    groups = [{"params": decay, "weight_decay": float(_get(cfg, "weight_decay", 0.0))},
              {"params": no_decay, "weight_decay": 0.0}]
    kw = {"lr": float(_get(cfg, "lr")), "betas": tuple(_get(cfg, "betas", (0.9, 0.95)))}
    try:  # fused kernels (CPU and CUDA): ~4x faster than foreach on a 2-core CPU for a SmolLM2 head
        return torch.optim.AdamW(groups, fused=True, **kw)
    except (RuntimeError, TypeError, ValueError):  # a device/dtype without a fused AdamW
        return torch.optim.AdamW(groups, **kw)


def build_scheduler(optimizer: torch.optim.Optimizer, *, warmup_steps: int, total_steps: int,
                    min_lr_ratio: float = 0.0) -> torch.optim.lr_scheduler.LambdaLR:
    """``LambdaLR`` over :func:`lr_multiplier` (its state dict holds only counters)."""
    from functools import partial

    fn = partial(lr_multiplier, warmup_steps=warmup_steps, total_steps=total_steps, min_lr_ratio=min_lr_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)


# ----------------------------------------------------------------------------------------------
# packing


def _default_pack_fn() -> Callable[[list[Sample], int], list[Any]]:
    from peagle_core.objective import pack_samples

    return pack_samples


def _sample_len(s: Sample) -> int:
    return len(s["input_ids"])


def _truncate(s: Sample, n: int) -> dict:
    return {k: (v[:n] if k in ("input_ids", "loss_mask", "aux", "final_hidden") else v) for k, v in s.items()}


def iter_packed_batches(
    samples: Iterable[Sample],
    batch_tokens: int,
    pack_fn: Callable[[list[Sample], int], list[Any]],
    *,
    skip_samples: int = 0,
) -> Iterator[tuple[Any, int]]:
    """Greedy streaming packing: yields ``(PackedBatch, num_samples)`` with at most
    ``batch_tokens`` tokens each, in sample order.

    The first ``skip_samples`` samples are dropped (resume inside an epoch). A sample longer than
    ``batch_tokens`` is truncated to it (warned once). ``num_samples`` counts the samples inside
    the batch, so the running sum is the data position to checkpoint.
    """
    buf: list[Sample] = []
    buf_tokens = 0
    warned = False
    it = iter(samples)
    for _ in range(skip_samples):
        if next(it, None) is None:
            return
    for s in it:
        n = _sample_len(s)
        if n == 0:
            continue
        if n > batch_tokens:
            if not warned:
                log.warning("a sample of %d tokens exceeds batch_tokens=%d: truncated (raise batch_tokens "
                            "to keep long samples whole)", n, batch_tokens)
                warned = True
            s, n = _truncate(s, batch_tokens), batch_tokens
        if buf and buf_tokens + n > batch_tokens:
            yield from _pack(buf, batch_tokens, pack_fn)
            buf, buf_tokens = [], 0
        buf.append(s)
        buf_tokens += n
    if buf:
        yield from _pack(buf, batch_tokens, pack_fn)


def _pack(buf: list[Sample], batch_tokens: int, pack_fn) -> Iterator[tuple[Any, int]]:
    batches = pack_fn(buf, batch_tokens)
    # pack_fn gets samples that fit into one batch; should it split them, the samples are
    # attributed to the last batch (the data position then stays exact at batch boundaries).
    for i, b in enumerate(batches):
        yield b, (len(buf) if i == len(batches) - 1 else 0)


def estimate_steps_per_epoch(lengths: Iterable[int], batch_tokens: int, num_workers: int = 1) -> int:
    """Steps per epoch per worker of greedy packing of ``lengths`` into ``batch_tokens``, assuming the
    samples are split evenly over ``num_workers`` (a lower bound is safer: floor)."""
    num_batches, cur = 0, 0
    for n in lengths:
        n = min(int(n), batch_tokens)
        if n == 0:
            continue
        if cur and cur + n > batch_tokens:
            num_batches, cur = num_batches + 1, 0
        cur += n
    num_batches += 1 if cur else 0
    return max(1, num_batches // max(1, num_workers))


# ----------------------------------------------------------------------------------------------
# the plain training loop


@dataclass
class DataPosition:
    """Where a worker is in its data: ``epoch`` and samples of that epoch already trained on."""

    epoch: int = 0
    samples_consumed: int = 0
    epoch_step: int = 0  # optimizer steps taken in this epoch (equal on all workers)


@dataclass
class TrainState:
    step: int = 0
    tokens_seen: int = 0
    positions_seen: int = 0
    position: DataPosition = field(default_factory=DataPosition)
    resumed_from_step: int | None = None
    history: list[dict] = field(default_factory=list)  # logged metric windows (rank-local)


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return getattr(model, "module", model)


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def optimizer_digest(state_dict: dict) -> float:
    """A float that changes with any AdamW moment: sum over params of ``|exp_avg| + exp_avg_sq``
    plus step counters (used to check that a resume restored the optimizer)."""
    total = 0.0
    for st in state_dict["state"].values():
        for k, v in st.items():
            if torch.is_tensor(v):
                total += float(v.double().abs().sum()) if k != "step" else float(v)
            elif isinstance(v, (int, float)):
                total += float(v)
    return total


class Trainer:
    """One worker's training loop, Ray-free.

    Args:
        config: the recipe's ``TrainingConfig`` (or a dict/object with its fields): ``lr``, ``betas``,
            ``weight_decay``, ``warmup_steps``, ``batch_tokens``, ``grad_clip``, ``num_epochs``,
            ``max_steps``, ``checkpoint_every_steps``, ``seed``.
        model: the drafter, possibly DDP-wrapped or FSDP2-sharded (``peagle_core.fsdp.shard_drafter``);
            ``model.module`` is the ``Eagle3Drafter``.
        objective: ``peagle_core.objective.build_objective(...)`` result; its
            ``forward_backward(drafter, batch, target_lm_head=..., no_sync=...)`` runs forward and
            backward and returns float metrics.
        target_lm_head: ``[V, Ht]`` target output projection (on ``device``).
        total_steps: optimizer steps of the whole run (cosine horizon; also a hard stop).
        device: where batches go. bf16 autocast on CUDA, float32 on CPU.
        steps_per_epoch: fixed steps per epoch (``None``: until a shard runs out).
        rank, world_size: for logs and the per-rank checkpoint file.
        all_true: distributed AND over workers of "I still have a batch" (identity when alone).
        all_sum: distributed sum of a float vector (identity when alone) for global throughput.
        on_log: ``f(step, metrics)`` called every ``log_every_steps`` on every rank.
        on_checkpoint: ``f(step, metrics)`` called every ``checkpoint_every_steps`` and at the end
            on every rank; it calls :meth:`save_checkpoint` into a directory of its choice.
        log_every_steps: metric window.
        pack_fn: ``pack_samples(samples, max_tokens) -> list[PackedBatch]``.
        fail_after_step: test hook: raise ``RuntimeError`` on every rank right after the checkpoint of
            that step has been reported by all ranks.
    """

    def __init__(
        self,
        *,
        config: Any,
        model: torch.nn.Module,
        objective: Any,
        target_lm_head: torch.Tensor,
        total_steps: int,
        device: torch.device | str = "cpu",
        optimizer: torch.optim.Optimizer | None = None,
        steps_per_epoch: int | None = None,
        rank: int = 0,
        world_size: int = 1,
        all_true: Callable[[bool], bool] | None = None,
        all_sum: Callable[[list[float]], list[float]] | None = None,
        on_log: Callable[[int, dict], None] | None = None,
        on_checkpoint: Callable[[int, dict], None] | None = None,
        log_every_steps: int = 10,
        pack_fn: Callable[[list[Sample], int], list[Any]] | None = None,
        fail_after_step: int | None = None,
    ) -> None:
        if total_steps < 1:
            raise ValueError(f"total_steps={total_steps} must be >= 1 (set max_steps or num_epochs)")
        batch_tokens = int(_get(config, "batch_tokens"))
        if batch_tokens < 2:
            raise ValueError(f"batch_tokens={batch_tokens} must be >= 2")
        self.config = config
        self.model = model
        self.drafter: Eagle3Drafter = _unwrap(model)
        self.objective = objective
        self.device = torch.device(device)
        self.target_lm_head = target_lm_head
        self.total_steps = int(total_steps)
        self.steps_per_epoch = steps_per_epoch
        self.batch_tokens = batch_tokens
        self.num_epochs = int(_get(config, "num_epochs", 1) or 1)
        self.grad_clip = float(_get(config, "grad_clip", 0.0) or 0.0)
        self.checkpoint_every = int(_get(config, "checkpoint_every_steps", 0) or 0)
        self.optimizer = optimizer or build_optimizer(model, config)
        self.scheduler = build_scheduler(self.optimizer, warmup_steps=int(_get(config, "warmup_steps", 0) or 0),
                                         total_steps=self.total_steps)
        self.rank, self.world_size = rank, world_size
        self._all_true = all_true or (lambda x: x)
        self._all_sum = all_sum or (lambda v: v)
        self.on_log, self.on_checkpoint = on_log, on_checkpoint
        self.log_every = max(1, int(log_every_steps))
        self.pack_fn = pack_fn or _default_pack_fn()
        self.fail_after_step = fail_after_step
        self.state = TrainState()
        self.autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if self.device.type == "cuda"
                         else nullcontext())
        self._no_sync = getattr(model, "no_sync", None)  # DDP and ShardedDrafter (FSDP2) have one
        self.sharded = fsdp.is_sharded(model)  # FSDP2: checkpoints gather and scatter (collectives)

    # -- one step --------------------------------------------------------------------------------

    def _to_device(self, batch: Any) -> Any:
        if not (hasattr(batch, "to") and callable(batch.to)):
            return batch
        if self.device.type == "cuda":  # PackedBatch.to(device, dtype): hidden states in bf16
            return batch.to(self.device, torch.bfloat16)
        return batch.to(self.device)

    def train_step(self, batch: Any) -> dict[str, float]:
        """One optimizer step on one ``PackedBatch``; returns the objective's metrics plus ``lr``,
        ``grad_norm``, ``num_tokens``."""
        self.model.train()
        batch = self._to_device(batch)
        self.optimizer.zero_grad(set_to_none=True)
        kw: dict[str, Any] = {}
        if self.world_size > 1 and hasattr(self.objective, "build_elements"):
            # DDP and FSDP2 average gradients over W ranks: scale by global_loss_elements / W so the step is
            # the exact mean over all ranks' loss elements (not a mean of per-rank means).
            elements = self.objective.build_elements(batch, self.model)
            total = self._all_sum([float(_loss_count(self.objective, elements, batch))])[0]
            kw = {"elements": elements, "loss_scale_denominator": max(total, 1.0) / self.world_size}
        with self.autocast:
            metrics = dict(self.objective.forward_backward(
                self.model, batch, target_lm_head=self.target_lm_head, no_sync=self._no_sync, **kw))
        if self.grad_clip > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
            if hasattr(grad_norm, "full_tensor"):  # FSDP2: a replicated DTensor
                grad_norm = grad_norm.full_tensor()
            metrics["grad_norm"] = float(grad_norm)
        metrics["lr"] = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        metrics["num_tokens"] = float(_num_tokens(batch))
        return metrics

    # -- the loop --------------------------------------------------------------------------------

    def fit(self, samples_for_epoch: Callable[[int], Iterable[Sample]]) -> TrainState:
        """Train until ``total_steps`` or ``num_epochs`` is reached.

        Args:
            samples_for_epoch: ``epoch -> iterable of samples`` (the same order for the same epoch,
                so a resume can skip the samples already consumed).

        Returns:
            The final :class:`TrainState` (also ``self.state``).
        """
        st = self.state
        window: dict[str, list[float]] = defaultdict(list)
        t_window = time.perf_counter()
        last_ckpt_step = st.step if st.resumed_from_step is not None else -1
        done = st.step >= self.total_steps
        while not done and st.position.epoch < self.num_epochs:
            pos = st.position
            batches = iter_packed_batches(samples_for_epoch(pos.epoch), self.batch_tokens, self.pack_fn,
                                          skip_samples=pos.samples_consumed)
            while True:
                item = None
                if self.steps_per_epoch is None or pos.epoch_step < self.steps_per_epoch:
                    item = next(batches, None)
                if not self._all_true(item is not None):
                    break
                batch, num_samples = item
                metrics = self.train_step(batch)
                st.step += 1
                pos.epoch_step += 1
                pos.samples_consumed += num_samples
                st.tokens_seen += int(metrics["num_tokens"])
                st.positions_seen += int(metrics.get(POSITIONS_KEY, 0))
                for k, v in metrics.items():
                    window[k].append(float(v))
                done = st.step >= self.total_steps
                if st.step % self.log_every == 0 or done:
                    self._log(window, time.perf_counter() - t_window)
                    window, t_window = defaultdict(list), time.perf_counter()
                if (self.checkpoint_every and st.step % self.checkpoint_every == 0) or done:
                    t_ckpt = time.perf_counter()
                    self._checkpoint()
                    last_ckpt_step = st.step
                    t_window += time.perf_counter() - t_ckpt  # throughput excludes checkpoint I/O
                if self.fail_after_step is not None and st.step >= self.fail_after_step:
                    # A collective first: under Ray every rank has then returned from its report
                    # (its upload done and result queued), so the checkpoint is complete and
                    # registered; a rank raising while another still uploads leaves a partial,
                    # unregistered checkpoint directory (Ray then resumes from the previous one).
                    self._all_true(True)
                    raise RuntimeError(f"fail_after_step={self.fail_after_step}: simulated failure at step {st.step}")
                if done:
                    break
            if not done:
                st.position = DataPosition(epoch=pos.epoch + 1)
        if last_ckpt_step != st.step:  # ran out of data/epochs between checkpoints
            if window:
                self._log(window, time.perf_counter() - t_window)
            self._checkpoint()
        return st

    def _log(self, window: dict[str, list[float]], seconds: float) -> None:
        m = {k: sum(v) / len(v) for k, v in window.items() if v}
        tokens = sum(window.get("num_tokens", []))
        positions = sum(window.get(POSITIONS_KEY, []))
        keys = sorted(m)
        if self.world_size > 1:  # rank means -> mean over ranks; throughput -> sum over ranks
            summed = self._all_sum([tokens, positions] + [m[k] for k in keys])
            tokens, positions = summed[0], summed[1]
            m = {k: v / self.world_size for k, v in zip(keys, summed[2:])}
        m.pop("num_tokens", None)
        m.pop(POSITIONS_KEY, None)
        seconds = max(seconds, 1e-9)
        m.update({"tokens_per_s": tokens / seconds, "positions_per_s": positions / seconds,
                  "epoch": float(self.state.position.epoch), "step": float(self.state.step),
                  "tokens_seen": float(self.state.tokens_seen)})
        self.state.history.append(m)  # tokens_seen counts this worker's tokens
        if self.on_log is not None:
            self.on_log(self.state.step, m)

    def _checkpoint(self) -> None:
        if self.on_checkpoint is not None:
            self.on_checkpoint(self.state.step, self.state.history[-1] if self.state.history else {})

    # -- checkpoints -----------------------------------------------------------------------------

    def _model_state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu().contiguous() for k, v in self.drafter.state_dict().items()}

    def full_optimizer_state(self) -> dict:
        """The optimizer state dict: ``optimizer.state_dict()``, or under FSDP2 the full one keyed by
        parameter name on rank 0 (``{}`` on other ranks; a collective, call it on every rank)."""
        if self.sharded:
            return fsdp.full_optimizer_state_dict(self.model, self.optimizer)
        return self.optimizer.state_dict()

    def save_checkpoint(self, directory: str | os.PathLike, *, extra_state: dict | None = None) -> Path:
        """Write this rank's part of a checkpoint into ``directory``: rank 0 writes the model
        (safetensors), optimizer, scheduler and ``trainer_state.json``; every rank writes its data
        position and RNG states to ``rank_XXXX.pt``. Under FSDP2 every rank must call it (the full
        model and optimizer states are gathered to rank 0)."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        st = self.state
        model_state = opt_state = None
        if self.sharded:  # collectives on every rank
            model_state = fsdp.full_model_state_dict(self.model)
            opt_state = self.full_optimizer_state()
        if self.rank == 0:
            save_file(model_state if self.sharded else self._model_state(), str(d / MODEL_FILE),
                      metadata={"format": "pt"})
            torch.save(opt_state if self.sharded else self.optimizer.state_dict(), d / OPTIMIZER_FILE)
            torch.save(self.scheduler.state_dict(), d / SCHEDULER_FILE)
            meta = {"step": st.step, "tokens_seen": st.tokens_seen, "positions_seen": st.positions_seen,
                    "world_size": self.world_size, "total_steps": self.total_steps, "sharded": self.sharded,
                    "training_config": _as_dict(self.config), **(extra_state or {})}
            (d / STATE_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True, default=str))
        rank_state = {"position": vars(st.position).copy(), "rng": _rng_state(), "step": st.step}
        gen = getattr(self.objective, "generator", None)
        if isinstance(gen, torch.Generator):  # the objective's COD sampling stream
            rank_state["objective_generator"] = gen.get_state()
        torch.save(rank_state, d / RANK_FILE.format(rank=self.rank))
        return d

    def load_checkpoint(self, directory: str | os.PathLike) -> dict:
        """Restore model, optimizer, scheduler, this rank's data position and RNG from ``directory``.

        A checkpoint written by a different number of workers restarts the saved epoch from its
        beginning on every rank (warned): data positions are per worker shard.

        Returns:
            The ``trainer_state.json`` dict.

        Raises:
            ValueError: the directory is not a checkpoint of this stage (names the missing file), or
                it was written under the other parallel strategy (FSDP2 optimizer state is keyed by
                parameter name, DDP's by index).
        """
        d = Path(directory)
        for name in (MODEL_FILE, OPTIMIZER_FILE, SCHEDULER_FILE, STATE_FILE):
            if not (d / name).is_file():
                raise ValueError(f"{d} is not a training checkpoint: {name} is missing")
        meta = json.loads((d / STATE_FILE).read_text())
        if bool(meta.get("sharded", False)) != self.sharded:
            written, now = ("fsdp", "ddp") if meta.get("sharded") else ("ddp", "fsdp")
            raise ValueError(f"checkpoint {d} was written with parallel_strategy={written!r} "
                             f"({meta.get('world_size')} workers); this run is {now!r} ({self.world_size} "
                             f"workers): resume it with parallel_strategy={written!r} and > 1 workers for fsdp, "
                             "or start a new run (another run_name)")
        if self.sharded:  # rank 0 reads, the helpers broadcast and each rank keeps its shard
            state = load_file(str(d / MODEL_FILE), device="cpu") if self.rank == 0 else {}
            fsdp.load_full_model_state_dict(self.model, state)
            opt_state = torch.load(d / OPTIMIZER_FILE, map_location="cpu", weights_only=True) if self.rank == 0 else {}
            fsdp.load_full_optimizer_state_dict(self.model, self.optimizer, opt_state)
        else:
            state = load_file(str(d / MODEL_FILE), device="cpu")
            self.drafter.load_state_dict(state, strict=True)
            self.optimizer.load_state_dict(torch.load(d / OPTIMIZER_FILE, map_location=self.device,
                                                      weights_only=True))
        self.scheduler.load_state_dict(torch.load(d / SCHEDULER_FILE, weights_only=True))
        st = self.state
        st.step = st.resumed_from_step = int(meta["step"])
        st.tokens_seen, st.positions_seen = int(meta.get("tokens_seen", 0)), int(meta.get("positions_seen", 0))
        rank_file = d / RANK_FILE.format(rank=self.rank)
        if rank_file.is_file() and int(meta.get("world_size", 1)) == self.world_size:
            rs = torch.load(rank_file, weights_only=True)
            st.position = DataPosition(**rs["position"])
            _set_rng_state(rs["rng"])
            gen = getattr(self.objective, "generator", None)
            if isinstance(gen, torch.Generator) and "objective_generator" in rs:
                gen.set_state(rs["objective_generator"])
        else:
            saved = json.loads(json.dumps(meta))
            log.warning("checkpoint %s was written by %s workers, this run has %d: restarting its epoch "
                        "from the beginning", d, saved.get("world_size"), self.world_size)
            other = sorted(d.glob("rank_*.pt"))
            epoch = int(torch.load(other[0], weights_only=True)["position"]["epoch"]) if other else 0
            st.position = DataPosition(epoch=epoch)
        return meta


def _loss_count(objective: Any, elements: Any, batch: Any) -> int:
    """The count an objective divides its summed loss by by default (``peagle_core.objective``:
    all loss elements; ``peagle_core.ttt``: the loss elements of TTT step 0, weights 1, 0.8, ...)."""
    if getattr(objective, "method", "") == "eagle3":
        return int(elements.loss[: _num_tokens(batch)].sum())
    return int(elements.num_loss_elements)


def _num_tokens(batch: Any) -> int:
    ids = batch["input_ids"] if isinstance(batch, Mapping) else batch.input_ids
    return int(ids.numel())


# ----------------------------------------------------------------------------------------------
# plain (no Ray) entry point


def _latest_checkpoint(root: Path) -> Path | None:
    found = sorted(p for p in root.glob("checkpoint_*") if (p / STATE_FILE).is_file())
    return found[-1] if found else None


@dataclass
class TrainResult:
    """What a run leaves: final step, the last checkpoint directory and the rank-0 metric history."""

    step: int
    checkpoint: Path | None
    history: list[dict]
    resumed_from_step: int | None
    state: TrainState


def run_training(
    samples_for_epoch: Callable[[int], Iterable[Sample]],
    drafter: Eagle3Drafter,
    target_lm_head: torch.Tensor,
    objective: Any,
    config: Any,
    *,
    checkpoint_dir: str | os.PathLike | None = None,
    resume: bool = True,
    num_to_keep: int | None = 2,
    steps_per_epoch: int | None = None,
    device: str | torch.device | None = None,
    log_every_steps: int = 10,
    pack_fn: Callable[[list[Sample], int], list[Any]] | None = None,
    on_log: Callable[[int, dict], None] | None = None,
    fail_after_step: int | None = None,
) -> TrainResult:
    """Train ``drafter`` on one process, no Ray (the benchmark GPU box path).

    Args:
        samples_for_epoch: ``epoch -> iterable of samples`` (e.g. ``lambda e:
            peagle_core.shards.iter_samples(capture_dir)``); must give the same order for the same
            epoch so that a resume skips exactly the samples already trained on.
        drafter: the head (vocab mapping and target init already applied).
        target_lm_head: ``[V, Ht]`` (:func:`load_target_lm_head`).
        objective: ``peagle_core.objective.build_objective(method, ...)``.
        config: ``TrainingConfig``; the cosine horizon is ``max_steps`` if set, else
            ``num_epochs * steps_per_epoch`` (``steps_per_epoch`` counted with one pass over
            epoch 0 when not given).
        checkpoint_dir: checkpoints go to ``<checkpoint_dir>/checkpoint_<step>``; with ``resume`` the
            latest one is loaded first.
        num_to_keep: most recent checkpoints kept (``None``: all).
        device: default CUDA if available else CPU.

    Raises:
        ValueError: neither ``max_steps`` nor ``num_epochs`` gives a positive horizon.
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(int(_get(config, "seed", 0) or 0))
    batch_tokens = int(_get(config, "batch_tokens"))
    total_steps = _total_steps(config, steps_per_epoch,
                               lambda: estimate_steps_per_epoch((_sample_len(s) for s in samples_for_epoch(0)),
                                                                batch_tokens))
    drafter.to(device)
    ckpt_root = Path(checkpoint_dir) if checkpoint_dir is not None else None

    def on_checkpoint(step: int, metrics: dict) -> None:
        if ckpt_root is None:
            return
        final = ckpt_root / f"checkpoint_{step:08d}"
        tmp = Path(tempfile.mkdtemp(prefix=".tmp_ckpt_", dir=ckpt_root))
        trainer.save_checkpoint(tmp, extra_state={"metrics": metrics})
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        if num_to_keep:
            for old in sorted(ckpt_root.glob("checkpoint_*"))[:-num_to_keep]:
                shutil.rmtree(old, ignore_errors=True)

    if ckpt_root is not None:
        ckpt_root.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(config=config, model=drafter, objective=objective,
                      target_lm_head=target_lm_head.to(device), total_steps=total_steps, device=device,
                      steps_per_epoch=steps_per_epoch, on_log=on_log or _log_line(total_steps),
                      on_checkpoint=on_checkpoint, log_every_steps=log_every_steps, pack_fn=pack_fn,
                      fail_after_step=fail_after_step)
    if resume and ckpt_root is not None and (latest := _latest_checkpoint(ckpt_root)) is not None:
        trainer.load_checkpoint(latest)
        log.info("resumed from %s (step %d)", latest, trainer.state.step)
    st = trainer.fit(samples_for_epoch)
    return TrainResult(step=st.step, checkpoint=_latest_checkpoint(ckpt_root) if ckpt_root else None,
                       history=st.history, resumed_from_step=st.resumed_from_step, state=st)


def _total_steps(config: Any, steps_per_epoch: int | None, count_steps: Callable[[], int]) -> int:
    max_steps = _get(config, "max_steps")
    if max_steps:
        return int(max_steps)
    num_epochs = int(_get(config, "num_epochs", 0) or 0)
    if num_epochs < 1:
        raise ValueError(f"max_steps={max_steps} and num_epochs={num_epochs}: set either to bound the run")
    return num_epochs * int(steps_per_epoch or count_steps())


def _log_line(total_steps: int) -> Callable[[int, dict], None]:
    """Progress as one log line per metric window (works in Ray worker logs and CI)."""
    t0 = time.perf_counter()

    def fn(step: int, m: dict) -> None:
        elapsed = time.perf_counter() - t0
        eta = elapsed / max(step, 1) * (total_steps - step)
        depth = " ".join(f"{k}={m[k]:.3f}" for k in sorted(m) if k.startswith("acc"))
        log.info("step %d/%d epoch %d loss %.4f %s lr %.2e tok/s %.0f pos/s %.0f eta %.0fs", step, total_steps,
                 int(m.get("epoch", 0)), m.get("loss", float("nan")), depth, m.get("lr", 0.0),
                 m.get("tokens_per_s", 0.0), m.get("positions_per_s", 0.0), eta)

    return fn


# ----------------------------------------------------------------------------------------------
# MLflow (rank 0 only; Train V2 has no MLflowLoggerCallback)


def default_tracking_uri() -> str:
    """``$MLFLOW_TRACKING_URI``, else ``sqlite:///$PEAGLE_HOME/mlflow.db`` (PEAGLE_HOME default
    ``~/.cache/peagle``)."""
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    home = Path(os.environ.get("PEAGLE_HOME", "~/.cache/peagle")).expanduser()
    home.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{home / 'mlflow.db'}"


class MlflowTracker:
    """Logs params and metric windows of one run to MLflow; re-attaches to the same MLflow run on
    resume (its id is stored in the checkpoint)."""

    def __init__(self, tracking_uri: str, experiment: str, run_name: str, run_id: str | None = None) -> None:
        import mlflow

        self._mlflow = mlflow
        mlflow.set_tracking_uri(tracking_uri)
        mlflow.set_experiment(experiment)
        self.run = mlflow.start_run(run_id=run_id, run_name=None if run_id else run_name)
        self.run_id = self.run.info.run_id

    def log_params(self, params: dict) -> None:
        flat = _flatten(params)
        self._mlflow.log_params({k: str(v)[:500] for k, v in flat.items()})

    def log_metrics(self, step: int, metrics: dict) -> None:
        self._mlflow.log_metrics({k.replace("/", "_"): float(v) for k, v in metrics.items()
                                  if isinstance(v, (int, float)) and math.isfinite(float(v))}, step=step)

    def end(self, status: str = "FINISHED") -> None:
        self._mlflow.end_run(status=status)


def _flatten(d: Mapping, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


# ----------------------------------------------------------------------------------------------
# Ray Train V2


def _row_to_sample(row: Mapping, float_dtype: torch.dtype) -> dict:
    """A Ray Data row (numpy arrays; float16 after parquet) -> a sample of torch tensors."""
    out: dict[str, Any] = {}
    for k, v in row.items():
        if k in ("input_ids", "loss_mask", "aux", "final_hidden"):
            t = torch.as_tensor(v)
            if k == "input_ids":
                t = t.long()
            elif t.is_floating_point():
                t = t.to(float_dtype)
            out[k] = t
        else:
            out[k] = v
    return out


def train_loop_per_worker(config: dict) -> dict:
    """Ray Train worker function (``TorchTrainer(train_loop_per_worker, train_loop_config=...)``).

    ``config`` keys (built by :func:`run_train`): ``training`` (``TrainingConfig`` dict),
    ``drafter`` (``DrafterConfig`` dict), ``target_dir`` (HF safetensors dir readable by every
    worker), ``d2t``/``t2d`` (or None), ``train_embed_tokens`` (False: frozen target embeddings),
    ``cpu_threads_per_worker`` (optional; default the node's cores / local workers),
    ``objective`` (kwargs of ``build_objective``),
    ``total_steps``, ``steps_per_epoch``, ``parallel_strategy`` (``"ddp"`` or ``"fsdp"``),
    ``log_every_steps``, ``mlflow`` (``{tracking_uri, experiment, run_name}`` or None), ``debug``
    (``{"fail_after_step": int}``, tests only).

    Returns (rank 0's value becomes ``Result.return_value``): ``{"step", "resumed_from_step",
    "resume_optimizer_digest", "history", "mlflow_run_id"}``.
    """
    import ray.train
    import ray.train.torch
    import torch.distributed as dist

    from peagle_core.objective import build_objective

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = ray.train.torch.get_device()
    if device.type == "cpu":
        # Ray gives a CPU worker OMP_NUM_THREADS=1; a worker's share of the node's cores is what the
        # matmuls can use (2x faster training on the 2-core demo box than 1 thread)
        share = (os.cpu_count() or 1) // max(1, ctx.get_local_world_size())
        torch.set_num_threads(int(config.get("cpu_threads_per_worker") or max(1, share)))
    tcfg = config["training"]
    seed = int(_get(tcfg, "seed", 0) or 0)
    torch.manual_seed(seed)  # identical init on every rank (DDP also broadcasts rank 0's weights; FSDP2 does not)

    drafter = Eagle3Drafter(DrafterConfig(**config["drafter"]))
    if config.get("d2t") is not None:
        drafter.set_vocab_mapping(torch.as_tensor(config["d2t"]), torch.as_tensor(config["t2d"]))
    lm_head = load_target_lm_head(config["target_dir"])
    if config.get("init_from_target", True):
        init_drafter_from_target(drafter, load_target_embed(config["target_dir"]), lm_head)
    if not config.get("train_embed_tokens", True):
        # frozen target embeddings: no [V, H] gradient and AdamW state (the largest tensors of a
        # small head); the exported head then omits embed_tokens and vLLM shares the target's
        drafter.embed_tokens.weight.requires_grad_(False)
    float_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    lm_head = lm_head.to(device=device, dtype=float_dtype)
    torch.manual_seed(seed + 1000 * (rank + 1))  # per-rank stream for COD sampling

    strategy = config.get("parallel_strategy", "ddp")
    if strategy == "fsdp" and world > 1:
        # Ray's prepare_model("fsdp") wraps with FSDP1 and only on GPU: move with it, shard with FSDP2
        model = fsdp.shard_drafter(ray.train.torch.prepare_model(drafter, parallel_strategy=None))
    else:
        model = ray.train.torch.prepare_model(drafter, parallel_strategy=strategy if world > 1 else None)
    optimizer = build_optimizer(model, tcfg)
    # per-rank COD stream: each rank samples different slots of its own batches
    obj_kw = dict(config.get("objective", {}))
    obj_kw["seed"] = int(obj_kw.get("seed", seed)) + rank
    objective = build_objective(_get(tcfg, "method", "peagle"), **obj_kw)

    def all_true(flag: bool) -> bool:
        if world == 1 or not dist.is_initialized():
            return flag
        t = torch.tensor([1 if flag else 0], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())

    def all_sum(values: list[float]) -> list[float]:
        if world == 1 or not dist.is_initialized():
            return values
        t = torch.tensor(values, dtype=torch.float64, device=device)
        dist.all_reduce(t)
        return t.tolist()

    mlcfg = config.get("mlflow")
    tracker: MlflowTracker | None = None
    extra_state: dict = {}
    progress = _log_line(int(config["total_steps"]))

    def on_log(step: int, metrics: dict) -> None:
        if rank == 0:
            progress(step, metrics)
            if tracker is not None:
                tracker.log_metrics(step, metrics)

    def on_checkpoint(step: int, metrics: dict) -> None:
        # ray.train.report is a barrier: every rank reaches it at the same steps because the
        # steps are kept equal (all_true) and the checkpoint steps are a function of the step.
        with tempfile.TemporaryDirectory() as tmp:
            trainer.save_checkpoint(tmp, extra_state=extra_state)
            ray.train.report({**metrics, "step": step}, checkpoint=ray.train.Checkpoint.from_directory(tmp),
                             checkpoint_dir_name=f"checkpoint_{step:08d}")

    debug = config.get("debug") or {}
    trainer = Trainer(
        config=tcfg, model=model, objective=objective, target_lm_head=lm_head,
        total_steps=int(config["total_steps"]), device=device, optimizer=optimizer,
        steps_per_epoch=config.get("steps_per_epoch"), rank=rank, world_size=world,
        all_true=all_true, all_sum=all_sum, on_log=on_log, on_checkpoint=on_checkpoint,
        log_every_steps=int(config.get("log_every_steps", 10)), fail_after_step=debug.get("fail_after_step"),
    )
    resume_digest = None
    checkpoint = ray.train.get_checkpoint()
    meta: dict = {}
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            meta = trainer.load_checkpoint(d)
        full_opt = trainer.full_optimizer_state()  # a collective under FSDP2 ({} off rank 0)
        resume_digest = optimizer_digest(full_opt) if full_opt else None
        if rank == 0:
            log.info("resumed from step %d (epoch %d, %d samples into it)", trainer.state.step,
                     trainer.state.position.epoch, trainer.state.position.samples_consumed)

    if rank == 0 and mlcfg:
        tracker = MlflowTracker(mlcfg["tracking_uri"], mlcfg["experiment"], mlcfg["run_name"],
                                run_id=meta.get("mlflow_run_id"))
        extra_state["mlflow_run_id"] = tracker.run_id
        if checkpoint is None:
            tracker.log_params({"training": _as_dict(tcfg), "drafter": config["drafter"],
                                "world_size": world, "total_steps": config["total_steps"]})

    shard = ray.train.get_dataset_shard("train")

    def samples_for_epoch(epoch: int) -> Iterator[dict]:
        return (_row_to_sample(row, torch.float32) for row in shard.iter_rows())

    try:
        st = trainer.fit(samples_for_epoch)
    except BaseException:
        if tracker is not None:
            tracker.end("FAILED")
        raise
    if tracker is not None:
        tracker.end()
    return {"step": st.step, "resumed_from_step": st.resumed_from_step, "resume_optimizer_digest": resume_digest,
            "history": st.history, "mlflow_run_id": tracker.run_id if tracker else None}


def objective_kwargs(training: Any, drafter_spec: Any) -> dict:
    """Keyword arguments of ``peagle_core.objective.build_objective(method, **kw)`` from the recipe:
    the recipe fields the method's config declares (``num_depths`` = K for P-EAGLE; ``ttt_steps``,
    ``ttt_decay`` for EAGLE-3; ``cod_*``, ``num_partitions``, ``loss``, ``attention``, ``seed``)."""
    from dataclasses import fields

    from peagle_core.objective import build_objective

    method = _get(training, "method", "peagle")
    known = {f.name for f in fields(type(build_objective(method)).config_cls)}
    candidates = {k: _get(training, k) for k in ("cod_ratio", "cod_min_ratio", "num_partitions", "loss",
                                                 "attention", "seed")}
    candidates["num_depths"] = int(_get(drafter_spec, "num_speculative_tokens"))  # P-EAGLE: K depths
    candidates["num_steps"] = _get(training, "ttt_steps")  # EAGLE-3 TTT steps
    candidates["step_weight"] = _get(training, "ttt_decay")  # EAGLE-3: step i weighs decay^i
    return {k: v for k, v in candidates.items() if k in known and v is not None}


@dataclass
class TrainOutput:
    """Result of :func:`run_train`."""

    head_dir: Path
    checkpoint_path: str | None
    step: int
    resumed_from_step: int | None
    metrics: dict
    return_value: dict | None
    mlflow_run_id: str | None


def _split_recipe(recipe_or_configs: Any) -> tuple[Any, Any, Any]:
    if isinstance(recipe_or_configs, (tuple, list)):
        training, drafter, *rest = recipe_or_configs
        return training, drafter, (rest[0] if rest else None)
    training = _get(recipe_or_configs, "training") or _get(recipe_or_configs, "train")
    drafter = _get(recipe_or_configs, "drafter")
    target = _get(recipe_or_configs, "target")
    if training is None or drafter is None:
        raise ValueError("recipe_or_configs needs `training` (TrainingConfig) and `drafter` (DrafterSpec); "
                         f"got {type(recipe_or_configs).__name__}")
    return training, drafter, target


def _scan_dataset(dataset: Any, vocab_size: int, want_counts: bool) -> tuple[list[int], torch.Tensor | None]:
    """One pass over ``input_ids``/``loss_mask`` only: sample lengths and assistant-token counts."""
    cols = ["input_ids", "loss_mask"] if want_counts else ["input_ids"]
    lengths: list[int] = []
    counts = torch.zeros(vocab_size, dtype=torch.int64) if want_counts else None
    for row in dataset.select_columns(cols).iter_rows():
        ids = torch.as_tensor(row["input_ids"]).long()
        lengths.append(int(ids.numel()))
        if counts is not None:
            counts += count_tokens([{"input_ids": ids, "loss_mask": row["loss_mask"]}], vocab_size)
    return lengths, counts


def _check_capture(capture_dir: Path, dcfg: DrafterConfig, target_sha256: str | None) -> list[int]:
    """Check a capture's meta against the drafter before any worker starts; return sample lengths.

    Raises:
        ValueError: aux layer ids, hidden size or vocab differ, or the capture was made from another
            target (sha256), naming both values.
    """
    from peagle_core.shards import load_capture_meta, load_manifest

    meta = load_capture_meta(capture_dir)
    checks = [("aux_layer_ids", list(meta.get("aux_layer_ids") or []), list(dcfg.aux_layer_ids)),
              ("hidden_size", meta.get("hidden_size"), dcfg.target_hidden_size),
              ("vocab_size", meta.get("vocab_size"), dcfg.vocab_size)]
    if target_sha256 and meta.get("target_sha256"):
        checks.append(("target_sha256", meta["target_sha256"], target_sha256))
    for name, got, want in checks:
        if got not in (None, []) and got != want:
            raise ValueError(f"capture {capture_dir} has {name}={got} but training expects {want}: re-capture "
                             "with this target/aux layer ids, or train with the capture's target settings")
    return [int(n) for n in load_manifest(capture_dir).column("length").to_pylist()]


def run_train(
    recipe_or_configs: Any,
    dataset: Any,
    out_dir: str | os.PathLike,
    *,
    target_dir: str | os.PathLike | None = None,
    capture_dir: str | os.PathLike | None = None,
    target_name: str | None = None,
    target_sha256: str | None = None,
    run_name: str = "peagle-train",
    storage_path: str | os.PathLike | None = None,
    max_failures: int = 0,
    num_to_keep: int | None = 2,
    token_counts: str | os.PathLike | torch.Tensor | None = None,
    steps_per_epoch: int | None = None,
    scan_dataset: bool = True,
    parallel_strategy: str | None = None,
    resources_per_worker: dict | None = None,
    log_every_steps: int = 10,
    mlflow_tracking_uri: str | None = None,
    mlflow_experiment: str = "peagle-train",
    export_dtype: str = "bfloat16",
    always_keep_token_ids: Iterable[int] = (),
    recipe_text: str | None = None,
    debug: dict | None = None,
) -> TrainOutput:
    """Train a drafter with Ray Train V2 and export the head to ``<out_dir>/head``.

    Args:
        recipe_or_configs: a recipe with ``training`` (``TrainingConfig``), ``drafter``
            (``DrafterSpec``: num_layers, num_speculative_tokens K, mask_token_id, draft_vocab_size)
            and optionally ``target`` (``TargetConfig``), or a tuple ``(training, drafter[, target])``.
        dataset: ``ray.data.Dataset`` of captured rows (``pipelines.capture.captured_dataset`` or the
            streaming ``capture_stream``); split over workers by Ray Train (``get_dataset_shard``).
        out_dir: the exported head goes to ``<out_dir>/head`` (replaced if present).
        target_dir: the target's HF safetensors directory (``pipelines.assets.ensure_target``); it must
            be readable from every worker node (shared storage on a multi-node cluster). Default: from
            ``recipe.target``.
        capture_dir: the materialized capture behind ``dataset``, if any: its ``capture_meta.json`` is
            checked against the drafter (aux layer ids, widths, target sha256), its
            ``token_counts.safetensors`` gives the draft vocabulary and its manifest the epoch length.
        run_name, storage_path: ``RunConfig(name, storage_path)``; re-running with the same pair resumes
            from the latest checkpoint (default storage ``$PEAGLE_HOME/ray_results``).
        max_failures: ``FailureConfig(max_failures)``: worker failures recovered from the latest
            checkpoint (0 = stop at the first failure).
        num_to_keep: ``CheckpointConfig(num_to_keep)``.
        token_counts: ``[V]`` counts or a ``token_counts.safetensors`` path for the draft vocabulary
            (only when ``draft_vocab_size < vocab_size``); counted from the dataset when absent.
        steps_per_epoch: fixed steps per worker per epoch; ``None`` = estimated from one scan of the
            ``input_ids`` column (skip the scan with ``scan_dataset=False``, e.g. for a streaming
            capture dataset, and set ``max_steps``).
        parallel_strategy: ``"ddp"`` (replicated) or ``"fsdp"`` (FSDP2-sharded; for 8B+ targets with
            large vocabularies, see the module docstring); gloo on CPU, NCCL on GPU. Default: the
            recipe's ``training.parallel_strategy`` (``"ddp"``).
        resources_per_worker: ``ScalingConfig(resources_per_worker)``, e.g. ``{"CPU": 1}``.
        mlflow_tracking_uri: default :func:`default_tracking_uri`; ``""`` disables MLflow.
        export_dtype: dtype of the exported weights.
        debug: tests only, ``{"fail_after_step": n}`` raises in every worker after checkpoint n.

    Returns:
        :class:`TrainOutput`.

    Raises:
        ValueError: bad configuration (before any worker starts).
        ray.train.TrainingFailedError: the run failed more than ``max_failures`` times.
    """
    import ray.train
    from ray.train.torch import TorchTrainer

    from peagle_core.contract import export_head

    training, spec, target = _split_recipe(recipe_or_configs)
    if target_dir is None:
        if target is None:
            raise ValueError("target_dir is not set and the recipe has no target: pass target_dir= (an HF dir)")
        from pipelines.assets import ensure_target

        asset = ensure_target(_get(target, "model") or _get(target, "name"), _get(target, "dtype", "float32"))
        target_dir, target_name, target_sha256 = asset.path, target_name or asset.name, target_sha256 or asset.sha256
    target_dir = Path(target_dir)
    hf_config = json.loads((target_dir / "config.json").read_text())
    method = _get(training, "method", "peagle")
    mask_token_id = _get(spec, "mask_token_id") if method == "peagle" else None
    if target is not None and hasattr(target, "resolve_aux_layer_ids"):
        aux_ids = target.resolve_aux_layer_ids(int(hf_config["num_hidden_layers"]))
    else:
        aux_ids = _get(target, "aux_layer_ids") if target is not None else None
    if mask_token_id is None and method == "peagle" and hasattr(target, "reserved_mask_token_id"):
        mask_token_id = target.reserved_mask_token_id()
    dcfg = DrafterConfig.from_target(hf_config, num_hidden_layers=int(_get(spec, "num_layers", 4)),
                                     mask_token_id=mask_token_id,
                                     draft_vocab_size=_get(spec, "draft_vocab_size"),
                                     aux_layer_ids=tuple(aux_ids) if aux_ids else None)
    if method == "peagle" and mask_token_id is None:
        raise ValueError("drafter.mask_token_id is required for method='peagle' (a reserved, unused token id)")
    num_workers = int(_get(training, "num_workers", 1) or 1)
    lengths: list[int] = []
    if capture_dir is not None:
        lengths = _check_capture(Path(capture_dir), dcfg, target_sha256)
        if token_counts is None and (Path(capture_dir) / "token_counts.safetensors").is_file():
            token_counts = Path(capture_dir)
    if parallel_strategy is None:
        parallel_strategy = _get(training, "parallel_strategy", None) or "ddp"
    if parallel_strategy not in ("ddp", "fsdp"):
        raise ValueError(f"parallel_strategy={parallel_strategy!r}: use 'ddp' (replicated head, the default) or "
                         "'fsdp' (FSDP2-sharded head, for 8B+ targets with large vocabularies)")
    if parallel_strategy == "fsdp" and num_workers == 1:
        log.warning("parallel_strategy='fsdp' with training.num_workers=1: nothing to shard, training unsharded")

    # draft vocabulary + epoch length, from one cheap scan (input_ids/loss_mask columns only)
    pruned = dcfg.draft_vocab_size < dcfg.vocab_size
    counts = None
    if isinstance(token_counts, torch.Tensor):
        counts = token_counts
    elif token_counts is not None:
        counts = load_token_counts(token_counts)
    need_scan = scan_dataset and ((steps_per_epoch is None and not _get(training, "max_steps") and not lengths)
                                  or (pruned and counts is None))
    if need_scan:
        lengths, scanned = _scan_dataset(dataset, dcfg.vocab_size, want_counts=pruned and counts is None)
        counts = counts if counts is not None else scanned
    elif pruned and counts is None:
        raise ValueError(f"draft_vocab_size={dcfg.draft_vocab_size} < vocab_size={dcfg.vocab_size} needs token "
                         "counts: pass token_counts= (the capture stage's token_counts.safetensors) or allow "
                         "scan_dataset=True")
    d2t = t2d = None
    if pruned:
        d2t, t2d = draft_vocab_mapping(counts, dcfg.draft_vocab_size, always_keep=always_keep_token_ids)
    if steps_per_epoch is None and lengths:
        steps_per_epoch = estimate_steps_per_epoch(lengths, int(_get(training, "batch_tokens")), num_workers)
    total_steps = _total_steps(training, steps_per_epoch, lambda: 0)
    if total_steps < 1:
        raise ValueError("the run has 0 steps: the dataset is empty or smaller than one batch per worker")

    storage = Path(storage_path) if storage_path else Path(
        os.environ.get("PEAGLE_HOME", "~/.cache/peagle")).expanduser() / "ray_results"
    if mlflow_tracking_uri is None:
        mlflow_tracking_uri = default_tracking_uri()
    loop_config = {
        "training": _as_dict(training),
        "drafter": dcfg.to_dict(),
        "target_dir": str(target_dir),
        "d2t": d2t, "t2d": t2d,
        "train_embed_tokens": bool(_get(spec, "train_embed_tokens", True)),
        "objective": objective_kwargs(training, spec),
        "total_steps": total_steps,
        "steps_per_epoch": steps_per_epoch if not _get(training, "max_steps") else None,
        "parallel_strategy": parallel_strategy,
        "log_every_steps": log_every_steps,
        "mlflow": ({"tracking_uri": mlflow_tracking_uri, "experiment": mlflow_experiment, "run_name": run_name}
                   if mlflow_tracking_uri else None),
        "debug": debug or {},
    }
    use_gpu = bool(_get(training, "use_gpu", False))
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config=loop_config,
        scaling_config=ray.train.ScalingConfig(num_workers=num_workers, use_gpu=use_gpu,
                                               resources_per_worker=resources_per_worker),
        run_config=ray.train.RunConfig(
            name=run_name, storage_path=str(storage),
            failure_config=ray.train.FailureConfig(max_failures=max_failures),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=num_to_keep)),
        datasets={"train": dataset},
    )
    result = trainer.fit()
    if result.checkpoint is None:
        raise RuntimeError(f"run {run_name} finished without a checkpoint under {storage}")

    drafter = Eagle3Drafter(dcfg)
    with result.checkpoint.as_directory() as d:
        drafter.load_state_dict(load_file(str(Path(d) / MODEL_FILE)), strict=True)
        state = json.loads((Path(d) / STATE_FILE).read_text())
    extra = {"method": method, "num_speculative_tokens": int(_get(spec, "num_speculative_tokens")),
             "target": target_name or hf_config.get("_name_or_path") or target_dir.name,
             "target_sha256": target_sha256, "step": state["step"], "tokens_seen": state.get("tokens_seen"),
             "run_name": run_name, "recipe": {"training": _as_dict(training), "drafter": _as_dict(spec)}}
    files = {"recipe.yaml": recipe_text} if recipe_text else None
    head = export_head(drafter, Path(out_dir) / "head", dtype=export_dtype, extra_config=extra,
                       extra_files=files, overwrite=True,
                       include_embed_tokens=bool(_get(spec, "train_embed_tokens", True)))
    rv = result.return_value or {}
    return TrainOutput(head_dir=head, checkpoint_path=result.checkpoint.path, step=int(state["step"]),
                       resumed_from_step=rv.get("resumed_from_step"), metrics=dict(result.metrics or {}),
                       return_value=result.return_value, mlflow_run_id=state.get("mlflow_run_id"))


__all__ = [
    "DataPosition", "MlflowTracker", "TrainOutput", "TrainResult", "Trainer", "build_optimizer",
    "build_scheduler", "count_tokens", "default_tracking_uri", "draft_vocab_mapping", "estimate_steps_per_epoch",
    "init_drafter_from_target", "iter_packed_batches", "load_target_embed", "load_target_lm_head",
    "load_token_counts", "lr_multiplier", "optimizer_digest", "run_train", "run_training", "train_loop_per_worker",
]
