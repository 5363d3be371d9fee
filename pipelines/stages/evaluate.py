"""Stage ``evaluate``: the trained head's acceptance length (AL) and tokens/s with real vLLM (``pipelines.evaluate.measure``).

Measures every method x K x concurrency of the ``evaluation`` section on every eval source
(``pipelines.evaluate.prompts``: one eval set per source); the gate set
(``RegistryConfig.resolved_gate_eval_set``: ``registry.gate_eval_set``, else the held-out traffic set
when there is one, else the first set) is where the promotion gate compares ALs, listed first. Writes
``evaluate/<eval_set>/`` (``table.json``, ``table.md``, plots) per set and ``evaluate/table.json`` /
``table.md`` with the rows of every set.

Champion vs challenger (``EvalConfig.compares_champion``: ``evaluation.compare_champion``, by default on
for a warm start from the registry): the registry's ``champion`` of the recipe's model is resolved once
per pipeline run, when the stage is built, to a version and its ``head_sha256`` (both in this stage's
key: a re-run against the same champion is skipped, a promotion re-keys it), downloaded to
``evaluate/champion_head/`` and measured by the same ``pipelines.evaluate.measure.evaluate`` call as the
trained head on every set (rows ``method: champion``). The register stage's gate then uses the
champion's AL from this table. MT-Bench with
``turns: 2`` needs the target's answers to the first turns: a transformers engine of the target
writes them in this process (greedy) and is freed before vLLM starts. The trained method's K schedule
on the gate set (``pipelines.evaluate.k_schedule``: batch-size ranges -> best measured K, K=0 where no
speculation was faster) goes into ``table.json`` and the output; register writes it on the model
version. Key: evaluation section (plus the gate set when it is not the first set, and the champion
version and head_sha256 when comparing).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipelines.preflight import Machine, Problem, Severity
from pipelines.stages.base import OMIT_IF_NONE, Stage, StageOutput
from pipelines.stages.train import TrainOutput

CHAMPION_HEAD_DIR = "champion_head"  # under the stage directory: the champion's head, downloaded

log = logging.getLogger(__name__)


@dataclass
class EvaluateOutput(StageOutput):
    """``rows``: the eval table of every eval set (``pipelines.evaluate.measure`` rows, tagged ``eval_set``);
    ``eval_set``: the gate set (the first eval source); ``best_K``: the gate set's
    ``{method: {concurrency: K}}`` (JSON keys are strings after a reload); ``plots``:
    ``{"<eval_set>/<plot>": PNG path}``; ``eval_sets``: every set, gate first (None in records
    written before there were several: their rows are all the gate set's); ``k_schedule``: the trained
    method's vLLM schedule ``[[batch_min, batch_max, K], ...]`` on the gate set
    (``pipelines.evaluate.k_schedule.build_k_schedule``; None in records written before it existed);
    ``champion``: the registry champion measured beside the trained head (rows ``method: champion``),
    ``{"model", "version", "head_sha256", "method"}``, or ``{"model", "version": None}`` when the
    comparison was on but there was no champion; None when the comparison was off."""

    table: str
    rows: list[dict]
    eval_set: str
    best_K: dict[str, dict] = field(default_factory=dict)
    plots: dict[str, str] = field(default_factory=dict)
    eval_sets: list[str] | None = field(default=None, metadata=OMIT_IF_NONE)
    k_schedule: list[list[int]] | None = field(default=None, metadata=OMIT_IF_NONE)
    champion: dict[str, Any] | None = field(default=None, metadata=OMIT_IF_NONE)

    def set_names(self) -> list[str]:
        """The eval sets measured, gate set first."""
        return list(self.eval_sets or [self.eval_set])

    def set_rows(self, eval_set: str | None = None) -> list[dict]:
        """Rows of ``eval_set`` (default: the gate set); a row without ``eval_set`` is the gate set's."""
        name = eval_set or self.eval_set
        return [x for x in self.rows if x.get("eval_set", self.eval_set) == name]

    def measured_champion(self, *, gate_K: int, concurrency: int):
        """The champion as this run measured it on its gate set (``pipelines.registry.promotion.MeasuredChampion``:
        version and AL at ``gate_K`` and ``concurrency``), or None when the stage did not compare (the gate then
        reads the champion's registered AL)."""
        from pipelines.evaluate.measure import CHAMPION_LABEL
        from pipelines.registry.promotion import MeasuredChampion

        if self.champion is None:
            return None
        version = self.champion.get("version")
        al = self.al_by_K(CHAMPION_LABEL, concurrency, eval_set=self.eval_set).get(gate_K) if version is not None \
            else None
        return MeasuredChampion(version=str(version) if version is not None else None, al=al, eval_set=self.eval_set)

    def al_by_K(self, method: str, concurrency: int, eval_set: str | None = None) -> dict[int, float]:
        """AL per K of ``method`` at ``concurrency`` on ``eval_set`` (default: the gate set)."""
        return {int(x["K"]): float(x["acceptance_length"]) for x in self.set_rows(eval_set)
                if x["method"] == method and x.get("acceptance_length") is not None
                and int(x.get("concurrency", 1)) == concurrency}


class EvaluateStage(Stage):
    name = "evaluate"
    Output = EvaluateOutput

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self._compares = ctx.recipe.evaluation.compares_champion(ctx.recipe.training)
        # the champion pinned once per run (version + head_sha256): the key and the download agree
        self._champion = self._pin_champion() if self._compares else None

    @staticmethod
    def requirements(recipe) -> tuple[str, ...]:
        return ("vllm",) + (("mlflow",) if recipe.evaluation.compares_champion(recipe.training) else ())

    @staticmethod
    def num_gpus(recipe) -> tuple[int, str]:
        return (1, "its vLLM engines run with GPU settings") if recipe.training.use_gpu else (0, "")

    @classmethod
    def preflight(cls, recipe, machine: Machine) -> list[Problem]:
        """Also: the trained method is measured, eval set names are distinct, user files of
        ``evaluation.sources`` are there."""
        problems = super().preflight(recipe, machine)
        methods, method = recipe.evaluation.methods, recipe.training.method
        if method not in methods:
            problems.append(cls.problem(Severity.INVALID, f"evaluation.methods={methods} does not measure the trained "
                                        f"head (training.method={method!r}); add it", "evaluation.methods"))
        names = [s.eval_set_name() for s in recipe.evaluation.sources]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            problems.append(cls.problem(
                Severity.INVALID, f"evaluation.sources name the eval set(s) {repeated} more than once (a set is named "
                "by its kind or its file's stem); drop the repeats or rename the files", "evaluation.sources"))
        return problems + cls.source_problems("evaluation.sources", recipe.evaluation.sources, machine)

    def sections(self, recipe):
        parts: list[Any] = [recipe.evaluation]
        gate = recipe.registry.resolved_gate_eval_set(recipe.evaluation)
        if gate != recipe.evaluation.sources[0].eval_set_name():  # the gate set orders the table, picks the schedule
            parts.append({"gate_eval_set": gate})
        if self._compares:
            parts.append({"champion": self._champion.key() if self._champion is not None
                          else {"model": self.ctx.model_name, "version": None}})
        if recipe.serving.engine_kwargs:  # what is measured runs with the served engine's settings
            parts.append({"engine_kwargs": recipe.serving.engine_kwargs})
        return tuple(parts)

    def run(self) -> EvaluateOutput:
        from transformers import AutoTokenizer

        from pipelines.assets import resolve_target
        from pipelines.evaluate import measure as ev
        from pipelines.evaluate.prompts import first_turn_engine, load_eval_prompts
        from pipelines.evaluate.report import write_sets_table

        r = self.recipe
        head = self.ctx.upstream(TrainOutput).head_dir
        gate = r.registry.resolved_gate_eval_set(r.evaluation)
        champion_head, champion = self._fetch_champion()
        asset, _ = resolve_target(r.target)
        tok = AutoTokenizer.from_pretrained(str(asset.path))
        max_len = max(1024, r.data.max_length_tokens)
        with first_turn_engine(r.evaluation.sources, asset.path, dtype=r.target.dtype, max_model_len=max_len,
                               name=r.target.model) as engine:
            sets = load_eval_prompts(r.evaluation.sources, tok, num_prompts=r.evaluation.num_prompts,
                                     seed=r.data.seed, max_prompt_tokens=max_len - r.evaluation.max_tokens,
                                     engine=engine, max_tokens=r.evaluation.max_tokens)
        engine_kwargs = self.ctx.engine.drafting_engine_kwargs(dtype=r.target.dtype, max_model_len=max_len)
        champion_kw = {"champion_head": champion_head, "champion_method": champion["method"]} if champion_head else {}
        reports = {}
        for eval_set in sorted(sets, key=lambda name: name != gate):  # the gate set first
            reports[eval_set] = ev.evaluate(target=asset.path, prompts=sets[eval_set],
                                            heads={r.training.method: head}, cfg=r.evaluation, eval_set=eval_set,
                                            engine_kwargs=engine_kwargs, out_dir=self.dir / eval_set,
                                            on_gpus=self.ctx.engine.use_gpu, **champion_kw)
        table = write_sets_table(reports, gate=gate, method=r.training.method, champion=champion, out_dir=self.dir)
        self.ctx.say(f"table {self.dir / 'table.md'}" if not self.ctx.verbose else "\n" + table.markdown)
        return EvaluateOutput(table=str(self.dir / "table.json"), rows=table.rows, eval_set=gate,
                              best_K=reports[gate].best_K, eval_sets=list(reports), plots=table.plots,
                              k_schedule=table.schedule, champion=champion)

    def _pin_champion(self):
        """The registry's ``champion`` of the recipe's model pinned to its version and ``head_sha256`` (a
        ``pipelines.train.warm_start.InitHead``: ``fetch_init_head`` downloads it), or None when no version
        holds the alias (or the model is not registered yet).

        Raises:
            pipelines.registry.client.TrackingUnreachableError: an ``http(s)://`` tracking server that does not
                answer.
        """
        from pipelines.registry.client import tracking_guard
        from pipelines.registry.promotion import CHAMPION
        from pipelines.registry.refs import HeadRef
        from pipelines.train.warm_start import InitHead

        champion = HeadRef(self.ctx.model_name, alias=CHAMPION)
        with tracking_guard(self.ctx.tracking_uri, hint="evaluation.compare_champion needs the registry: start it, "
                            "or set evaluation.compare_champion: false") as uri:
            pinned = champion.resolve(uri, missing_ok=True)
        return InitHead.from_registry(str(champion), pinned) if pinned is not None else None

    def _fetch_champion(self) -> tuple[str | None, dict[str, Any] | None]:
        """``(local head dir, EvaluateOutput.champion)`` of the pinned champion: ``(None, None)`` when not
        comparing, ``(None, {"model", "version": None})`` when there is no champion.

        Raises:
            ValueError / peagle_core.contract.HeadContractError: the download fails its digest, checksums
                or the contract (``pipelines.train.warm_start.fetch_init_head``).
        """
        if not self._compares:
            return None, None
        if self._champion is None:
            self.ctx.say(f"no champion of {self.ctx.model_name} yet: measuring the trained head only")
            return None, {"model": self.ctx.model_name, "version": None}

        from pipelines.registry.register import head_method
        from pipelines.train.warm_start import fetch_init_head

        init = fetch_init_head(self._champion, self.dir / CHAMPION_HEAD_DIR, tracking_uri=self.ctx.tracking_uri)
        method = head_method(init.head_dir)
        self.ctx.say(f"champion {init.describe()} ({method}) measured beside the trained head")
        return init.head_dir, {**init.key(), "method": method}

    def is_valid(self, out: EvaluateOutput) -> bool:
        return Path(out.table).is_file() and bool(out.rows)

    def summary(self, out: EvaluateOutput) -> tuple[str, dict[str, Any]]:
        from pipelines.evaluate.measure import CHAMPION_LABEL
        from pipelines.evaluate.report import headline

        method, c = self.recipe.training.method, min(self.recipe.evaluation.concurrency_sweep)
        by_set = {name: headline(out.set_rows(name), method, c) for name in out.set_names()}
        s = headline(out.set_rows(), method, c) | {
            "eval_set": out.eval_set,
            "by_eval_set": {name: {k: h[k] for k in ("none_tokens_per_s", "per_K")} for name, h in by_set.items()},
        }
        if out.champion is not None:  # the champion's AL per K on each set, beside the trained head's
            s["champion"] = out.champion | {"al_by_K": {name: out.al_by_K(CHAMPION_LABEL, c, eval_set=name)
                                                        for name in out.set_names()}}
        return "eval", s
