"""Regeneration throughput of the transformers backend: plain ``generate`` vs static KV cache + compiled
decoding, side by side in one run on the same prompts (issue 14 item 3; goal >= 30k generated tokens/s
for SmolLM2 on one H100/H200).

Both variants are :class:`pipelines.engines.TransformersEngine` (the regenerate stage's engine, greedy,
prompts sorted into length buckets of ``--batch-size``): ``static_cache=False`` is HF ``generate`` with
its dynamic cache; ``static_cache=True`` uses ``cache_implementation="static"``, which on CUDA compiles
the decoding step (CUDA graphs). The static engine runs the prompts twice: the first pass includes the
compilation of each shape (reported as ``cold``), the second is the steady state (``warm``). The
plain engine runs once after a one-batch warm-up. ``agreement`` = fraction of prompts whose text is
identical in both variants (bf16 rounding differs with the padding, so not all are).

    python -m bench.regen_throughput --data ~/keep/sharegpt.jsonl.xz --prompts 2048 --batch-size 256
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


def main() -> None:
    from pipelines.assets import ensure_target
    from pipelines.engines import TransformersEngine
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
    args = ap.parse_args()

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

    plain = TransformersEngine(target, **common)
    _timed(plain, prompts[: args.batch_size], cfg)  # warm-up (kernels, allocator)
    wall, toks, plain_texts = _timed(plain, prompts, cfg)
    res["plain"] = {"wall_s": wall, "generated_tokens": toks, "tokens_per_s": toks / wall}
    print("plain", json.dumps(res["plain"]), flush=True)
    del plain
    static = TransformersEngine(target, **common, static_cache=True)
    for label in ("cold", "warm"):
        wall, toks, texts = _timed(static, prompts, cfg)
        res[f"static_{label}"] = {"wall_s": wall, "generated_tokens": toks, "tokens_per_s": toks / wall}
        print(f"static_{label}", json.dumps(res[f"static_{label}"]), flush=True)
    res["agreement"] = sum(a == b for a, b in zip(plain_texts, texts)) / max(1, len(texts))
    res["speedup_warm"] = res["static_warm"]["tokens_per_s"] / res["plain"]["tokens_per_s"]
    print(json.dumps(res))
    write_result(args.name, res)


if __name__ == "__main__":
    main()
