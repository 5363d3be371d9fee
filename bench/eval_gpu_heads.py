"""Evaluate the GPU recipe's heads with real vLLM on CPU (issue 7 item 5): AL at K = 3, 5, 7 on
HumanEval and tokens/s against no speculation, through ``pipelines.evaluate.evaluate``.

    python -m bench.eval_gpu_heads --heads outputs/gpu-heads --out outputs/gpu-eval
"""

from __future__ import annotations

import argparse
import json

from bench.common import write_result


def main() -> None:
    from transformers import AutoTokenizer

    from pipelines.assets import ensure_target
    from pipelines.eval_prompts import load_eval_prompts
    from pipelines.evaluate import evaluate
    from pipelines.recipe import EvalConfig, SourceConfig

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--heads", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    target = ensure_target("smollm2-135m-instruct", "float32").path
    tok = AutoTokenizer.from_pretrained(target)
    cfg = EvalConfig(sources=[SourceConfig(kind="humaneval")], num_prompts=args.num_prompts, max_tokens=args.max_tokens,
                     num_speculative_tokens_sweep=[3, 5, 7], concurrency_sweep=[1], methods=["none", "eagle3", "peagle"],
                     include_offline_decoder=False)
    sets = load_eval_prompts(cfg.sources, tok, num_prompts=args.num_prompts, seed=0, max_prompt_tokens=512)
    prompts = next(iter(sets.values()))
    report = evaluate(target=target, prompts=prompts,
                      heads={"peagle": f"{args.heads}/head-peagle", "eagle3": f"{args.heads}/head-eagle3"},
                      cfg=cfg, eval_set="humaneval", out_dir=args.out, timeout_s=3000)
    print(report.markdown)
    write_result("gpu_recipe_vllm_cpu_eval", {"prompts": len(prompts), "max_tokens": args.max_tokens,
                                              "rows": report.rows, "best_K": report.best_K})
    print(json.dumps(report.best_K))


if __name__ == "__main__":
    main()
