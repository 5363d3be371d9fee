"""Online vs offline training step (issue 14 item 4; goal: online step at N=8192 <= 1.15x offline).

Both steps train the GPU recipe's P-EAGLE head (``configs/smollm2-135m-gpu.yaml`` with K=8, set up through the
product: ``bench.harness.build_head``, ``pipelines.train.build_optimizer``) on packed batches of
``--num-tokens`` real ShareGPT tokens:

* ``offline``: the captured samples were materialized before (host memory, as read from shards);
  a step = pack -> host-to-device copy -> ``forward_backward`` -> AdamW;
* ``online``: a step first runs the capture on the GPU for that batch's conversations
  (:func:`pipelines.capture.capture_batch`: tokenization, target forward, aux + final hidden states)
  and then trains on them as above; no hidden state reaches the disk.

Median over ``--iters`` steps after ``--warmup``, CUDA synchronized. Also on CPU with ``--smoke``.

    python -m bench.online_step --data ~/keep/sharegpt.jsonl.xz            # GPU
"""

from __future__ import annotations

import argparse
import json
import lzma
from pathlib import Path

import torch

from bench.common import time_ms, write_result

RECIPE = Path(__file__).resolve().parents[1] / "configs" / "smollm2-135m-gpu.yaml"
K = 8  # drafter.num_speculative_tokens of the measured step (the scaling table's K_train)


def _conversations(path: Path, limit: int) -> list[dict]:
    with lzma.open(path, "rt") as f:
        return [json.loads(line) for _, line in zip(range(limit), f)]


def _batches(rows, tokenizer, num_tokens: int, max_len: int, count: int) -> list[list[dict]]:
    """Groups of conversations whose tokens fill one packed batch of ``num_tokens``."""
    from pipelines.capture import prepare_samples

    lengths = {p[0]: len(p[1]) for p in prepare_samples(tokenizer, rows, max_length_tokens=max_len,
                                                        on_too_long="truncate")}
    out, cur, used = [], [], 0
    for r in rows:
        n = lengths.get(str(r["id"]))
        if not n:
            continue
        if used + n > num_tokens and cur:
            out.append(cur)
            cur, used = [], 0
            if len(out) == count:
                break
        cur.append(r)
        used += n
    return out


def main() -> None:
    from bench.harness import bench_recipe, build_head, load_recipe_target, special_ids
    from peagle_core.batch import pack_samples
    from pipelines.capture import capture_batch
    from pipelines.train import build_optimizer

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True)
    ap.add_argument("--num-tokens", type=int, default=8192)
    ap.add_argument("--max-length", type=int, default=2048)
    ap.add_argument("--capture-batch", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny: 1024 tokens, 2 iterations")
    args = ap.parse_args()
    if args.smoke:
        args.num_tokens, args.warmup, args.iters = 1024, 1, 2

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    overrides = [f"drafter.num_speculative_tokens={K}", f"data.max_length_tokens={args.max_length}",
                 f"capture.batch_size={args.capture_batch}"]
    recipe = bench_recipe(RECIPE, overrides)
    target, tok = load_recipe_target(recipe)
    rows = _conversations(Path(args.data).expanduser(), 4000)
    groups = _batches(rows, tok, args.num_tokens, args.max_length, args.warmup + args.iters)
    head = build_head(recipe, [r for g in groups for r in g], always_keep=special_ids(tok))
    drafter, obj, plan = head.drafter.to(device), head.objective, head.plan
    opt = build_optimizer(drafter, plan.training)
    lm_head = head.lm_head.to(device=device, dtype=getattr(torch, recipe.target.dtype))
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)

    def capture(group):
        return capture_batch(target, tok, group, recipe.capture, plan.drafter.aux_layer_ids,
                             max_length_tokens=args.max_length, validate=False)

    def train_on(samples) -> int:
        (packed,) = pack_samples(samples, args.num_tokens)
        packed = packed.to(device)
        opt.zero_grad(set_to_none=True)
        with autocast:
            obj.forward_backward(drafter, packed, target_lm_head=lm_head)
        opt.step()
        return int(packed.input_ids.numel())

    materialized = [capture(g) for g in groups]  # offline: captured before training (host tensors)
    res: dict = {"num_tokens": args.num_tokens, "dtype": recipe.target.dtype, "K": K,
                 "layers": plan.drafter.num_hidden_layers, "device": torch.cuda.get_device_name() if cuda else "cpu",
                 "recipe": RECIPE.name, "overrides": overrides,
                 "tokens_per_batch": [sum(len(s["input_ids"]) for s in m) for m in materialized]}
    for label, step in (("offline", lambda i: train_on(materialized[i])),
                        ("online", lambda i: train_on(capture(groups[i]))),
                        ("capture_only", lambda i: capture(groups[i]))):
        batches = iter(range(len(groups)))  # every timed call trains on the next batch
        res[f"{label}_ms"] = time_ms(lambda step=step, batches=batches: step(next(batches)), warmup=args.warmup,
                                     iters=len(groups) - args.warmup)
        print(label, f"{res[f'{label}_ms']:.1f} ms", flush=True)
    res["online_over_offline"] = res["online_ms"] / res["offline_ms"]
    print(json.dumps(res))
    write_result("online_step_smoke" if args.smoke else "online_step", res)


if __name__ == "__main__":
    main()
