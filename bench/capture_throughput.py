"""Capture throughput: the capture stage's model step vs a plain transformers forward (issue 8
item 3). SmolLM2-135M on one GPU, real ShareGPT conversations, batches of 8-64.

``capture`` = ``pipelines.capture.capture_batch`` (chat-template tokenization, length-grouped
batches, aux hidden states by hooks, final hidden, copy to host in the storage dtype);
``plain`` = ``model(input_ids, attention_mask)`` with logits, on the same padded batches;
``plain_base`` = ``model.model(...)`` (no lm_head). Tokens/s counts real (unpadded) tokens.
Goal: capture >= 0.85x plain.

    python -m bench.capture_throughput --data ~/keep/train.jsonl.xz   # GPU
    python -m bench.capture_throughput --data ... --smoke            # CPU, tiny
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from types import SimpleNamespace

import torch

from bench.common import write_result
from bench.gpu_recipe import _read_jsonl_xz


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from peagle_core.drafter import default_aux_layer_ids
    from pipelines.assets import ensure_target
    from pipelines.capture import capture_batch, length_batches, prepare_samples

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True)
    ap.add_argument("--num-conversations", type=int, default=512)
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    device, dtype = ("cuda", "bfloat16") if cuda else ("cpu", "float32")
    n = 8 if args.smoke else args.num_conversations
    path = ensure_target("smollm2-135m-instruct", dtype=dtype).path
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()
    rows = _read_jsonl_xz(args.data)[:n]
    layer_ids = default_aux_layer_ids(model.config.num_hidden_layers)
    prepared = prepare_samples(tok, rows, max_length_tokens=args.max_length)
    total = sum(len(p[1]) for p in prepared)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    results = []
    for bs in ([4, 8] if args.smoke else [8, 16, 32, 64]):
        cfg = SimpleNamespace(dtype=dtype, on_too_long="truncate", batch_size=bs)
        capture_batch(model, tok, rows[:bs], cfg, layer_ids, max_length_tokens=args.max_length)  # warm-up
        sync()
        t0 = time.perf_counter()
        capture_batch(model, tok, rows, cfg, layer_ids, max_length_tokens=args.max_length, stats=Counter(),
                      validate=False)
        sync()
        t_capture = time.perf_counter() - t0
        batches = []
        for idx in length_batches([len(p[1]) for p in prepared], bs):
            t_max = len(prepared[idx[0]][1])
            ids = torch.zeros((len(idx), t_max), dtype=torch.long)
            attn = torch.zeros_like(ids)
            for b, i in enumerate(idx):
                ids[b, :len(prepared[i][1])] = torch.tensor(prepared[i][1])
                attn[b, :len(prepared[i][1])] = 1
            batches.append((ids, attn))
        timings = {}
        for name, fn in (("plain", model), ("plain_base", model.model)):
            sync()
            t0 = time.perf_counter()
            with torch.inference_mode():
                for ids, attn in batches:  # includes the host->device copy, as capture does
                    fn(input_ids=ids.to(device), attention_mask=attn.to(device))
            sync()
            timings[name] = time.perf_counter() - t0
        row = {"batch": bs, "tokens": total, "capture_tok_s": total / t_capture,
               "plain_tok_s": total / timings["plain"], "plain_base_tok_s": total / timings["plain_base"]}
        row["capture_over_plain"] = row["capture_tok_s"] / row["plain_tok_s"]
        results.append(row)
        print(row, flush=True)
    out = write_result("capture_throughput" + ("_smoke" if args.smoke else ""),
                       {"dtype": dtype, "conversations": len(rows), "rows": results, "goal": "capture_over_plain >= 0.85"})
    print("wrote", out)


if __name__ == "__main__":
    main()
