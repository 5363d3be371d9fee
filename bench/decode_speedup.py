"""Decoding speed-up with peagle's reference decoder on the GPU (issue 8 item 4): SmolLM2-135M
target, no speculation vs EAGLE-3 vs P-EAGLE heads from the GPU recipe, concurrency (batch) in
{1, 4, 16, 64} and K in {3, 5, 7}, HumanEval prompts, greedy.

Losslessness: every speculative output is compared token for token with target-only greedy
decoding of the same prompts in the same run; ``identical`` counts the equal sequences (bf16
kernels of different shapes can flip near-ties; ``--fp32-check`` repeats one configuration in
float32, where they must all be equal).

    python -m bench.decode_speedup --heads ~/keep --data ~/keep/humaneval.jsonl.xz
"""

from __future__ import annotations

import argparse

import torch

from bench.common import write_result
from bench.gpu_recipe import _read_jsonl_xz


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from peagle_core.contract import load_head
    from peagle_core.decoder import speculative_generate
    from pipelines.assets import ensure_target

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", required=True, help="directory holding head-peagle/ and head-eagle3/")
    ap.add_argument("--data", required=True)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--ks", type=int, nargs="+", default=[3, 5, 7])
    ap.add_argument("--prompts-per-run", type=int, default=64, help="at least the concurrency; 8 at c=1")
    ap.add_argument("--fp32-check", action="store_true")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    path = ensure_target("smollm2-135m-instruct", dtype="bfloat16" if cuda else "float32").path
    tok = AutoTokenizer.from_pretrained(path)
    target = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    embed = target.get_input_embeddings().weight.detach().float().cpu()
    heads = {m: load_head(f"{args.heads}/head-{m}", target_embed_tokens=embed, dtype=dtype).to(device).eval()
             for m in ("eagle3", "peagle")}
    prompts = [tok.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=True,
                                       return_dict=True)["input_ids"] for r in _read_jsonl_xz(args.data)]
    eos = tok.eos_token_id
    conc = [1, 2] if args.smoke else args.concurrency
    ks = [3] if args.smoke else args.ks
    max_new = 8 if args.smoke else args.max_new_tokens
    rows = []

    def run(batch_prompts, c, method, K, tgt, head):
        outs, res_all = [], []
        for s in range(0, len(batch_prompts), c):
            r = speculative_generate(tgt, batch_prompts[s:s + c], drafter=head, method=method,
                                     num_speculative_tokens=K, max_new_tokens=max_new, eos_token_id=eos)
            outs += r.output_ids
            res_all.append(r)
        return outs, res_all

    for c in conc:
        n = max(c, 8 if c == 1 else min(args.prompts_per_run, 4 * c))
        ps = prompts[:n]
        _ = run(ps[:c], c, "none", 1, target, None)  # warm-up
        ref, base = run(ps, c, "none", 1, target, None)
        base_s = sum(r.wall_s for r in base)
        base_tok = sum(r.num_generated_tokens for r in base)
        rows.append({"concurrency": c, "method": "none", "K": 0, "tokens_per_s": base_tok / base_s,
                     "speedup": 1.0, "identical": n, "prompts": n})
        print(rows[-1], flush=True)
        for method in ("eagle3", "peagle"):
            for K in ks:
                outs, res = run(ps, c, method, K, target, heads[method])
                wall = sum(r.wall_s for r in res)
                drafts = sum(r.num_drafts for r in res)
                acc = sum(r.num_accepted_tokens for r in res)
                per_pos = [sum(r.accepted_per_pos[j] for r in res) / max(1, drafts) for j in range(K)]
                toks = sum(r.num_generated_tokens for r in res)
                rows.append({"concurrency": c, "method": method, "K": K, "tokens_per_s": toks / wall,
                             "speedup": (toks / wall) / (base_tok / base_s), "acceptance_length": 1 + acc / max(1, drafts),
                             "acceptance_per_pos": per_pos, "identical": sum(a == b for a, b in zip(outs, ref)),
                             "prompts": n, "target_s": sum(r.target_s for r in res),
                             "drafter_s": sum(r.drafter_s for r in res)})
                print(rows[-1], flush=True)
    fp32 = None
    if args.fp32_check and cuda:
        t32 = AutoModelForCausalLM.from_pretrained(ensure_target("smollm2-135m-instruct", "float32").path,
                                                   dtype=torch.float32).to(device).eval()
        ps = prompts[:16]
        ref, _ = run(ps, 4, "none", 1, t32, None)
        fp32 = {}
        for m in ("eagle3", "peagle"):
            h = heads[m].float()
            outs, _ = run(ps, 4, m, 5, t32, h)
            fp32[m] = {"identical": sum(a == b for a, b in zip(outs, ref)), "prompts": len(ps)}
        print("fp32 losslessness", fp32, flush=True)
    out = write_result("decode_speedup" + ("_smoke" if args.smoke else ""),
                       {"dtype": str(dtype), "max_new_tokens": max_new, "rows": rows, "fp32_lossless_check": fp32})
    print("wrote", out)


if __name__ == "__main__":
    main()
