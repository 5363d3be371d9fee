"""Stage ``regenerate``: the recipe's prompt sources -> the target's own answers (``pipelines.data.regenerate``).

Loads and mixes the prompt sources (``pipelines.data.prompt_dataset``; a self_instruct source's prompts are
written first by the target, ``pipelines.data.selfinstruct.SelfInstructWriter``, on the stage's engine pool),
then writes ``regenerate/conversations.jsonl`` (train split) and ``regenerate/heldout_ids.json`` (the held-out
prompt ids). With ``regenerate.enabled: false`` the sources' own answers are written as is.
Key: target (minus ``aux_layer_ids``, which do not change the text), data, regenerate.

Parts (``pipelines.data.parts``): a killed run resumes from what the one before it finished, kept under the stage's
directory until its output is written: each self_instruct source's raw completions in
``self_instruct-parts-<key>`` (:meth:`RegenerateStage.self_instruct_parts`) and the regenerated batches in
``parts-<stage key>``.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from peagle_core.atomic import atomic_write_text
from pipelines.data.parts import REGENERATE_PARTS, SELF_INSTRUCT_PARTS
from pipelines.preflight import Machine, Problem, Severity
from pipelines.stages.base import (
    OMIT_IF_NONE,
    Stage,
    StageOutput,
    cpus_per_worker,
    digest,
    key_dump,
    write_json,
)

log = logging.getLogger(__name__)
# regenerate fields that only shape the answers (or where the engines run), not the self-instruct completions
ANSWER_ONLY_FIELDS = frozenset({"enabled", "temperature", "top_p", "max_tokens_per_turn", "max_turns", "num_workers",
                                "engines_per_gpu", "vllm_runner"})


@dataclass
class RegenerateOutput(StageOutput):
    """``path``: the conversations JSONL; engine statistics when ``regenerated``; ``self_instruct``: the
    counts of each self_instruct source's prompt writer, in source order (``pipelines.data.selfinstruct``:
    generated, filtered, deduplicated, kept, ...), None without such a source."""

    path: str
    num_conversations: int
    regenerated: bool
    num_turns: int | None = field(default=None, metadata=OMIT_IF_NONE)
    num_generated_tokens: int | None = field(default=None, metadata=OMIT_IF_NONE)
    tokens_per_s: float | None = field(default=None, metadata=OMIT_IF_NONE)
    wall_tokens_per_s: float | None = field(default=None, metadata=OMIT_IF_NONE)
    # the engines that answered (RegenerateResult.engines: start seconds, GPU) and all engines' tokens/s from the
    # first engine ready to the last answer (RegenerateResult.decode_tokens_per_s)
    engines: list[dict] | None = field(default=None, metadata=OMIT_IF_NONE)
    decode_tokens_per_s: float | None = field(default=None, metadata=OMIT_IF_NONE)
    self_instruct: list[dict] | None = field(default=None, metadata=OMIT_IF_NONE)
    # tokens per conversation (pipelines.data.lengths), from a seeded sample of them
    length_distribution: dict | None = field(default=None, metadata=OMIT_IF_NONE)

    def rows(self) -> list[dict]:
        """The conversations (``id, messages, source``, ...) in file order."""
        return [json.loads(line) for line in Path(self.path).read_text().splitlines() if line.strip()]


class RegenerateStage(Stage):
    name = "regenerate"
    Output = RegenerateOutput

    @staticmethod
    def num_gpus(recipe) -> tuple[int, str]:
        r = recipe.regenerate
        if recipe.training.use_gpu and r.enabled and r.backend == "vllm":
            if r.engines_per_gpu > 1:
                return (-(-r.num_workers // r.engines_per_gpu),
                        f"{r.engines_per_gpu} vLLM engines each, regenerate.num_workers={r.num_workers}")
            return r.num_workers, f"one per vLLM engine, regenerate.num_workers={r.num_workers}"
        return 0, ""

    @classmethod
    def preflight(cls, recipe, machine: Machine) -> list[Problem]:
        """Also: the engine of ``regenerate.backend`` (when regenerating: it also writes self_instruct prompts)
        and the user files of ``data.sources``."""
        from pipelines.data.engines import ENGINES

        problems = super().preflight(recipe, machine)
        r = recipe.regenerate
        if r.enabled:
            problems += cls.choice_problems("regenerate.backend", r.backend, ENGINES, machine)
        if r.engines_per_gpu > 1 and (r.backend, r.vllm_runner) != ("vllm", "actor"):
            problems.append(cls.problem(
                Severity.INVALID, f"regenerate.engines_per_gpu={r.engines_per_gpu} shares a GPU between vLLM engine "
                f"actors: it needs backend=vllm and vllm_runner=actor (got {r.backend}, {r.vllm_runner})",
                field="regenerate.engines_per_gpu"))
        if r.static_cache and r.backend != "transformers":
            log.warning("regenerate.static_cache is a transformers engine setting: ignored with backend=%s", r.backend)
        return problems + cls.source_problems("data.sources", recipe.data.sources, machine)

    @staticmethod
    def sections(recipe):
        # aux layer ids do not change the regenerated text: they key the capture only; nor does the number of
        # engines or how many share a GPU (per-request seeds): a run on 1 GPU is current for the same recipe on 4
        return (key_dump(recipe.target, exclude={"aux_layer_ids"}), recipe.data,
                key_dump(recipe.regenerate, exclude={"num_workers", "engines_per_gpu"}))

    def run(self) -> RegenerateOutput:
        from pipelines.data.engine_pool import engines_summary
        from pipelines.data.prompt_dataset import load_prompt_dataset
        from pipelines.data.prompts import train_eval_split
        from pipelines.data.regenerate import drop_summary, run_regenerate
        from pipelines.data.selfinstruct import SelfInstructWriter, summary

        r = self.recipe
        # the writer starts engines only when a self_instruct source has requests left
        writer = SelfInstructWriter(r.target, r.regenerate, r.data,
                                    num_cpus_per_worker=cpus_per_worker(r.regenerate.num_workers),
                                    engine_kwargs=dict(self.ctx.engine.vllm_kwargs),
                                    parts_dir=self.self_instruct_parts)
        with writer:  # one engine pool for every self_instruct source, ended before the regeneration's starts
            prompts = load_prompt_dataset(r.data, write_prompts=writer)
        for stats, parts_dir in zip(writer.stats, writer.parts_dirs, strict=True):
            resumed = stats.get("resumed_prompts", 0)
            self.ctx.say(f"self_instruct prompts: {summary(stats)}"
                         + (f" ({resumed} completions taken from the parts in {parts_dir})" if resumed else ""))
        written = [dict(s) for s in writer.stats] or None
        train, heldout = train_eval_split(prompts, r.data.eval_fraction, r.data.seed)
        out = self.dir / "conversations.jsonl"
        write_json(self.dir / "heldout_ids.json", [str(i) for i in heldout["id"]])
        if not r.regenerate.enabled:
            rows = train.to_list()
            atomic_write_text(out, "".join(json.dumps({k: x[k] for k in ("id", "messages", "source")}) + "\n"
                                           for x in rows))
            self._remove(writer.parts_dirs)
            return RegenerateOutput(path=str(out), num_conversations=len(rows), regenerated=False,
                                    self_instruct=written, length_distribution=self._lengths(rows))
        # finished batches are kept under the stage key: a killed job or a lost machine resumes from them
        parts = self.dir / f"{REGENERATE_PARTS}{self.ctx.key(self.name)[:12]}"
        res = run_regenerate(train, r.target, r.regenerate, r.data, out_path=out,
                             num_cpus_per_worker=cpus_per_worker(r.regenerate.num_workers),
                             engine_kwargs=dict(self.ctx.engine.vllm_kwargs), parts_dir=parts)
        if res.stats.get("resumed_conversations"):
            self.ctx.say(f"{res.stats['resumed_conversations']} conversations taken from the parts an earlier run "
                         f"wrote ({parts})")
        self._remove([parts, *writer.parts_dirs])  # the output holds them now; a forced re-run regenerates all
        self.ctx.say(f"{len(res.rows)} conversations, {res.num_turns} turns, {res.num_generated_tokens} tokens, "
                     f"{res.tokens_per_s:.1f} tokens/s (engine), {res.wall_tokens_per_s:.1f} tokens/s (wall)"
                     + engines_summary(res.engines, res.decode_tokens_per_s, asked=r.regenerate.num_workers)
                     + drop_summary(res.num_conversations, len(res.rows), res.stats))
        return RegenerateOutput(path=str(out), num_conversations=len(res.rows), regenerated=True,
                                num_turns=res.num_turns, num_generated_tokens=res.num_generated_tokens,
                                tokens_per_s=res.tokens_per_s, wall_tokens_per_s=res.wall_tokens_per_s,
                                engines=[{k: e[k] for k in ("start_s", "gpu")} for e in res.engines] or None,
                                decode_tokens_per_s=res.decode_tokens_per_s, self_instruct=written,
                                length_distribution=self._lengths(res.rows))

    def self_instruct_parts(self, cfg) -> Path:
        """``regenerate/self_instruct-parts-<key>``: where the raw completions of the self_instruct source of config
        ``cfg`` are kept (``pipelines.data.selfinstruct.write_prompts``). Key: what changes them: the target (minus
        ``aux_layer_ids``), ``data.max_length_tokens``, the engine settings of ``regenerate`` (not
        :data:`ANSWER_ONLY_FIELDS`) and ``cfg`` minus its ``FILTER_FIELDS``: a recipe that changes only the
        filters, the number of prompts, the answers or the number of engines keeps the completions written."""
        from pipelines.data.selfinstruct import FILTER_FIELDS

        r = self.recipe
        key = digest("self_instruct", key_dump(r.target, exclude={"aux_layer_ids"}), r.data.max_length_tokens,
                     key_dump(r.regenerate, exclude=ANSWER_ONLY_FIELDS), key_dump(cfg, exclude=FILTER_FIELDS))
        return self.dir / f"{SELF_INSTRUCT_PARTS}{key[:12]}"

    @staticmethod
    def _remove(parts_dirs) -> None:
        for d in parts_dirs:
            shutil.rmtree(d, ignore_errors=True)

    def _lengths(self, rows: list[dict]) -> dict | None:
        """:func:`~pipelines.data.lengths.length_distribution` of ``rows`` (a seeded sample), said on the console."""
        from transformers import AutoTokenizer

        from pipelines.assets import resolve_target
        from pipelines.data.lengths import LENGTH_THRESHOLDS, conversation_lengths, length_distribution

        if not rows:
            return None
        tokenizer = AutoTokenizer.from_pretrained(resolve_target(self.recipe.target)[0].path)
        dist = length_distribution(conversation_lengths(rows, tokenizer, seed=self.recipe.data.seed),
                                   sampled_from=len(rows))
        longest = LENGTH_THRESHOLDS[-1]
        self.ctx.say("tokens per conversation: median {p50}, p90 {p90}, max {max}; over {longest}: {over:.1%} "
                     "(of {sample} sampled)".format(**dist, longest=longest, over=dist["share_over"][str(longest)]))
        return dist

    def is_valid(self, out: RegenerateOutput) -> bool:
        p = Path(out.path)
        return p.is_file() and sum(1 for _ in p.open()) == out.num_conversations > 0
