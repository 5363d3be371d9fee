"""Issue 16 item 5: the ``make demo`` head meets a shifted workload; the refresh job adapts it.

The demo head (``configs/smollm2-135m-cpu.yaml``) is trained on code (code-related ShareGPT conversations until
2026-12-07, python_functions prompts since) and evaluated on HumanEval. The shifted workload is the reverse: chat.
Its prompts are ShareGPT first user turns that ``bench.common.CODE_TOPIC_REGEX`` (the demo's ShareGPT filter then)
does *not* select, so none of them is in the demo's training data, and the refresh recipe's replay share (the
demo's code prompts) does not contain them either.
They are sent greedy (``temperature: 0``) to the demo endpoint with the traffic log on, so the served
answers are training rows as they are (no regeneration).

The run of 2026-11-24 (its results in ``bench/results/shifted_traffic.json``, section in
``docs/benchmarks.md``)::

    make demo JOB_ARGS="--set 'serving.traffic_log={}'"
    python -m bench.shifted_traffic send --num-prompts 200 --concurrency 8
    make demo RECIPE=configs/smollm2-135m-cpu-refresh.yaml        # the refresh job on the same Ray head
    python -m bench.shifted_traffic record --label "refresh (warm start, 320 steps)"
    make demo RECIPE=configs/smollm2-135m-cpu-refresh.yaml JOB_ARGS="--set training.init_from=null \
        --set training.max_steps=40 --set 'evaluation.methods=[peagle]' --set 'evaluation.sources=[{kind: traffic}]'"
    python -m bench.shifted_traffic record --label "worse challenger (random init, 40 steps)"
    python -m bench.shifted_traffic report                       # the table, to stdout

No request reached the endpoint between ``send`` and the refresh runs, so the traffic source's ``until``
stays unset (the split is the same in every stage and both runs).

``record`` copies ``$PEAGLE_HOME/runs/<recipe>/evaluate/table.json`` and ``summary.json``'s gate decision
into ``bench/results/shifted_traffic.json`` under ``--label`` (a second refresh overwrites the run dir).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.common import CODE_TOPIC_REGEX, RESULTS, environment

ROOT = Path(__file__).resolve().parents[1]
DEMO_RECIPE = ROOT / "configs" / "smollm2-135m-cpu.yaml"
REFRESH_RECIPE = ROOT / "configs" / "smollm2-135m-cpu-refresh.yaml"
RESULT = RESULTS / "shifted_traffic.json"
MAX_PROMPT_CHARS = 600  # short chat turns: the refresh recipe keeps 448 tokens, answers take up to 128


def chat_prompts(num_prompts: int, seed: int) -> list[str]:
    """``num_prompts`` distinct ShareGPT first user turns (at most ``MAX_PROMPT_CHARS``) that
    ``CODE_TOPIC_REGEX`` does not match, in a seeded random order."""
    import random

    from pipelines.data.prompts import load_conversations
    from pipelines.recipe import SourceConfig

    code = re.compile(CODE_TOPIC_REGEX)
    rows = load_conversations(SourceConfig(kind="sharegpt"), on_bad_row="skip")["messages"]
    firsts = dict.fromkeys(m[0]["content"].strip() for m in rows if m and m[0]["role"] == "user")
    chat = [p for p in firsts if p and len(p) <= MAX_PROMPT_CHARS and not code.search(p)]
    random.Random(seed).shuffle(chat)
    if len(chat) < num_prompts:
        raise ValueError(f"only {len(chat)} chat prompts of <= {MAX_PROMPT_CHARS} characters; asked for {num_prompts}")
    return chat[:num_prompts]


def send(url: str, prompts: list[str], *, model: str, concurrency: int, max_tokens: int) -> dict[str, Any]:
    """Greedy chat requests to ``url``'s ``/v1/chat/completions``, ``concurrency`` at a time; per-request
    seconds and completion tokens, and the served head from peagle's ``x-peagle-served`` header."""
    import httpx

    from pipelines.serve.ingress import SERVED_HEADER

    def one(prompt: str) -> dict[str, Any]:
        body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                "temperature": 0}
        t0 = time.perf_counter()
        try:
            r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
            ok = r.status_code == 200
            usage = r.json().get("usage", {}) if ok else {}
            served = json.loads(r.headers.get(SERVED_HEADER) or "null")
            why = "" if ok else f"HTTP {r.status_code}: {r.text[:200]}"
        except httpx.HTTPError as e:
            ok, usage, served, why = False, {}, None, f"{type(e).__name__}: {e}"
        return {"ok": ok, "why": why, "s": time.perf_counter() - t0,
                "completion_tokens": usage.get("completion_tokens", 0), "served": served}

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, prompts))
    wall = time.perf_counter() - t0
    failed = [r for r in results if not r["ok"]]
    tokens = sum(r["completion_tokens"] for r in results)
    return {
        "num_requests": len(results), "num_failed": len(failed), "failures": [r["why"] for r in failed[:5]],
        "wall_s": round(wall, 1), "completion_tokens": tokens, "output_tokens_per_s": round(tokens / wall, 1),
        "median_request_s": round(statistics.median(r["s"] for r in results), 2),
        "served_heads": sorted({(r["served"] or {}).get("head") or "none" for r in results}),
        "finished_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def load_result() -> dict[str, Any]:
    return json.loads(RESULT.read_text()) if RESULT.exists() else {"runs": {}}


def save_result(data: dict[str, Any]) -> None:
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps({**data, "environment": environment()}, indent=2))


def record(label: str, recipe: Path) -> dict[str, Any]:
    """The refresh run's eval rows (method, eval_set, K, AL, tokens/s) and gate decision under ``label``."""
    from pipelines import settings
    from pipelines.recipe import load_recipe

    run = settings.run_dir(load_recipe(recipe).name)
    rows = json.loads((run / "evaluate" / "table.json").read_text())["rows"]
    summary = json.loads((run / "summary.json").read_text())
    keep = ("method", "eval_set", "K", "concurrency", "num_prompts", "acceptance_length", "al_per_pos", "tokens_per_s",
            "speedup")
    return {"rows": [{k: r.get(k) for k in keep} for r in rows], "gate": summary.get("mlflow", {}),
            "stages": {k: v.get("status") for k, v in summary.get("stages", {}).items()},
            "recorded_at": datetime.now(UTC).isoformat(timespec="seconds")}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("send", help="send the shifted (chat) workload to the demo endpoint")
    s.add_argument("--url", default=None, help="default: the demo recipe's serving host:port")
    s.add_argument("--num-prompts", type=int, default=240)
    s.add_argument("--concurrency", type=int, default=4)
    s.add_argument("--max-tokens", type=int, default=128)
    s.add_argument("--seed", type=int, default=0)
    r = sub.add_parser("record", help="copy the refresh run's eval table and gate decision into the result file")
    r.add_argument("--label", required=True)
    r.add_argument("--recipe", type=Path, default=REFRESH_RECIPE)
    sub.add_parser("report", help="print the before/after table of the result file")
    args = ap.parse_args(argv)

    data = load_result()
    if args.cmd == "send":
        from pipelines.recipe import load_recipe

        demo = load_recipe(DEMO_RECIPE)
        url = args.url or f"http://{demo.serving.host}:{demo.serving.port}"
        prompts = chat_prompts(args.num_prompts, args.seed)
        out = send(url, prompts, model=demo.target.model, concurrency=args.concurrency, max_tokens=args.max_tokens)
        data["send"] = {"url": url, "concurrency": args.concurrency, "max_tokens": args.max_tokens,
                        "seed": args.seed, **out}
        print(json.dumps(data["send"], indent=2))
        if out["num_failed"]:
            raise SystemExit(f"{out['num_failed']} requests failed: {out['failures']}")
    elif args.cmd == "record":
        data.setdefault("runs", {})[args.label] = record(args.label, args.recipe)
        print(json.dumps(data["runs"][args.label]["gate"], indent=2))
    if args.cmd != "report":
        save_result(data)
    from bench.report_data import shifted_traffic_table

    print("\n".join(shifted_traffic_table(data)))


if __name__ == "__main__":
    main()
