"""Where one P-EAGLE training step spends its time (issue 4, the N=8192 step-time goal).

Times, for one packed sequence of N tokens (random SmolLM2-sized drafter and states, as
``bench.train_step``), the phases of ``PEagleObjective.forward_backward`` with S=1: element
building (COD sampling, on the host), the flex ``BlockMask`` (``create_block_mask``), and the
drafter forward+loss and backward; plus the block-mask density (fraction of 128x128 tiles
computed) in the Algorithm-1 order ``(seg_key, depth, anchor)`` and in the forward order
``(doc, depth, anchor)`` the objective uses.

    python -m bench.step_breakdown               # GPU; writes bench/results/step_breakdown.json
"""

from __future__ import annotations

import argparse

import torch

from bench.common import TARGET_SHAPES, time_ms, write_result
from bench.train_step import make_batch, make_drafter
from peagle_core.elements import forward_order, pad_elements
from peagle_core.masks import FLEX_BLOCK, flex_element_mask
from peagle_core.objectives import build_objective


def density(el) -> float:
    el = pad_elements(el, -(-el.num_elements // FLEX_BLOCK) * FLEX_BLOCK)
    bm = flex_element_mask(el)
    nq = bm.kv_num_blocks.shape[-1]
    computed = int(bm.kv_num_blocks.sum()) + (int(bm.full_kv_num_blocks.sum()) if bm.full_kv_num_blocks is not None else 0)
    return computed / (nq * nq)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-tokens", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--num-depths", type=int, default=8)
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = TARGET_SHAPES["smollm2-135m"]
    rows = []
    for N in args.num_tokens:
        drafter = make_drafter(shape, num_layers=4, parallel=True, device=dev)
        batch = make_batch(N, shape, num_docs=4, device=dev,
                           dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32)
        lm = torch.randn(shape["vocab_size"], shape["hidden_size"], device=dev)
        obj = build_objective("peagle", num_depths=args.num_depths, cod_ratio=0.8, cod_min_ratio=0.2)
        el = obj.build_elements(batch, drafter)
        fwd_order = el.index(forward_order(el, args.num_depths))
        row = {"num_tokens": N, "elements": el.num_elements,
               "density_alg1_order": density(el), "density_forward_order": density(fwd_order),
               "build_elements_ms": time_ms(lambda obj=obj, batch=batch, drafter=drafter: obj.build_elements(batch, drafter)),
               "block_mask_ms": time_ms(lambda el=fwd_order: flex_element_mask(pad_elements(
                   el, -(-el.num_elements // FLEX_BLOCK) * FLEX_BLOCK)))}

        def step(obj=obj, drafter=drafter, batch=batch, lm=lm, el=el):
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
                obj.forward_backward(drafter, batch, target_lm_head=lm, elements=el)
            drafter.zero_grad(set_to_none=True)

        row["forward_backward_ms"] = time_ms(step, warmup=3, iters=5)
        rows.append(row)
        print(row, flush=True)
    write_result("step_breakdown", {"rows": rows, "num_depths": args.num_depths})


if __name__ == "__main__":
    main()
