"""The GPU recipe (``configs/smollm2-135m-gpu.yaml``) on one GPU box without Ray (issue 7 item 5).

The device machine has torch/transformers but no Ray, vLLM, MLflow or ``datasets``, and a GPU
lease is a few chained 10-minute calls. So this runner drives the SAME stage functions that the
Ray stages wrap, without Ray:

- ``pipelines.regenerate.regenerate_conversations`` with ``TransformersEngine`` (self-distillation
  of the assistant turn, time-boxed: the rest keep their ShareGPT answers, counted);
- ``pipelines.capture.capture_batch`` run *online* inside the training data iterator (the
  streaming mode: no hidden states on disk);
- ``pipelines.train.train_in_process`` (+ ``init_drafter_from_target``, ``TrainingConfig.objective_config``) for a
  P-EAGLE head and an EAGLE-3 TTT-7 head on the same data, each time-boxed by a calibrated
  ``max_steps``;
- ``peagle_core.contract.export_head``.

Choices forced by the 64 MiB return path (heads come back to be evaluated with vLLM on CPU):
frozen target embeddings (vLLM shares the target's ``embed_tokens`` when a head has none) and an
8192-token draft vocabulary (d2t/t2d from regenerated assistant-token counts); P-EAGLE 4 layers,
EAGLE-3 1 layer (its usual size).

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
import copy
import dataclasses
import json
import lzma
import os
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import torch

RECIPE = Path(__file__).resolve().parents[1] / "configs" / "smollm2-135m-gpu.yaml"
DRAFT_VOCAB = 8192
LAYERS = {"peagle": 4, "eagle3": 1}


def _keep(args) -> Path:
    p = Path(args.keep).expanduser()
    p.mkdir(parents=True, exist_ok=True)
    return p


def _read_jsonl_xz(path: Path) -> list[dict]:
    with lzma.open(path, "rt") as f:
        return [json.loads(line) for line in f]


def _write_jsonl_xz(path: Path, rows) -> int:
    n = 0
    with lzma.open(path, "wt", preset=9) as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
            n += 1
    return n


def _target(args):
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
    n = _write_jsonl_xz(out / "sharegpt.jsonl.xz", ({"id": r["id"], "messages": r["messages"]} for r in convs))
    he = load_conversations(SourceConfig(kind="humaneval"), on_bad_row="fail")
    m = _write_jsonl_xz(out / "humaneval.jsonl.xz", ({"id": r["id"], "messages": r["messages"]} for r in he))
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

    keep = _keep(args)
    convs = _read_jsonl_xz(Path(args.data) / "sharegpt.jsonl.xz")
    if args.limit:
        convs = convs[: args.limit]
    dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    engine = TransformersEngine(_target(args), dtype=dtype, max_model_len=args.max_model_len,
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
    _write_jsonl_xz(keep / "train.jsonl.xz", merged)
    res = {"conversations": len(convs), "regenerated": len(out), "generated_tokens": stats["num_generated_tokens"],
           "regenerate_s": wall, "tokens_per_s": stats["num_generated_tokens"] / max(wall, 1e-9),
           "max_new_tokens": args.max_new_tokens, "batch_size": args.batch_size, "dtype": dtype}
    (keep / "regenerate.json").write_text(json.dumps(res, indent=2))
    print(json.dumps(res))


def _online_samples(rows, model, tokenizer, layer_ids, max_len, batch_size, chunk, stats):
    """Streaming capture: conversation rows -> captured samples, target forward on the GPU."""
    from pipelines.capture import capture_batch

    cfg = SimpleNamespace(dtype="bfloat16" if torch.cuda.is_available() else "float32", on_too_long="truncate",
                          batch_size=batch_size)
    for s in range(0, len(rows), chunk):
        yield from capture_batch(model, tokenizer, rows[s:s + chunk], cfg, layer_ids, max_length_tokens=max_len,
                                 stats=stats, validate=False)


def train(args) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from peagle_core.contract import export_head
    from peagle_core.drafter import Eagle3Drafter
    from peagle_core.drafter_config import DrafterConfig
    from peagle_core.objectives import build_objective
    from peagle_core.vocab import vocab_mapping_from_counts
    from pipelines.capture import count_assistant_tokens, prepare_samples
    from pipelines.recipe import load_recipe
    from pipelines.train import (
        estimate_steps_per_epoch,
        init_drafter_from_target,
        load_target_embed,
        load_target_lm_head,
        train_in_process,
    )

    keep = _keep(args)
    recipe = load_recipe(RECIPE)
    method = args.method
    tdir = _target(args)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    hf = AutoConfig.from_pretrained(tdir)
    tok = AutoTokenizer.from_pretrained(tdir)
    target = AutoModelForCausalLM.from_pretrained(tdir, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    target = target.to(device).eval()
    rows = _read_jsonl_xz(keep / "train.jsonl.xz")
    if args.limit:
        rows = rows[: args.limit]
    K = recipe.drafter.num_speculative_tokens
    max_len = args.max_length or recipe.data.max_length_tokens
    t_prep = time.perf_counter()
    prepared = prepare_samples(tok, rows, max_length_tokens=max_len, on_too_long="truncate")
    lengths = [len(p[1]) for p in prepared]
    counts = count_assistant_tokens(({"input_ids": p[1], "loss_mask": p[2]} for p in prepared), hf.vocab_size)
    eos = [i for i in (tok.eos_token_id, tok.pad_token_id) if i is not None]
    d2t, t2d = vocab_mapping_from_counts(counts, DRAFT_VOCAB, always_keep=eos)
    dcfg = DrafterConfig.from_target(hf, num_hidden_layers=LAYERS[method], draft_vocab_size=DRAFT_VOCAB,
                                     mask_token_id=recipe.drafter.mask_token_id if method == "peagle" else None)
    torch.manual_seed(0)
    drafter = Eagle3Drafter(dcfg)
    drafter.set_vocab_mapping(d2t, t2d)
    lm_head = load_target_lm_head(tdir)
    init_drafter_from_target(drafter, load_target_embed(tdir), lm_head)
    drafter.embed_tokens.weight.requires_grad_(False)  # frozen target embeddings (not exported)
    tcfg = recipe.training.model_copy(update={"method": method, "batch_tokens": args.batch_tokens,
                                              "checkpoint_every_steps": 0, "num_partitions": args.num_partitions,
                                              "warmup_steps": args.warmup_steps, "lr": args.lr})
    obj_cfg = tcfg.objective_config(recipe.drafter.num_speculative_tokens)
    if device == "cpu":
        obj_cfg = dataclasses.replace(obj_cfg, attention="dense")
    obj_kw = dataclasses.asdict(obj_cfg)
    steps_per_epoch = estimate_steps_per_epoch(lengths, args.batch_tokens)
    layer_ids = dcfg.aux_layer_ids
    stats: Counter = Counter()

    def samples_for_epoch(epoch: int):
        g = torch.Generator().manual_seed(epoch)
        perm = torch.randperm(len(rows), generator=g).tolist()
        return _online_samples([rows[i] for i in perm], target, tok, layer_ids, max_len, args.capture_batch,
                               args.chunk, stats)

    # Calibrate: a short run gives seconds/step, then the time box sets max_steps.
    calib_steps = args.calib_steps
    t0 = time.perf_counter()
    train_in_process(samples_for_epoch, copy.deepcopy(drafter), lm_head, build_objective(method, **obj_kw),
                 tcfg.model_copy(update={"max_steps": calib_steps, "warmup_steps": 0}),
                 steps_per_epoch=steps_per_epoch, device=device, log_every_steps=max(1, calib_steps))
    s_per_step = (time.perf_counter() - t0) / calib_steps
    max_steps = args.max_steps or max(1, int((args.budget_s - (time.perf_counter() - t_prep)) / s_per_step))
    history = []

    def on_log(step: int, m: dict) -> None:
        history.append({"step": step, **{k: float(v) for k, v in m.items() if isinstance(v, (int, float))}})
        print(json.dumps(history[-1]), flush=True)

    t1 = time.perf_counter()
    res = train_in_process(samples_for_epoch, drafter, lm_head, build_objective(method, **obj_kw),
                       tcfg.model_copy(update={"max_steps": max_steps, "num_epochs": 1000}),
                       steps_per_epoch=steps_per_epoch, device=device, log_every_steps=args.log_every,
                       on_log=on_log)
    train_s = time.perf_counter() - t1
    head = export_head(drafter.cpu(), keep / f"head-{method}", dtype="bfloat16", include_embed_tokens=False,
                       overwrite=True, extra_config={"method": method, "num_speculative_tokens_trained": K,
                                                      "target": "smollm2-135m-instruct", "steps": res.step})
    summary = {
        "method": method, "layers": LAYERS[method], "K": K, "draft_vocab_size": DRAFT_VOCAB,
        "conversations": len(rows), "regenerated": sum(bool(r.get("regenerated")) for r in rows),
        "tokens_per_epoch": sum(lengths), "steps": res.step, "steps_per_epoch": steps_per_epoch,
        "epochs": res.step / max(1, steps_per_epoch), "batch_tokens": args.batch_tokens,
        "train_s": train_s, "s_per_step": train_s / max(1, res.step), "calib_s_per_step": s_per_step,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
        "captured_tokens": stats["num_tokens"], "objective": obj_kw, "lr": args.lr,
        "final": history[-1] if history else None, "head_dir": str(head),
    }
    (keep / f"train-{method}.json").write_text(json.dumps({**summary, "history": history}, indent=2))
    print(json.dumps(summary))


def split_head(args) -> None:
    """Copy a head to ``--out`` with ``model.safetensors`` cut in parts of < 16 MiB (return limit)."""
    import shutil

    keep = _keep(args)
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
    p.add_argument("--batch-tokens", type=int, default=16384)
    p.add_argument("--num-partitions", type=int, default=1)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--capture-batch", type=int, default=32)
    p.add_argument("--chunk", type=int, default=256)
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
