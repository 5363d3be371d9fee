"""Benchmark: one training step of P-EAGLE (sequence partition S) vs EAGLE-3 TTT-7 at equal tokens.

Measures, per configuration, the median wall time of ``forward_backward`` + AdamW step, the peak
CUDA memory of that step, and slots/s (drafter positions in all forwards, incl. recomputed
context) and loss elements/s. Random weights and random captured states at a target's sizes
(default SmolLM2-135M: drafter H=576, 4 layers, vocab 49152). Grid (issue 4 / 8):

* ``peagle``: N in {2048, 8192}, K=8, S in {1, 2, 4, 8}, COD r=0.8, r_min=0.2, flex attention;
* ``eagle3``: TTT with T=7 steps on the same packed batches (same N tokens);
* loss: ``triton`` (fused) vs ``torch`` (chunked) for the P-EAGLE S=1 and the TTT rows.

Run on a GPU box: ``python -m bench.train_step`` (writes ``bench/results/train_step.json``);
CPU smoke: ``python -m bench.train_step --smoke`` (tiny sizes, writes ``train_step_smoke.json``).
A configuration that runs out of memory is recorded as ``"oom": true``.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

from bench.common import TARGET_SHAPES, write_result
from peagle_core.batch import PackedBatch
from peagle_core.drafter import Eagle3Drafter, num_parameters
from peagle_core.drafter_config import DrafterConfig
from peagle_core.objectives import build_objective

SMOKE_SHAPE = {"hidden_size": 36, "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 6,
               "intermediate_size": 50, "vocab_size": 99, "num_hidden_layers": 7, "rope_theta": 10000.0}  # --smoke


def make_drafter(shape: dict, *, num_layers: int, parallel: bool, device, draft_vocab_size=None) -> Eagle3Drafter:
    cfg = DrafterConfig(
        hidden_size=shape["hidden_size"], num_hidden_layers=num_layers,
        num_attention_heads=shape["num_attention_heads"], num_key_value_heads=shape["num_key_value_heads"],
        head_dim=shape["head_dim"], intermediate_size=shape["intermediate_size"],
        rope_parameters={"rope_type": "default", "rope_theta": shape["rope_theta"]},
        max_position_embeddings=32768, vocab_size=shape["vocab_size"], draft_vocab_size=draft_vocab_size,
        target_hidden_size=shape["hidden_size"], target_num_hidden_layers=shape["num_hidden_layers"],
        mask_token_id=(shape["vocab_size"] - 1) if parallel else None,
    )
    return Eagle3Drafter(cfg).to(device)


def make_batch(num_tokens: int, shape: dict, *, num_docs: int, device, dtype, seed: int = 0) -> PackedBatch:
    """``num_docs`` equal documents; the first 20% of each is the prompt (no loss)."""
    g = torch.Generator().manual_seed(seed)
    Ht, V = shape["hidden_size"], shape["vocab_size"]
    bounds = torch.linspace(0, num_tokens, num_docs + 1).long()
    doc = torch.zeros(num_tokens, dtype=torch.long)
    pos = torch.zeros(num_tokens, dtype=torch.long)
    lm = torch.zeros(num_tokens, dtype=torch.bool)
    for i in range(num_docs):
        a, b = int(bounds[i]), int(bounds[i + 1])
        doc[a:b] = i
        pos[a:b] = torch.arange(b - a)
        lm[a + (b - a) // 5:b] = True
    return PackedBatch(
        input_ids=torch.randint(0, V - 1, (num_tokens,), generator=g), loss_mask=lm, doc_ids=doc,
        position_ids=pos, aux=torch.randn(num_tokens, 3 * Ht, generator=g),
        final_hidden=torch.randn(num_tokens, Ht, generator=g),
    ).to(device, dtype)


def run_config(method: str, obj_cfg: dict, shape: dict, args, device, dtype) -> dict:
    row = {"method": method, "num_tokens": args.cur_n, **obj_cfg}
    cuda = device.type == "cuda"
    drafter = opt = batch = None
    try:
        torch.manual_seed(0)
        drafter = make_drafter(shape, num_layers=args.num_layers, parallel=method == "peagle", device=device,
                               draft_vocab_size=args.draft_vocab_size)
        opt = torch.optim.AdamW(drafter.parameters(), lr=1e-4, fused=cuda)
        batch = make_batch(args.cur_n, shape, num_docs=args.num_docs, device=device, dtype=dtype)
        target_lm_head = (torch.randn(shape["vocab_size"], shape["hidden_size"], device=device) * 0.02).to(dtype)
        obj = build_objective(method, **obj_cfg)
        autocast = torch.autocast("cuda", dtype=torch.bfloat16) if (cuda and args.bf16) else torch.autocast(
            "cpu", enabled=False)

        def step():
            opt.zero_grad(set_to_none=True)
            with autocast:
                m = obj.forward_backward(drafter, batch, target_lm_head=target_lm_head)
            opt.step()
            return m

        for _ in range(args.warmup):
            step()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        times, m = [], {}
        for _ in range(args.iters):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            m = step()
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        t = statistics.median(times)
        row.update(
            step_ms=t * 1e3, num_forward_slots=m["num_forward_slots"], num_loss_elements=m["num_loss_elements"],
            slots_per_s=m["num_forward_slots"] / t, loss_elements_per_s=m["num_loss_elements"] / t,
            tokens_per_s=args.cur_n / t, loss=m["loss"], oom=False,
        )
        if cuda:
            row["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    except torch.OutOfMemoryError:
        row["oom"] = True
    finally:
        drafter = opt = batch = None  # free before the next configuration
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes on CPU (seconds)")
    p.add_argument("--target", default="smollm2-135m", choices=sorted(TARGET_SHAPES))
    p.add_argument("--num-tokens", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--num-depths", type=int, default=8)
    p.add_argument("--partitions", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--ttt-steps", type=int, default=7)
    p.add_argument("--methods", nargs="+", default=["peagle", "eagle3"], choices=["peagle", "eagle3"])
    p.add_argument("--loss-impls", nargs="+", default=None, help="default: triton and torch on CUDA, torch on CPU")
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--draft-vocab-size", type=int, default=None)
    p.add_argument("--num-docs", type=int, default=4, help="documents packed per sequence")
    p.add_argument("--attention", default="auto", choices=["auto", "dense", "flex"])
    p.add_argument("--no-bf16", dest="bf16", action="store_false", help="float32 on CUDA (default: bf16 autocast)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--out", default=None, help="result name under bench/results (default train_step[_smoke])")
    p.add_argument("--device", default=None)
    args = p.parse_args(argv)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() and not args.smoke else "cpu"))
    shape = dict(TARGET_SHAPES[args.target])
    if args.smoke:
        shape = dict(SMOKE_SHAPE)
        args.num_tokens, args.num_depths, args.partitions, args.ttt_steps = [64], 3, [1, 2], 3
        args.num_layers, args.warmup, args.iters, args.num_docs = 2, 1, 2, 2
    loss_impls = args.loss_impls or (["triton", "torch"] if device.type == "cuda" else ["torch"])
    dtype = torch.float32  # captured states; autocast handles bf16 compute on CUDA

    rows = []
    for n in args.num_tokens:
        args.cur_n = n
        grid = []
        if "peagle" in args.methods:
            for s in args.partitions:
                for impl in (loss_impls if s == 1 else loss_impls[:1]):
                    grid.append(("peagle", {"num_depths": args.num_depths, "num_partitions": s, "loss_impl": impl,
                                                "attention": args.attention}))
        if "eagle3" in args.methods:
            for impl in loss_impls:
                grid.append(("eagle3", {"num_steps": args.ttt_steps, "loss_impl": impl, "attention": args.attention}))
        for method, cfg in grid:
            row = run_config(method, cfg, shape, args, device, dtype)
            rows.append(row)
            print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)

    drafter = make_drafter(shape, num_layers=args.num_layers, parallel=True, device="cpu",
                           draft_vocab_size=args.draft_vocab_size)
    name = args.out or ("train_step_smoke" if args.smoke else "train_step")
    out = write_result(name, {
        "benchmark": "train_step",
        "target": "tiny" if args.smoke else args.target,
        "drafter_parameters": num_parameters(drafter),
        "settings": {k: v for k, v in vars(args).items() if k != "cur_n"} | {"device_used": str(device)},
        "rows": rows,
    })
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
