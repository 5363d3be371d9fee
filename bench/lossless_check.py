"""Losslessness of the reference decoder on SmolLM2 in float32 (CPU): P-EAGLE and EAGLE-3 heads
from the GPU recipe, K=5, batch 1 and 3, HumanEval prompts; every speculative output must equal
target-only greedy decoding token for token. Also reports the offline acceptance length.

    PYTHONPATH=. python -m bench.lossless_check --heads outputs/gpu-heads --data .carry/w1/humaneval.jsonl.xz
"""

from __future__ import annotations

import argparse

import torch

from bench.common import read_jsonl_xz, write_result


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from peagle_core.contract import load_head
    from peagle_core.decoder import speculative_generate
    from pipelines.assets import ensure_target

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--heads", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--num-prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    path = ensure_target("smollm2-135m-instruct", "float32").path
    tok = AutoTokenizer.from_pretrained(path)
    tgt = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    emb = tgt.get_input_embeddings().weight.detach()
    rows = read_jsonl_xz(args.data)[: args.num_prompts]
    prompts = [tok.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=True,
                                       return_dict=True)["input_ids"] for r in rows]
    ref = speculative_generate(tgt, prompts, method="none", max_new_tokens=args.max_new_tokens,
                               eos_token_id=tok.eos_token_id)
    out = {"none": ref.summary()}
    for m in ("peagle", "eagle3"):
        h = load_head(f"{args.heads}/head-{m}", target_embed_tokens=emb, dtype=torch.float32).eval()
        for bs in (1, 3):
            r = speculative_generate(tgt, prompts, drafter=h, method=m, num_speculative_tokens=5, batch_size=bs,
                                     max_new_tokens=args.max_new_tokens, eos_token_id=tok.eos_token_id)
            out[f"{m}_batch{bs}"] = {"identical": sum(a == b for a, b in zip(r.output_ids, ref.output_ids)),
                                     "prompts": len(prompts), "acceptance_length": r.acceptance_length}
            print(m, bs, out[f"{m}_batch{bs}"], flush=True)
    write_result("lossless_fp32_cpu", {"K": 5, "max_new_tokens": args.max_new_tokens, "results": out})


if __name__ == "__main__":
    main()
