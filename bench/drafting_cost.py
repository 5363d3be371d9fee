"""Drafting cost vs K: P-EAGLE parallel drafting (ONE forward over K slots) vs EAGLE-3
sequential drafting (K forwards), random weights, per decode step (issue 8 item 1).

Each step drafts for ``batch`` sequences whose drafter KV cache already holds ``context`` committed
slots; the step appends the anchor (real token + hidden state) and, for P-EAGLE, K-1 mask slots,
then discards the speculative slots — exactly what ``Eagle3Drafter.draft_parallel`` /
``draft_sequential`` do in the reference decoder. Sequential is timed for the same 4-layer head and
for the 1-layer head EAGLE-3 normally ships.

Goals: parallel t(K=11)/t(K=1) <= 1.15; parallel >= 5x faster than sequential at K=7.

    python -m bench.drafting_cost            # GPU, bf16, writes bench/results/drafting_cost.json
    python -m bench.drafting_cost --smoke    # CPU, tiny, seconds
"""

from __future__ import annotations

import argparse

import torch

from bench.common import TARGET_SHAPES, time_ms, write_result
from peagle_core.drafter import DrafterCache, DrafterConfig, Eagle3Drafter

TINY_SHAPE = dict(hidden_size=36, num_attention_heads=6, num_key_value_heads=2, head_dim=6, intermediate_size=50,
                  vocab_size=99, num_hidden_layers=5, rope_theta=10000.0)


def build(shape: dict, num_layers: int, device, dtype, mask: bool = True) -> Eagle3Drafter:
    cfg = DrafterConfig.from_target(
        {**shape, "rope_parameters": {"rope_type": "default", "rope_theta": shape["rope_theta"]},
         "max_position_embeddings": 8192},
        num_hidden_layers=num_layers, mask_token_id=shape["vocab_size"] - 1 if mask else None,
    )
    return Eagle3Drafter(cfg).to(device=device, dtype=dtype).eval()


def prefilled_cache(d: Eagle3Drafter, batch: int, context: int, device, dtype) -> DrafterCache:
    cache = DrafterCache(d.config.num_hidden_layers)
    ids = torch.randint(0, d.config.vocab_size - 2, (batch, context), device=device)
    aux = torch.randn(batch, context, d.config.fc_input_size, device=device, dtype=dtype)
    pos = torch.arange(context, device=device).expand(batch, context)
    with torch.no_grad():
        d(ids, d.combine_hidden_states(aux), pos, cache=cache)
    return cache


def step_fn(d: Eagle3Drafter, cache: DrafterCache, method: str, K: int, batch: int, context: int, device, dtype):
    ids = torch.randint(0, d.config.vocab_size - 2, (batch, 1), device=device)
    aux = torch.randn(batch, 1, d.config.fc_input_size, device=device, dtype=dtype)
    pos = torch.full((batch, 1), context, device=device)
    committed = cache.length
    fn = d.draft_parallel if method == "parallel" else d.draft_sequential

    def run():
        fn(ids, aux, pos, K, cache)
        cache.crop(committed)  # the anchor slot too: every timed step sees the same cache
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny CPU run (seconds)")
    ap.add_argument("--context", type=int, default=512, help="committed slots in the drafter KV cache")
    ap.add_argument("--out", default=None, help="result file directory (default bench/results)")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    shapes = {"tiny": TINY_SHAPE} if args.smoke else TARGET_SHAPES
    Ks = [1, 3, 5, 7, 11]
    batches = [1, 8] if args.smoke else [1, 8, 32, 64]
    context = 32 if args.smoke else args.context
    rows = []
    torch.manual_seed(0)
    for name, shape in shapes.items():
        heads = {"parallel": build(shape, 4, device, dtype), "sequential": build(shape, 4, device, dtype, mask=False),
                 "sequential-1layer": build(shape, 1, device, dtype, mask=False)}
        for B in batches:
            caches = {k: prefilled_cache(h, B, context, device, dtype) for k, h in heads.items()}
            for K in Ks:
                row = {"target": name, "batch": B, "K": K, "context": context}
                for method, head in heads.items():
                    run = step_fn(head, caches[method], "parallel" if method == "parallel" else "sequential",
                                  K, B, context, device, dtype)
                    with torch.no_grad():
                        row[f"{method}_ms"] = time_ms(run, warmup=2 if args.smoke else 5, iters=3 if args.smoke else 20)
                rows.append(row)
                print(row, flush=True)
            del caches
        del heads
        if device == "cuda":
            torch.cuda.empty_cache()
    summary = []
    for name in shapes:
        for B in batches:
            r = {x["K"]: x for x in rows if x["target"] == name and x["batch"] == B}
            summary.append({
                "target": name, "batch": B,
                "parallel_t11_over_t1": r[11]["parallel_ms"] / r[1]["parallel_ms"],
                "sequential_over_parallel_K7": r[7]["sequential_ms"] / r[7]["parallel_ms"],
                "sequential1layer_over_parallel_K7": r[7]["sequential-1layer_ms"] / r[7]["parallel_ms"],
            })
    goals = {"parallel_t11_over_t1": "<= 1.15", "sequential_over_parallel_K7": ">= 5"}
    path = write_result("drafting_cost" + ("_smoke" if args.smoke else ""),
                        {"dtype": str(dtype), "mode": "eager", "rows": rows, "summary": summary, "goals": goals},
                        None if args.out is None else __import__("pathlib").Path(args.out))
    for s in summary:
        print(s)
    print("wrote", path)


if __name__ == "__main__":
    main()
