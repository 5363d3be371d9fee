"""Benchmark: training warm-up with packed batches of varying length (compile and recompiles).

Real training packs a different number of tokens into every step, and EAGLE-3 TTT builds one
attention mask per TTT step. This runs the first ``--steps`` optimizer steps of each method with
``N`` drawn uniformly from ``[--min-tokens, --max-tokens]`` (random weights and captured states at
the target's sizes, as ``bench.train_step``) and records the seconds of every step and how many
graphs torch.compile built (``torch._dynamo`` counters). A warm-up that keeps compiling shows as
steps that stay slow and a graph count that grows with the step count.

Run on a GPU box: ``python -m bench.warmup_compile`` (writes ``bench/results/warmup_compile.json``);
CPU smoke: ``python -m bench.warmup_compile --smoke``.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import time

import torch

from bench.common import TARGET_SHAPES, write_result
from bench.train_step import SMOKE_SHAPE, make_batch, make_drafter
from peagle_core.objectives import build_objective


def scale_objective(method: str):
    """The objective and drafter depth of ``bench.scale``'s recipe for ``method``."""
    from bench.scale import LAYERS, RECIPE
    from pipelines.recipe import load_recipe

    recipe = load_recipe(RECIPE)
    cfg = recipe.training.model_copy(update={"method": method}).objective_config(recipe.drafter.num_speculative_tokens)
    return build_objective(method, **dataclasses.asdict(cfg)), LAYERS[method]


def run_method(method: str, shape: dict, args, device, dtype) -> dict:
    from torch._dynamo.utils import counters

    counters.clear()
    obj, layers = scale_objective(method)
    torch.manual_seed(0)
    drafter = make_drafter(shape, num_layers=layers, parallel=method == "peagle", device=device)
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-4, fused=device.type == "cuda")
    lm_head = (torch.randn(shape["vocab_size"], shape["hidden_size"], device=device) * 0.02).to(dtype)
    rng = random.Random(0)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    steps, t_start = [], time.perf_counter()
    for i in range(args.steps):
        n = rng.randint(args.min_tokens, args.max_tokens)
        batch = make_batch(n, shape, num_docs=rng.randint(2, 8), device=device, dtype=dtype, seed=i)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with autocast:
            obj.forward_backward(drafter, batch, target_lm_head=lm_head)
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        steps.append({"num_tokens": n, "s": round(time.perf_counter() - t0, 3),
                      "graphs": int(counters["stats"]["unique_graphs"])})
        print(method, steps[-1], flush=True)
        if time.perf_counter() - t_start > args.budget_s:
            break
    tail = sorted(s["s"] for s in steps[-5:])
    return {"method": method, "steps": steps, "total_s": round(time.perf_counter() - t_start, 1),
            "graphs": steps[-1]["graphs"], "median_last5_s": tail[len(tail) // 2],
            "finished": len(steps) == args.steps}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes on CPU (seconds)")
    p.add_argument("--target", default="smollm2-135m", choices=sorted(TARGET_SHAPES))
    p.add_argument("--methods", nargs="+", default=["eagle3", "peagle"], choices=["eagle3", "peagle"])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--min-tokens", type=int, default=12000)
    p.add_argument("--max-tokens", type=int, default=16384)
    p.add_argument("--budget-s", type=float, default=200, help="stop a method after this many seconds")
    p.add_argument("--out", default=None, help="result name under bench/results")
    args = p.parse_args(argv)
    shape = TARGET_SHAPES[args.target]
    if args.smoke:
        shape, args.target, args.steps, args.min_tokens, args.max_tokens = SMOKE_SHAPE, "tiny", 4, 64, 160
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = torch.float32  # captured states; autocast handles bf16 compute on CUDA (as bench.train_step)
    rows = [run_method(m, shape, args, device, dtype) for m in args.methods]
    name = args.out or ("warmup_compile_smoke" if args.smoke else "warmup_compile")
    write_result(name, {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                        "target": args.target, "tokens": [args.min_tokens, args.max_tokens], "rows": rows})


if __name__ == "__main__":
    main()
