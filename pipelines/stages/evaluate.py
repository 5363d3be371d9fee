"""Stage ``evaluate``: the trained head's acceptance length (AL) and tokens/s with real vLLM (``pipelines.evaluate``).

Measures every method x K x concurrency of the ``evaluation`` section on the first eval source
(the promotion gate compares ALs on one eval set); writes ``evaluate/table.json``, ``table.md`` and
plots. Key: evaluation section.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipelines.stages.base import Stage, StageOutput
from pipelines.stages.train import TrainOutput

log = logging.getLogger(__name__)


@dataclass
class EvaluateOutput(StageOutput):
    """``rows``: the eval table (``pipelines.evaluate`` rows); ``best_K``: ``{method: {concurrency: K}}``
    (JSON keys are strings after a reload)."""

    table: str
    rows: list[dict]
    eval_set: str
    best_K: dict[str, dict] = field(default_factory=dict)
    plots: dict[str, str] = field(default_factory=dict)

    def al_by_K(self, method: str, concurrency: int) -> dict[int, float]:
        """AL per K of ``method`` at ``concurrency``."""
        return {int(x["K"]): float(x["acceptance_length"]) for x in self.rows
                if x["method"] == method and x.get("acceptance_length") is not None
                and int(x.get("concurrency", 1)) == concurrency}


class EvaluateStage(Stage):
    name = "evaluate"
    Output = EvaluateOutput

    @staticmethod
    def check(recipe) -> None:
        methods, method = recipe.evaluation.methods, recipe.training.method
        if method in ("peagle", "eagle3") and method not in methods:
            raise ValueError(f"evaluation.methods={methods} does not measure the trained head "
                             f"(training.method={method!r}); add it")

    @staticmethod
    def sections(recipe):
        return (recipe.evaluation,)

    def run(self) -> EvaluateOutput:
        from transformers import AutoTokenizer

        from pipelines import evaluate as ev
        from pipelines.capture import resolve_target

        r = self.recipe
        head = self.ctx.upstream(TrainOutput).head_dir
        asset, _ = resolve_target(r.target)
        tok = AutoTokenizer.from_pretrained(str(asset.path))
        max_len = max(1024, r.data.max_length_tokens)
        sets = ev.load_eval_prompts(r.evaluation.sources, tok, num_prompts=r.evaluation.num_prompts, seed=r.data.seed,
                                    max_prompt_tokens=max_len - r.evaluation.max_tokens)
        eval_set, prompts = next(iter(sets.items()))
        if len(sets) > 1:
            log.warning("evaluation.sources has %d sets; the pipeline gates on the first (%s)", len(sets), eval_set)
        engine_kwargs = {"dtype": r.target.dtype, "max_model_len": max_len} | self.ctx.engine.vllm_kwargs
        report = ev.evaluate(target=asset.path, prompts=prompts, heads={r.training.method: head}, cfg=r.evaluation,
                             eval_set=eval_set, engine_kwargs=engine_kwargs, out_dir=self.dir)
        self.ctx.say(f"table {self.dir / 'table.md'}" if not self.ctx.verbose else "\n" + report.markdown)
        return EvaluateOutput(table=str(self.dir / "table.json"), rows=report.rows, eval_set=eval_set,
                              best_K=report.best_K, plots={k: str(v) for k, v in report.plots.items()})

    def is_valid(self, out: EvaluateOutput) -> bool:
        return Path(out.table).is_file() and bool(out.rows)

    def summary(self, out: EvaluateOutput) -> tuple[str, dict[str, Any]]:
        return "eval", headline(out.rows, self.recipe) | {"eval_set": out.eval_set}


def headline(rows: list[dict], recipe) -> dict[str, Any]:
    """AL per K of the trained head and its tokens/s against no speculation at the lowest concurrency."""
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
