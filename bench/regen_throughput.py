"""Regeneration throughput of the regenerate stage's engines side by side on the same prompts: the
transformers backend with plain ``generate`` and with static KV cache + compiled decoding (issue 14 item 3;
goal >= 30k generated tokens/s for SmolLM2 on one H100/H200), and :class:`pipelines.data.engines.VLLMEngine`
(issue 25 item 4; goal >= 50k tokens/s), each with ``--engines``.

Both variants are :class:`pipelines.data.engines.TransformersEngine` (the regenerate stage's engine, greedy,
prompts sorted into length buckets of ``--batch-size``): ``static_cache=False`` is HF ``generate`` with
its dynamic cache; ``static_cache=True`` uses ``cache_implementation="static"``, which on CUDA compiles
the decoding step (CUDA graphs). The static engine runs the prompts twice: the first pass includes the
compilation of each shape (reported as ``cold``), the second is the steady state (``warm``). The
plain engine runs once after a one-batch warm-up. ``agreement`` = fraction of prompts whose text is
identical in both variants (bf16 rounding differs with the padding, so not all are).

    python -m bench.regen_throughput --data ~/keep/sharegpt.jsonl.xz --prompts 2048 --batch-size 256
    python -m bench.regen_throughput --data ... --engines vllm,static --name regen_throughput_vllm

The vLLM engine gets every prompt in one ``generate`` call (vLLM batches them itself), after a warm-up call
on ``--batch-size`` prompts (CUDA graphs and compilation are in ``engine_start_s``). ``--vllm-sweep
512:32768,1024:16384`` starts one engine per ``max_num_seqs:max_num_batched_tokens`` pair in turn (rows in
``vllm_sweep``; ``vllm`` is the fastest):

    python -m bench.regen_throughput --data ... --engines vllm --name regen_sweep_vllm --vllm-sweep 256:8192,512:32768

With ``--per-gpu`` the sweep's engines run at once, one per GPU (a child process each, ``CUDA_VISIBLE_DEVICES``
naming its GPU; ``0:0`` is vLLM's default): a 4-GPU node sweeps four settings in one engine's time. The engines
then share the host's cores, which a host-bound 135M target needs: the rows say how many ran at once.
"""

from __future__ import annotations

import argparse
import json
import lzma
import random
import time
from pathlib import Path

import torch

from bench.common import write_result


def _first_turns(path: Path, n: int, seed: int) -> list[list[dict]]:
    with lzma.open(path, "rt") as f:
        rows = [json.loads(line) for line in f]
    prompts = []
    for r in rows:
        msgs = [m for m in r["messages"] if m["role"] in ("system", "user")]
        first_user = next((i for i, m in enumerate(msgs) if m["role"] == "user"), None)
        if first_user is not None:
            prompts.append(msgs[: first_user + 1])
    random.Random(seed).shuffle(prompts)
    return prompts[:n]


def _timed(engine, prompts, cfg) -> tuple[float, int, list[str]]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    gens = engine.generate(prompts, cfg, [0] * len(prompts))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    return wall, sum(g.num_tokens for g in gens if g is not None), [g.text if g else "" for g in gens]


def _agreement(a: list[str], b: list[str]) -> float:
    """Fraction of prompts whose generated text is identical in both runs."""
    return sum(x == y for x, y in zip(a, b)) / max(1, len(b))


def _vllm_row(target, prompts, cfg, args, *, dtype: str, max_num_seqs: int | None,
              max_num_batched_tokens: int | None) -> tuple[dict, list[str]]:
    """One :class:`pipelines.data.engines.VLLMEngine` with these scheduler settings (None: vLLM's default): its
    row (tokens/s of every prompt in one call after a warm-up call) and texts; the engine is shut down after."""
    import gc

    import vllm

    from pipelines.data.engines import VLLMEngine

    t0 = time.perf_counter()
    extra = {k: v for k, v in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens))
             if v}
    engine = VLLMEngine(target, dtype=dtype, max_model_len=args.max_model_len,
                        gpu_memory_utilization=args.gpu_memory_utilization, **extra)
    _timed(engine, prompts[: args.batch_size], cfg)
    start_s = time.perf_counter() - t0
    wall, toks, texts = _timed(engine, prompts, cfg)
    sched = engine.llm.llm_engine.vllm_config.scheduler_config
    row = {"wall_s": wall, "generated_tokens": toks, "tokens_per_s": toks / wall, "engine_start_s": start_s,
           "vllm": vllm.__version__, "max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
           "scheduler_max_num_seqs": sched.max_num_seqs,
           "scheduler_max_num_batched_tokens": sched.max_num_batched_tokens}
    engine.llm.llm_engine.engine_core.shutdown()
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row, texts


def _sweep_per_gpu(args: argparse.Namespace) -> None:
    """``--vllm-sweep`` with ``--per-gpu``: one child run of this module per setting, each on GPU i, at once; their
    rows merged into ``vllm_sweep`` of result ``args.name`` (the children's own files removed)."""
    import os
    import subprocess
    import sys

    from bench.common import RESULTS

    if not args.vllm_sweep:
        raise SystemExit("--per-gpu needs --vllm-sweep")
    pairs = [pair.split(":") for pair in args.vllm_sweep.split(",")]
    common = ["--data", args.data, "--prompts", str(args.prompts), "--batch-size", str(args.batch_size),
              "--max-new-tokens", str(args.max_new_tokens), "--max-model-len", str(args.max_model_len),
              "--seed", str(args.seed), "--engines", "vllm", "--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    procs = []
    for i, (seqs, tokens) in enumerate(pairs):
        extra = [a for flag, v in (("--max-num-seqs", seqs), ("--max-num-batched-tokens", tokens)) if int(v)
                 for a in (flag, v)]
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(i))
        procs.append(subprocess.Popen([sys.executable, "-m", "bench.regen_throughput", *common, *extra, "--name",
                                       f"{args.name}_gpu{i}"], env=env))
    codes = [p.wait() for p in procs]
    rows, res = [], {}
    for i, code in enumerate(codes):
        f = RESULTS / f"{args.name}_gpu{i}.json"
        if code != 0 or not f.is_file():
            rows.append({"setting": args.vllm_sweep.split(",")[i], "error": f"exit code {code}"})
            continue
        res = json.loads(f.read_text())
        rows.append(res["vllm"] | {"gpu": i, "engines_at_once": len(pairs)})
        f.unlink()
    ok = [r for r in rows if "tokens_per_s" in r]
    payload = {k: v for k, v in res.items() if k not in ("environment", "vllm")}
    payload |= {"vllm_sweep": rows, "per_gpu": True}
    if ok:
        payload["vllm"] = max(ok, key=lambda r: r["tokens_per_s"])
    print(json.dumps(payload))
    write_result(args.name, payload)


def main() -> None:
    from pipelines.assets import ensure_target
    from pipelines.data.engines import TransformersEngine
    from pipelines.recipe import RegenerateConfig

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="conversations .jsonl.xz (bench.gpu_recipe export-data)")
    ap.add_argument("--prompts", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-batch-tokens", type=int, default=262_144)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default="regen_throughput")
    ap.add_argument("--engines", default="plain,static", help="comma list of plain, static, vllm")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.8, help="vLLM engine only")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="vLLM engine only (default: vLLM's)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="vLLM engine only (default: vLLM's)")
    ap.add_argument("--vllm-sweep", default=None, metavar="SEQS:TOKENS,...",
                    help="vLLM engine only: one engine per max_num_seqs:max_num_batched_tokens pair, in turn, each "
                         "a row of 'vllm_sweep' (issue 40 item 3; the public anchor's tuned setting is 512:32768)")
    ap.add_argument("--per-gpu", action="store_true", help="with --vllm-sweep: each setting on its own GPU, at once")
    args = ap.parse_args()
    if args.per_gpu:
        return _sweep_per_gpu(args)

    dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    target = ensure_target("smollm2-135m-instruct", dtype=dtype).path
    prompts = _first_turns(Path(args.data).expanduser(), args.prompts, args.seed)
    cfg = RegenerateConfig(backend="transformers", temperature=0.0, max_tokens_per_turn=args.max_new_tokens,
                           batch_size=args.batch_size)
    res: dict = {"prompts": len(prompts), "batch_size": args.batch_size, "max_new_tokens": args.max_new_tokens,
                 "max_batch_tokens": args.max_batch_tokens, "dtype": dtype,
                 "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    common = {"dtype": dtype, "max_model_len": args.max_model_len, "batch_size": args.batch_size,
              "max_batch_tokens": args.max_batch_tokens}

    engines = args.engines.split(",")
    texts: dict[str, list[str]] = {}
    if "plain" in engines:
        plain = TransformersEngine(target, **common)
        _timed(plain, prompts[: args.batch_size], cfg)  # warm-up (kernels, allocator)
        wall, toks, texts["plain"] = _timed(plain, prompts, cfg)
        res["plain"] = {"wall_s": wall, "generated_tokens": toks, "tokens_per_s": toks / wall}
        print("plain", json.dumps(res["plain"]), flush=True)
        del plain
    if "static" in engines:
        static = TransformersEngine(target, **common, static_cache=True)
        for label in ("cold", "warm"):
            wall, toks, texts["static"] = _timed(static, prompts, cfg)
            res[f"static_{label}"] = {"wall_s": wall, "generated_tokens": toks, "tokens_per_s": toks / wall}
            print(f"static_{label}", json.dumps(res[f"static_{label}"]), flush=True)
        del static
    if "vllm" in engines:
        settings = ([tuple(int(v) for v in pair.split(":")) for pair in args.vllm_sweep.split(",")]
                    if args.vllm_sweep else [(args.max_num_seqs, args.max_num_batched_tokens)])
        rows = []
        for seqs, batched in settings:
            row, texts["vllm"] = _vllm_row(target, prompts, cfg, args, dtype=dtype, max_num_seqs=seqs,
                                           max_num_batched_tokens=batched)
            print("vllm", json.dumps(row), flush=True)
            rows.append(row)
        res["vllm"] = max(rows, key=lambda r: r["tokens_per_s"])
        if args.vllm_sweep:
            res["vllm_sweep"] = rows
    if "plain" in texts and "static" in texts:
        res["agreement"] = _agreement(texts["plain"], texts["static"])
        res["speedup_warm"] = res["static_warm"]["tokens_per_s"] / res["plain"]["tokens_per_s"]
    if "vllm" in texts and "static" in texts:
        res["agreement_vllm_static"] = _agreement(texts["vllm"], texts["static"])
        res["speedup_vllm_over_static_warm"] = res["vllm"]["tokens_per_s"] / res["static_warm"]["tokens_per_s"]
    print(json.dumps(res))
    write_result(args.name, res)


if __name__ == "__main__":
    main()
