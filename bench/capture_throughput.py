"""Capture throughput: the capture stage's model step vs a plain transformers forward (issue 8
item 3). SmolLM2-135M on one GPU, real ShareGPT conversations, batches of 8-64. No Ray.

The capture stage is two Ray Data stages (``pipelines.capture``): tokenization on CPU workers
(``tokenize_rows``: chat template, loss mask, truncation) and the model step on the GPU actor
(``capture_tokenized``: padded batch, target forward without lm_head, aux + final hidden states cast
on the GPU and copied to pinned host memory, NaN/Inf check). Measured, tokens/s of real (unpadded)
tokens, median of ``--repeats`` passes over all conversations after one warm-up pass:

* ``step``: ``capture_tokenized`` on pre-tokenized rows (validation on, as the pipeline runs it);
* ``plain``: ``model(input_ids, attention_mask)`` with logits, on the same length-grouped batches,
  pre-padded on the host (host->device copy included); ``plain_base``: ``model.model(...)``, no lm_head;
* ``capture_batch``: tokenization + model step in one process (the Ray-free convenience path);
* ``tokenize``: ``tokenize_rows`` alone, one CPU process (Ray Data runs it on as many CPU workers
  as the cluster gives it, in parallel with the GPU stage).

Goal: step >= 0.85x plain.

``--vllm`` (issue 25 item 3): also the vLLM backend's model step (``capture_tokenized_vllm`` on a
``VLLMCaptureEngine``: every conversation in one ``generate`` call, hidden states handed back by peagle's
connector), timed the same way after one warm-up pass; ``vllm_over_step`` = its tokens/s over the
transformers step's best batch (goal >= 2).

    python -m bench.capture_throughput --data ~/keep/w1/sharegpt.jsonl.xz   # GPU
    python -m bench.capture_throughput --data .carry/w1/sharegpt.jsonl.xz --smoke   # CPU, tiny
    python -m bench.capture_throughput --data ~/keep/w1/sharegpt.jsonl.xz --target ~/keep/targets/llama-3.1-8b-random \
        --batch-sizes 4,8,16 --name capture_throughput_llama8b   # after bench.random_target llama-3.1-8b
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from types import SimpleNamespace

import torch

from bench.common import read_jsonl_xz, write_result


def _median_s(fn: Callable[[], object], sync: Callable[[], None], repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def measure(model, tokenizer, rows: Sequence[dict], *, dtype: str, batch_sizes: Sequence[int], max_length: int,
            repeats: int) -> dict:
    """Tokens/s of the tokenize stage, the model step, ``capture_batch`` and plain forwards (see module doc)."""
    from peagle_core.drafter_config import default_aux_layer_ids
    from pipelines.capture import capture_batch, capture_tokenized, length_batches, tokenize_rows

    device = next(model.parameters()).device
    cuda = device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    layer_ids = default_aux_layer_ids(model.config.num_hidden_layers)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    t0 = time.perf_counter()
    tokenized = tokenize_rows(tokenizer, rows, max_length_tokens=max_length)
    tokenize_s = time.perf_counter() - t0
    lengths = [len(r["input_ids"]) for r in tokenized]
    total = sum(lengths)
    out = {"conversations": len(rows), "samples": len(tokenized), "tokens": total, "tokenize_tok_s": total / tokenize_s,
           "tokenize_conversations_per_s": len(rows) / tokenize_s, "repeats": repeats, "validate": True, "rows": []}
    print(f"tokenize (1 CPU process): {out['tokenize_tok_s']:.0f} tok/s, {len(tokenized)} samples, {total} tokens",
          flush=True)
    for bs in batch_sizes:
        cfg = SimpleNamespace(dtype=dtype, on_too_long="truncate", batch_size=bs)
        batches = []
        for idx in length_batches(lengths, bs):
            ids = torch.full((len(idx), lengths[idx[0]]), pad_id, dtype=torch.long)  # [B, T]
            attn = torch.zeros_like(ids)
            for b, i in enumerate(idx):
                ids[b, :lengths[i]] = torch.from_numpy(tokenized[i]["input_ids"])
                attn[b, :lengths[i]] = 1
            batches.append((ids, attn))

        def plain(fn=model, batches=batches):
            with torch.inference_mode():
                for ids, attn in batches:  # includes the host->device copy, as the model step does
                    fn(input_ids=ids.to(device), attention_mask=attn.to(device))

        def step(cfg=cfg):
            capture_tokenized(model, tokenized, cfg, layer_ids, pad_token_id=pad_id, max_length_tokens=max_length)

        timings = {}
        for name, fn in (("step", step), ("plain", plain), ("plain_base", lambda: plain(model.model))):
            fn()  # warm-up: kernels, and the pinned host-memory cache the step's copies reuse
            timings[name] = _median_s(fn, sync, repeats)
        t_e2e = _median_s(lambda cfg=cfg: capture_batch(model, tokenizer, rows, cfg, layer_ids,
                                                        max_length_tokens=max_length), sync, 1)
        row = {"batch": bs, "tokens": total, "step_tok_s": total / timings["step"],
               "plain_tok_s": total / timings["plain"], "plain_base_tok_s": total / timings["plain_base"],
               "capture_batch_tok_s": total / t_e2e}
        row["step_over_plain"] = row["step_tok_s"] / row["plain_tok_s"]
        row["step_over_plain_base"] = row["step_tok_s"] / row["plain_base_tok_s"]
        out["rows"].append(row)
        print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    return out


def measure_vllm(path: str, tokenizer, rows: Sequence[dict], *, dtype: str, max_length: int, repeats: int,
                 gpu_memory_utilization: float) -> dict:
    """Tokens/s of the vLLM backend's model step on ``rows`` (tokenized once, outside the timing)."""
    import vllm

    from peagle_core.drafter_config import default_aux_layer_ids
    from pipelines.assets import text_config
    from pipelines.capture import tokenize_rows
    from pipelines.capture.vllm_backend import VLLMCaptureEngine, capture_tokenized_vllm

    tokenized = tokenize_rows(tokenizer, rows, max_length_tokens=max_length)
    total = sum(len(r["input_ids"]) for r in tokenized)
    layer_ids = default_aux_layer_ids(int(text_config(path)["num_hidden_layers"]))
    t0 = time.perf_counter()
    engine = VLLMCaptureEngine(path, dtype, layer_ids, dtype, max_length_tokens=max_length,
                               gpu_memory_utilization=gpu_memory_utilization,
                               **({} if torch.cuda.is_available() else {"enforce_eager": True}))
    start_s = time.perf_counter() - t0
    cfg = SimpleNamespace(dtype=dtype, on_too_long="truncate", batch_size=len(tokenized))

    def step() -> None:
        capture_tokenized_vllm(engine, tokenized, cfg, max_length_tokens=max_length)

    step()  # warm-up
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    wall = _median_s(step, sync, repeats)
    row = {"vllm": vllm.__version__, "tokens": total, "engine_start_s": start_s, "vllm_step_tok_s": total / wall}
    print(row, flush=True)
    return row


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipelines.assets import ensure_target

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="conversations as jsonl.xz (bench.gpu_recipe export-data)")
    ap.add_argument("--num-conversations", type=int, default=512)
    ap.add_argument("--max-length", type=int, default=1024, help="tokens per conversation (longer: truncated)")
    ap.add_argument("--repeats", type=int, default=3, help="timed passes per measurement (median)")
    ap.add_argument("--smoke", action="store_true", help="CPU, 8 conversations, batches 4 and 8, one pass")
    ap.add_argument("--batch-sizes", default="8,16,32,64", help="transformers step batches")
    ap.add_argument("--vllm", action="store_true", help="also the vLLM backend (see module doc)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5, help="vLLM backend only")
    ap.add_argument("--target", default="smollm2-135m-instruct", help="an embedded target or a local HF directory, "
                    "e.g. a random-weight Llama-3.1-8B shape from bench.random_target")
    ap.add_argument("--name", default=None, help="result file name (default capture_throughput[_smoke])")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    device, dtype = ("cuda", "bfloat16") if cuda else ("cpu", "float32")
    path = ensure_target(args.target, dtype=dtype).path
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()
    rows = read_jsonl_xz(args.data)[:8 if args.smoke else args.num_conversations]
    repeats = 1 if args.smoke else args.repeats
    res = measure(model, tok, rows, dtype=dtype, batch_sizes=[4, 8] if args.smoke else
                  [int(b) for b in args.batch_sizes.split(",")], max_length=args.max_length, repeats=repeats)
    if args.vllm:
        del model
        if cuda:
            torch.cuda.empty_cache()
        res["vllm"] = measure_vllm(str(path), tok, rows, dtype=dtype, max_length=args.max_length, repeats=repeats,
                                   gpu_memory_utilization=args.gpu_memory_utilization)
        res["vllm"]["vllm_over_step"] = res["vllm"]["vllm_step_tok_s"] / max(r["step_tok_s"] for r in res["rows"])
    name = args.name or "capture_throughput" + ("_smoke" if args.smoke else "")
    out = write_result(name, {"target": args.target, "dtype": dtype, "max_length": args.max_length, **res,
                              "goal": "step_over_plain >= 0.85"})
    print("wrote", out)


if __name__ == "__main__":
    main()
