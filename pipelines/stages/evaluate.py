"""Stage ``evaluate``: the trained head's acceptance length (AL) and tokens/s with real vLLM (``pipelines.evaluate``).

Measures every method x K x concurrency of the ``evaluation`` section on every eval source
(``pipelines.eval_prompts``: one eval set per source); the first set is the gate set (the promotion
gate compares ALs on one eval set). Writes ``evaluate/<eval_set>/`` (``table.json``, ``table.md``,
plots) per set and ``evaluate/table.json`` / ``table.md`` with the rows of every set. MT-Bench with
``turns: 2`` needs the target's answers to the first turns: a transformers engine of the target
writes them in this process (greedy) and is freed before vLLM starts. The trained method's K schedule
on the gate set (``pipelines.k_schedule``: batch-size ranges -> best measured K, K=0 where no
speculation was faster) goes into ``table.json`` and the output; register writes it on the model
version. Key: evaluation section.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from peagle_core.atomic import atomic_write_text
from pipelines.stages.base import OMIT_IF_NONE, Stage, StageOutput, write_json
from pipelines.stages.train import TrainOutput

log = logging.getLogger(__name__)


@dataclass
class EvaluateOutput(StageOutput):
    """``rows``: the eval table of every eval set (``pipelines.evaluate`` rows, tagged ``eval_set``);
    ``eval_set``: the gate set (the first eval source); ``best_K``: the gate set's
    ``{method: {concurrency: K}}`` (JSON keys are strings after a reload); ``plots``:
    ``{"<eval_set>/<plot>": PNG path}``; ``eval_sets``: every set, gate first (None in records
    written before there were several: their rows are all the gate set's); ``k_schedule``: the trained
    method's vLLM schedule ``[[batch_min, batch_max, K], ...]`` on the gate set
    (``pipelines.k_schedule.build_k_schedule``; None in records written before it existed)."""

    table: str
    rows: list[dict]
    eval_set: str
    best_K: dict[str, dict] = field(default_factory=dict)
    plots: dict[str, str] = field(default_factory=dict)
    eval_sets: list[str] | None = field(default=None, metadata=OMIT_IF_NONE)
    k_schedule: list[list[int]] | None = field(default=None, metadata=OMIT_IF_NONE)

    def set_names(self) -> list[str]:
        """The eval sets measured, gate set first."""
        return list(self.eval_sets or [self.eval_set])

    def set_rows(self, eval_set: str | None = None) -> list[dict]:
        """Rows of ``eval_set`` (default: the gate set); a row without ``eval_set`` is the gate set's."""
        name = eval_set or self.eval_set
        return [x for x in self.rows if x.get("eval_set", self.eval_set) == name]

    def al_by_K(self, method: str, concurrency: int, eval_set: str | None = None) -> dict[int, float]:
        """AL per K of ``method`` at ``concurrency`` on ``eval_set`` (default: the gate set)."""
        return {int(x["K"]): float(x["acceptance_length"]) for x in self.set_rows(eval_set)
                if x["method"] == method and x.get("acceptance_length") is not None
                and int(x.get("concurrency", 1)) == concurrency}


class EvaluateStage(Stage):
    name = "evaluate"
    Output = EvaluateOutput

    @staticmethod
    def check(recipe) -> None:
        from pipelines.eval_prompts import eval_set_name

        methods, method = recipe.evaluation.methods, recipe.training.method
        if method in ("peagle", "eagle3") and method not in methods:
            raise ValueError(f"evaluation.methods={methods} does not measure the trained head "
                             f"(training.method={method!r}); add it")
        names = [eval_set_name(s) for s in recipe.evaluation.sources]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"evaluation.sources name the eval set(s) {repeated} more than once (a set is named by "
                             "its kind or its file's stem); drop the repeats or rename the files")

    @staticmethod
    def sections(recipe):
        return (recipe.evaluation,)

    def run(self) -> EvaluateOutput:
        from transformers import AutoTokenizer

        from pipelines import evaluate as ev
        from pipelines.capture import resolve_target
        from pipelines.eval_prompts import load_eval_prompts
        from pipelines.k_schedule import schedule_or_none

        r = self.recipe
        head = self.ctx.upstream(TrainOutput).head_dir
        asset, _ = resolve_target(r.target)
        tok = AutoTokenizer.from_pretrained(str(asset.path))
        max_len = max(1024, r.data.max_length_tokens)
        with self._turn_one_engine(asset.path, max_len) as engine:
            sets = load_eval_prompts(r.evaluation.sources, tok, num_prompts=r.evaluation.num_prompts,
                                     seed=r.data.seed, max_prompt_tokens=max_len - r.evaluation.max_tokens,
                                     engine=engine, max_tokens=r.evaluation.max_tokens)
        engine_kwargs = {"dtype": r.target.dtype, "max_model_len": max_len} | self.ctx.engine.vllm_kwargs
        reports = {}
        for eval_set, prompts in sets.items():
            reports[eval_set] = ev.evaluate(target=asset.path, prompts=prompts, heads={r.training.method: head},
                                            cfg=r.evaluation, eval_set=eval_set, engine_kwargs=engine_kwargs,
                                            out_dir=self.dir / eval_set)
        gate = next(iter(reports))
        schedule = schedule_or_none(reports[gate].rows, r.training.method)
        k_schedule = [list(e) for e in schedule] if schedule is not None else None
        rows = [row for rep in reports.values() for row in rep.rows]
        markdown = "".join(f"## {name}{' (gate)' if name == gate else ''}\n\n{rep.markdown}\n"
                           for name, rep in reports.items())
        write_json(self.dir / "table.json", {"gate_eval_set": gate, "eval_sets": list(reports), "rows": rows,
                                             "best_K": {name: rep.best_K for name, rep in reports.items()},
                                             "k_schedule": {"eval_set": gate, "method": r.training.method,
                                                            "schedule": k_schedule}})
        atomic_write_text(self.dir / "table.md", markdown)
        self.ctx.say(f"table {self.dir / 'table.md'}" if not self.ctx.verbose else "\n" + markdown)
        plots = {f"{name}/{k}": str(v) for name, rep in reports.items() for k, v in rep.plots.items()}
        return EvaluateOutput(table=str(self.dir / "table.json"), rows=rows, eval_set=gate,
                              best_K=reports[gate].best_K, eval_sets=list(reports), plots=plots,
                              k_schedule=k_schedule)

    @contextlib.contextmanager
    def _turn_one_engine(self, target_path: Path, max_len: int) -> Iterator[Any]:
        """A transformers engine of the target while eval prompts load, when an MT-Bench source has
        ``turns: 2`` (it answers the first turns); else None. Freed on exit, before vLLM starts."""
        if not any(s.kind == "mtbench" and s.turns == 2 for s in self.recipe.evaluation.sources):
            yield None
            return
        import torch

        from pipelines.engines import make_engine

        engine = make_engine("transformers", target_path, dtype=self.recipe.target.dtype, max_model_len=max_len,
                             name=self.recipe.target.model)
        try:
            yield engine
        finally:
            del engine
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def is_valid(self, out: EvaluateOutput) -> bool:
        return Path(out.table).is_file() and bool(out.rows)

    def summary(self, out: EvaluateOutput) -> tuple[str, dict[str, Any]]:
        by_set = {name: headline(out.set_rows(name), self.recipe) for name in out.set_names()}
        return "eval", headline(out.set_rows(), self.recipe) | {
            "eval_set": out.eval_set,
            "by_eval_set": {name: {k: h[k] for k in ("none_tokens_per_s", "per_K")} for name, h in by_set.items()},
        }


def headline(rows: list[dict], recipe) -> dict[str, Any]:
    """AL per K of the trained head and its tokens/s against no speculation at the lowest concurrency
    (``rows`` of one eval set)."""
    c = min(recipe.evaluation.concurrency_sweep)
    method = recipe.training.method
    base = next((x for x in rows if x["method"] == "none" and int(x.get("concurrency", 1)) == c), None)
    per_K = {}
    for x in rows:
        if x["method"] == method and int(x.get("concurrency", 1)) == c:
            speedup = (x["tokens_per_s"] / base["tokens_per_s"]
                       if base and base.get("tokens_per_s") and x.get("tokens_per_s") else None)
            per_K[int(x["K"])] = {"acceptance_length": x.get("acceptance_length"),
                                  "tokens_per_s": x.get("tokens_per_s"), "speedup": speedup}
    return {"method": method, "concurrency": c,
            "none_tokens_per_s": base.get("tokens_per_s") if base else None, "per_K": per_K}
