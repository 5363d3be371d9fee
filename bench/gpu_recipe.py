"""The GPU recipe (``configs/smollm2-135m-gpu.yaml``) on one GPU box without Ray (issue 7 item 5).

The device machine has torch/transformers but no Ray, vLLM, MLflow or ``datasets``, and a GPU
lease is a few chained 10-minute calls. So this runner drives the SAME stage functions that the
Ray stages wrap, without Ray:

- ``pipelines.data.regenerate.regenerate_conversations`` with ``TransformersEngine`` (self-distillation
  of the assistant turn, time-boxed: the rest keep their ShareGPT answers, counted);
- training through :mod:`bench.harness`: the recipe with :data:`TRAIN_OVERRIDES` (``--set`` adds more), the
  train stage's plan (``plan_from_conversations``: drafter config, d2t/t2d, epoch length), drafter
  (``build_drafter``) and objective, ``pipelines.capture.capture_batch`` run *online* inside the training data
  iterator (the streaming mode: no hidden states on disk) and ``pipelines.train.train_in_process``, for a
  P-EAGLE head and an EAGLE-3 TTT-7 head on the same data, each time-boxed by a calibrated ``max_steps``;
  the head exported as the train stage exports it.

Choices forced by the 64 MiB return path (heads come back to be evaluated with vLLM on CPU):
frozen target embeddings (vLLM shares the target's ``embed_tokens`` when a head has none) and an
8192-token draft vocabulary; P-EAGLE 4 layers, EAGLE-3 1 layer (its usual size).

Subcommands (state under ``--keep``, default ``~/keep``)::

    python -m bench.gpu_recipe export-data --out DIR      # here: conversations + HumanEval -> jsonl.xz
    python -m bench.gpu_recipe regenerate --budget-s 270  # GPU
    python -m bench.gpu_recipe train --method peagle --budget-s 400
    python -m bench.gpu_recipe train --method eagle3 --budget-s 400
    python -m bench.gpu_recipe split-head --method peagle --out $OUT
    python -m bench.gpu_recipe join-head DIR             # here: reassemble a returned head
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from collections import Counter
from pathlib import Path

import torch

from bench.common import keep_dir, read_jsonl_xz, write_jsonl_xz

RECIPE = Path(__file__).resolve().parents[1] / "configs" / "smollm2-135m-gpu.yaml"
DRAFT_VOCAB = 8192
LAYERS = {"peagle": 4, "eagle3": 1}


def _target():
    """The converted SmolLM2 target directory (bf16 on GPU, float32 on CPU)."""
    from pipelines.assets import ensure_target

    dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    return ensure_target("smollm2-135m-instruct", dtype=dtype).path


# ---------------------------------------------------------------------------------------------- here


def export_data(args) -> None:
    """Normalized ShareGPT conversations (all of the packaged file) and HumanEval prompts."""
    from pipelines.data.prompts import load_conversations
    from pipelines.recipe import SourceConfig

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    convs = load_conversations(SourceConfig(kind="sharegpt"), on_bad_row="skip")
    n = write_jsonl_xz(out / "sharegpt.jsonl.xz", ({"id": r["id"], "messages": r["messages"]} for r in convs))
    he = load_conversations(SourceConfig(kind="humaneval"), on_bad_row="fail")
    m = write_jsonl_xz(out / "humaneval.jsonl.xz", ({"id": r["id"], "messages": r["messages"]} for r in he))
    print(f"wrote {n} ShareGPT conversations, {m} HumanEval prompts to {out}")


def join_head(args) -> None:
    """Reassemble ``model.safetensors`` from ``model.safetensors.part*`` and verify checksums."""
    from peagle_core.contract import verify_checksums

    d = Path(args.dir)
    parts = sorted(d.glob("model.safetensors.part*"))
    if parts:
        with open(d / "model.safetensors", "wb") as f:
            f.writelines(p.read_bytes() for p in parts)
        for p in parts:
            p.unlink()
    verify_checksums(d)
    print("ok", d)


# ---------------------------------------------------------------------------------------------- GPU


def regenerate(args) -> None:
    """Regenerate first assistant turns with the target until the time budget is spent."""
    from pipelines.data.engines import TransformersEngine
    from pipelines.data.regenerate import regenerate_conversations
    from pipelines.recipe import RegenerateConfig

    keep = keep_dir(args.keep)
    convs = read_jsonl_xz(Path(args.data) / "sharegpt.jsonl.xz")
    if args.limit:
        convs = convs[: args.limit]
    dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    engine = TransformersEngine(_target(), dtype=dtype, max_model_len=args.max_model_len,
                                name="smollm2-135m-instruct")
    cfg = RegenerateConfig(backend="transformers", temperature=0.0, max_tokens_per_turn=args.max_new_tokens,
                           batch_size=args.batch_size, max_turns=1)
    # Long prompts last so that the time box drops the most expensive ones.
    order = sorted(range(len(convs)), key=lambda i: len(json.dumps(convs[i]["messages"][:2])))
    stats: Counter = Counter()
    out: dict[str, dict] = {}
    t0 = time.perf_counter()
    for s in range(0, len(order), args.batch_size):
        if time.perf_counter() - t0 > args.budget_s:
            break
        rows = [convs[i] for i in order[s:s + args.batch_size]]
        for r in regenerate_conversations(rows, engine, cfg, stats=stats):
            out[r["id"]] = r
    wall = time.perf_counter() - t0
    merged = [out.get(c["id"], {**c, "regenerated": False}) for c in convs]
    for r in merged:
        r.setdefault("regenerated", True)
    write_jsonl_xz(keep / "train.jsonl.xz", merged)
    res = {"conversations": len(convs), "regenerated": len(out), "generated_tokens": stats["num_generated_tokens"],
           "regenerate_s": wall, "tokens_per_s": stats["num_generated_tokens"] / max(wall, 1e-9),
           "max_new_tokens": args.max_new_tokens, "batch_size": args.batch_size, "dtype": dtype}
    (keep / "regenerate.json").write_text(json.dumps(res, indent=2))
    print(json.dumps(res))


# The GPU recipe's heads: configs/smollm2-135m-gpu.yaml with these overrides (plus the method's and LAYERS').
# 8192-token draft vocabulary and frozen target embeddings: heads small enough for the 64 MiB return path, served
# with the target's embeddings (vLLM shares embed_tokens when a head has none).
TRAIN_OVERRIDES = (f"drafter.draft_vocab_size={DRAFT_VOCAB}", "drafter.train_embed_tokens=false",
                   "training.batch_tokens=16384", "training.lr=6e-4", "training.warmup_steps=50",
                   "training.num_epochs=1000", "data.max_length_tokens=1024")


def train(args) -> None:
    """Train one head through the product (``bench.harness``), time-boxed by a calibrated ``max_steps``."""
    from bench.harness import bench_recipe, prepare, resolved

    keep = keep_dir(args.keep)
    recipe = bench_recipe(RECIPE, [f"training.method={args.method}", f"drafter.num_layers={LAYERS[args.method]}",
                                   *TRAIN_OVERRIDES, *args.set])
    rows = read_jsonl_xz(keep / "train.jsonl.xz")[: args.limit or None]
    t_prep = time.perf_counter()
    run = prepare(recipe, rows, chunk=args.chunk)
    # calibrate: a short run gives seconds/step (compilation included), then the time box sets max_steps
    s_per_step = run.seconds_per_step(warmup_steps=0, timed_steps=args.calib_steps)
    max_steps = args.max_steps or max(1, int((args.budget_s - (time.perf_counter() - t_prep)) / s_per_step))
    history: list[dict] = []

    def on_log(step: int, m: dict) -> None:
        history.append({"step": step, **{k: float(v) for k, v in m.items() if isinstance(v, (int, float))}})
        print(json.dumps(history[-1]), flush=True)

    t1 = time.perf_counter()
    res = run.train(max_steps, log_every_steps=args.log_every, on_log=on_log)
    train_s = time.perf_counter() - t1
    head = run.export(keep / f"head-{args.method}", step=res.step)
    plan = run.plan
    summary = {
        "method": args.method, "layers": LAYERS[args.method], "K": plan.drafter_spec.num_speculative_tokens,
        "draft_vocab_size": plan.drafter.draft_vocab_size, "conversations": len(rows),
        "regenerated": sum(bool(r.get("regenerated")) for r in rows), "tokens_per_epoch": plan.num_tokens,
        "steps": res.step, "steps_per_epoch": plan.steps_per_epoch, "epochs": res.step / max(1, plan.steps_per_epoch),
        "batch_tokens": plan.training.batch_tokens, "train_s": train_s, "s_per_step": train_s / max(1, res.step),
        "calib_s_per_step": s_per_step, "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30
        if torch.cuda.is_available() else None, "captured_tokens": run.stats["num_tokens"],
        "objective": dataclasses.asdict(plan.objective), "lr": plan.training.lr, "recipe": resolved(recipe),
        "overrides": list(args.set), "final": history[-1] if history else None, "head_dir": str(head),
    }
    (keep / f"train-{args.method}.json").write_text(json.dumps({**summary, "history": history}, indent=2))
    print(json.dumps(summary))


def split_head(args) -> None:
    """Copy a head to ``--out`` with ``model.safetensors`` cut in parts of < 16 MiB (return limit)."""
    import shutil

    keep = keep_dir(args.keep)
    src = keep / f"head-{args.method}"
    out = Path(args.out) / f"head-{args.method}"
    out.mkdir(parents=True, exist_ok=True)
    for p in src.iterdir():
        if p.name != "model.safetensors":
            shutil.copy(p, out / p.name)
    data = (src / "model.safetensors").read_bytes()
    step = 15 * 2**20
    for i in range(0, len(data), step):
        (out / f"model.safetensors.part{i // step:02d}").write_bytes(data[i:i + step])
    for name in ("regenerate.json", f"train-{args.method}.json"):
        if (keep / name).exists():
            shutil.copy(keep / name, Path(args.out) / name)
    print("split", src, "->", out, len(data), "bytes")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keep", default=os.environ.get("PEAGLE_KEEP", "~/keep"))
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("export-data")
    p.add_argument("--out", required=True)
    p = sub.add_parser("join-head")
    p.add_argument("dir")
    p = sub.add_parser("regenerate")
    p.add_argument("--data", required=True)
    p.add_argument("--budget-s", type=float, default=270)
    p.add_argument("--batch-size", type=int, default=384)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--limit", type=int, default=0)
    p = sub.add_parser("train")
    p.add_argument("--method", choices=sorted(LAYERS), required=True)
    p.add_argument("--budget-s", type=float, default=400)
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="a recipe override on top of TRAIN_OVERRIDES, e.g. training.num_partitions=2")
    p.add_argument("--chunk", type=int, default=256, help="conversations per online capture call")
    p.add_argument("--calib-steps", type=int, default=8)
    p.add_argument("--max-steps", type=int, default=0, help="fixed steps (calibration includes compile warm-up)")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--limit", type=int, default=0)
    p = sub.add_parser("split-head")
    p.add_argument("--method", choices=sorted(LAYERS), required=True)
    p.add_argument("--out", required=True)
    args = ap.parse_args()
    {"export-data": export_data, "join-head": join_head, "regenerate": regenerate, "train": train,
     "split-head": split_head}[args.cmd](args)


if __name__ == "__main__":
    main()
