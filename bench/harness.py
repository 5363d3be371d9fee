"""Training through the product, in this process (a GPU box without Ray or MLflow): a recipe with ``--set``
overrides -> the train stage's plan -> its drafter -> its objective -> ``pipelines.train.train_in_process``.

What the train stage does, step for step (``pipelines.stages.train`` + ``pipelines.train.worker``):

* :func:`bench_recipe`: ``pipelines.recipe.load_recipe(path, overrides)``; on a machine without CUDA the target
  and capture run in float32 and the objective uses dense attention (``--set`` overrides, recorded);
* :func:`build_head`: the conversations tokenized once as capture tokenizes them (``pipelines.capture.tokenize_rows``),
  ``pipelines.train.plan_from_tokenized`` (= ``plan_from_conversations``: drafter config from the recipe's
  ``drafter`` section, d2t/t2d from the assistant-token counts, epoch length), then ``pipelines.train.build_drafter``
  (vocabulary mapping, init from the target, frozen embeddings unless ``drafter.train_embed_tokens``) and
  ``peagle_core.objectives.objective_class(method)(plan.objective)``; :func:`prepare` adds the target for the
  online capture;
* :meth:`OnlineRun.samples_for_epoch`: streaming capture of those tokenized rows with
  ``pipelines.capture.capture_tokenized`` and the recipe's ``capture`` section, the target loaded by
  ``pipelines.capture.load_target`` (the capture stage's actor does the same per batch); an epoch is a sequence,
  captured a chunk at a time when read, so a resume runs the target only from its data position on;
* :meth:`OnlineRun.train`: ``pipelines.train.train_in_process`` with the plan's ``training`` section;
* :meth:`OnlineRun.export`: ``peagle_core.contract.export_head`` with the metadata the train stage writes.

Shape legend: V target vocab, Ht target hidden.
"""

from __future__ import annotations

import copy
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

CPU_OVERRIDES = ("target.dtype=float32", "capture.dtype=float32", "training.attention=dense")
# the recipe fields a result row records (resolved values, after the overrides)
RECORDED_FIELDS = ("drafter.num_layers", "drafter.num_speculative_tokens", "drafter.draft_vocab_size",
                   "drafter.train_embed_tokens", "training.batch_tokens", "training.lr", "training.warmup_steps",
                   "training.ttt_steps", "data.max_length_tokens")


def bench_recipe(path: str | Path, overrides: Sequence[str] = ()):
    """The recipe at ``path`` with ``overrides`` (``section.field=value``), plus :data:`CPU_OVERRIDES` when
    there is no CUDA device.

    Raises:
        ValueError: an override the recipe schema rejects (``pipelines.recipe.load_recipe``).
    """
    from pipelines.recipe import load_recipe

    return load_recipe(path, list(overrides) + ([] if torch.cuda.is_available() else list(CPU_OVERRIDES)))


def resolved(recipe, fields: Sequence[str] = RECORDED_FIELDS) -> dict[str, Any]:
    """``{"section.field": value}`` of ``recipe`` for ``fields`` (what a result row records)."""
    out = {}
    for name in fields:
        section, key = name.split(".", 1)
        out[name] = getattr(getattr(recipe, section), key)
    return out


class CapturedEpoch(Sequence):
    """One epoch's samples in its order, captured by the target ``chunk`` samples at a time when first read
    (``pipelines.capture.capture_tokenized``): the trainer enters a sequence at a resume's data position
    (``pipelines.train.loop.Trainer._remaining``), so the samples before it are never captured. Chunks are cut at
    fixed indices of the epoch, so a resumed run captures the same batches as an uninterrupted one.

    Items: ``{sample_id, input_ids int32 [N], loss_mask uint8 [N], aux [N, 3*Ht], final_hidden [N, Ht]}``.

    Raises:
        IndexError: an index outside the epoch.
        RuntimeError: capture returned another number of samples than it was given.
    """

    def __init__(self, run: OnlineRun, order: list[int]) -> None:
        self.run, self.order = run, order
        self._chunk_index, self._chunk = -1, []

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, i: int) -> dict:
        from pipelines.capture import capture_tokenized
        from pipelines.capture.forward import pad_id

        if not 0 <= i < len(self.order):
            raise IndexError(f"sample {i} of an epoch of {len(self.order)}")
        run, c = self.run, i // self.run.chunk
        if c != self._chunk_index:
            tokenized = [run.samples[j] for j in self.order[c * run.chunk:(c + 1) * run.chunk]]
            self._chunk = capture_tokenized(run.model, tokenized, run.recipe.capture, run.plan.drafter.aux_layer_ids,
                                            pad_token_id=pad_id(run.tokenizer),
                                            max_length_tokens=run.recipe.data.max_length_tokens, stats=run.stats,
                                            validate=False)
            if len(self._chunk) != len(tokenized):
                raise RuntimeError(f"capture returned {len(self._chunk)} samples for {len(tokenized)} rows")
            self._chunk_index = c
        return self._chunk[i - c * run.chunk]


@dataclass
class OnlineRun:
    """One training run's pieces, built by :func:`prepare`: the recipe and plan, the drafter and the target's
    ``lm_head [V, Ht]``, the objective, the target (model, tokenizer) for the online capture, the tokenized
    conversations (:attr:`Head.samples`) with the index of each one's row among the ``num_rows`` conversations
    given, the capture's counters."""

    recipe: Any
    plan: Any
    drafter: Any
    lm_head: torch.Tensor
    objective: Any
    model: Any
    tokenizer: Any
    samples: list[dict]
    sample_rows: list[int]
    num_rows: int
    chunk: int = 256
    stats: Counter = field(default_factory=Counter)

    @property
    def device(self) -> str:
        return "cuda" if torch.cuda.is_available() else "cpu"

    def samples_for_epoch(self, epoch: int) -> CapturedEpoch:
        """A seeded permutation of the conversations (the same order for the same epoch, so a resume skips exactly
        the samples trained; the conversations tokenization dropped left out), captured as it is read."""
        perm = torch.randperm(self.num_rows, generator=torch.Generator().manual_seed(epoch)).tolist()
        sample_of = {row: k for k, row in enumerate(self.sample_rows)}
        return CapturedEpoch(self, [sample_of[i] for i in perm if i in sample_of])

    def train(self, max_steps: int, *, drafter=None, update: dict | None = None, **kwargs):
        """``train_in_process`` for ``max_steps`` steps (the cosine horizon) on the plan's ``training`` section
        (with ``update``); ``drafter`` (default this run's) and ``kwargs`` (``checkpoint_dir``, ``on_log``,
        ``callbacks``, ...) as ``pipelines.train.train_in_process`` takes them."""
        from pipelines.train import train_in_process

        config = self.plan.training.model_copy(update={"max_steps": max_steps, **(update or {})})
        return train_in_process(self.samples_for_epoch, self.drafter if drafter is None else drafter, self.lm_head,
                                self.objective, config, steps_per_epoch=self.plan.steps_per_epoch,
                                device=self.device, **kwargs)

    def seconds_per_step(self, *, warmup_steps: int, timed_steps: int) -> float:
        """Seconds per optimizer step after ``warmup_steps`` (compilation), over ``timed_steps``, on a throwaway
        copy of the drafter without learning-rate warm-up."""
        marks = {"t0": time.perf_counter()}

        def on_log(step: int, _metrics: dict) -> None:
            if step == warmup_steps:
                marks["t0"] = time.perf_counter()
            marks["t1"] = time.perf_counter()

        self.train(warmup_steps + timed_steps, drafter=copy.deepcopy(self.drafter), update={"warmup_steps": 0},
                   log_every_steps=1, on_log=on_log)
        return (marks["t1"] - marks["t0"]) / max(1, timed_steps)

    def export(self, head_dir: Path, *, step: int, extra: dict | None = None) -> Path:
        """The trained head as the train stage exports it (bfloat16, ``embed_tokens`` only when trained,
        method / K / target / recipe in ``config.json``) plus ``extra``."""
        from peagle_core.contract import export_head

        spec, training = self.plan.drafter_spec, self.plan.training
        meta = {"method": training.method, "num_speculative_tokens": spec.num_speculative_tokens,
                "target": self.plan.target_name, "target_sha256": self.plan.target_sha256, "step": step,
                "recipe": {"training": training.model_dump(mode="json"), "drafter": spec.model_dump(mode="json")}}
        return export_head(self.drafter.cpu(), head_dir, dtype="bfloat16", overwrite=True,
                           include_embed_tokens=spec.train_embed_tokens, extra_config=meta | (extra or {}),
                           extra_files={"recipe.yaml": self.recipe.dump_resolved()})


@dataclass
class Head:
    """The train stage's set-up of one head: the plan, the drafter (vocabulary mapping, target init, frozen
    embeddings unless trained), the target's ``lm_head [V, Ht]`` and the objective (rank 0's)."""

    plan: Any
    drafter: Any
    lm_head: torch.Tensor
    objective: Any
    samples: list[dict]
    sample_rows: list[int]


# fewer conversations are tokenized in this process: a worker's start (spawn, imports) costs seconds; on the busy
# 2-core CPU box 7,933 rows took 16.1 s in one process and 24.8 s in two (2026-11-25)
PARALLEL_MIN_ROWS = 20000


def _tokenize_part(tokenizer_dir: str, rows: list[dict], max_length_tokens: int | None,
                   on_too_long: str) -> list[dict]:
    from transformers import AutoTokenizer

    from pipelines.capture import tokenize_rows

    return tokenize_rows(AutoTokenizer.from_pretrained(tokenizer_dir), rows, max_length_tokens=max_length_tokens,
                         on_too_long=on_too_long)


def tokenize_in_parallel(tokenizer_dir: str, rows: list[dict], *, max_length_tokens: int | None,
                         on_too_long: str, workers: int | None = None,
                         min_rows: int = PARALLEL_MIN_ROWS) -> list[dict]:
    """``pipelines.capture.tokenize_rows`` over ``rows`` in ``workers`` processes (default: the CPU count, at most
    16), each a contiguous slice, concatenated in order: the same list as one call (the chat template is rendered
    per conversation in Python, ~1 ms each: 99k conversations took ~100 s in one process). Below ``min_rows``
    rows, or with one worker, in this process.

    Raises:
        ValueError: as ``tokenize_rows`` (a bad ``on_too_long``, no chat template).
    """
    import os
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    workers = min(16, os.cpu_count() or 1) if workers is None else workers
    if workers <= 1 or len(rows) < min_rows:
        return _tokenize_part(tokenizer_dir, rows, max_length_tokens, on_too_long)
    step = -(-len(rows) // workers)
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as ex:  # spawn: no forked tokenizer threads
        parts = ex.map(_tokenize_part, [tokenizer_dir] * workers, [rows[i:i + step] for i in range(0, len(rows), step)],
                       [max_length_tokens] * workers, [on_too_long] * workers)
        return [s for part in parts for s in part]


def build_head(recipe, rows: list[dict], *, always_keep: Sequence[int] = ()) -> Head:
    """:class:`Head` for ``rows`` (``{id, messages}``: what the draft vocabulary is counted on) under ``recipe``:
    the rows tokenized once (:func:`tokenize_in_parallel` with ``data.max_length_tokens`` and
    ``capture.on_too_long``; kept as :attr:`Head.samples`, ``{sample_id, input_ids int32 [N], loss_mask uint8 [N]}``,
    with :attr:`Head.sample_rows`, each one's index in ``rows``), ``plan_from_tokenized``, ``build_drafter`` after
    the worker's seed, ``objective_class(method)``.

    Raises:
        ValueError: the recipe does not fit the target (``pipelines.train.plan_from_tokenized``), or the target
            tokenizer has no chat template.
    """
    from peagle_core.objectives import objective_class
    from pipelines.assets import resolve_target
    from pipelines.capture import row_sample_id
    from pipelines.capture.rows import SAMPLE_ID
    from pipelines.train import build_drafter, plan_from_tokenized

    samples = tokenize_in_parallel(str(resolve_target(recipe.target)[0].path), rows,
                                   max_length_tokens=recipe.data.max_length_tokens,
                                   on_too_long=recipe.capture.on_too_long)
    sample_rows, j = [], 0  # tokenization keeps the rows' order and drops some: walk both
    for i, row in enumerate(rows):
        if j < len(samples) and samples[j][SAMPLE_ID] == row_sample_id(row):
            sample_rows.append(i)
            j += 1
    plan = plan_from_tokenized(recipe.training, recipe.drafter, recipe.target, samples,
                               always_keep_token_ids=always_keep)
    torch.manual_seed(recipe.training.seed)  # the worker's init seed
    drafter, lm_head = build_drafter(plan)
    return Head(plan=plan, drafter=drafter, lm_head=lm_head,
                objective=objective_class(recipe.training.method)(plan.objective), samples=samples,
                sample_rows=sample_rows)


def load_recipe_target(recipe):
    """``(model, tokenizer)`` of the recipe's target at ``target.dtype`` (``pipelines.capture.load_target``, on
    CUDA when there is one), as the capture stage loads it."""
    from pipelines.assets import resolve_target
    from pipelines.capture import load_target

    asset, _ = resolve_target(recipe.target)
    return load_target(str(asset.path), recipe.target.dtype)


def special_ids(tokenizer) -> list[int]:
    """The eos and pad ids a draft vocabulary always keeps."""
    return [i for i in (tokenizer.eos_token_id, tokenizer.pad_token_id) if i is not None]


def prepare(recipe, rows: list[dict], *, chunk: int = 256) -> OnlineRun:
    """:func:`build_head` for ``rows`` and the target for their online capture (the draft vocabulary keeps the
    tokenizer's eos and pad ids)."""
    model, tok = load_recipe_target(recipe)
    return online_run(recipe, build_head(recipe, rows, always_keep=special_ids(tok)), model, tok, len(rows),
                      chunk=chunk)


def online_run(recipe, head: Head, model, tokenizer, num_rows: int, *, chunk: int = 256) -> OnlineRun:
    """:class:`OnlineRun` of ``head`` (built by :func:`build_head` on ``num_rows`` conversations) and the target."""
    return OnlineRun(recipe=recipe, plan=head.plan, drafter=head.drafter, lm_head=head.lm_head,
                     objective=head.objective, model=model, tokenizer=tokenizer, samples=head.samples,
                     sample_rows=head.sample_rows, num_rows=num_rows, chunk=chunk)
