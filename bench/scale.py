"""The data-scaling runs of issue 14 on one leased GPU (H100), in calls of <= 10 min and leases of <= 30 min.

The table trains P-EAGLE (4 layers, K_train=8) and EAGLE-3 (1 layer, TTT-7) on the first N conversations
of ONE regenerated set (so the 10k set is a prefix of the 30k set) for the same GPU minutes, then
evaluates every head with vLLM on the CPU box (``bench.eval_gpu_heads``). Data (the mix of
``configs/smollm2-135m-scale.yaml``): multi-turn ShareGPT (every user turn up to ``--max-turns``,
answered turn by turn by the target) and self-instruct prompts the target writes itself (Magpie,
``pipelines.selfinstruct``), 1 : 5, interleaved in a seeded order.

Every subcommand resumes from what ``--keep`` (default ``~/keep``) already holds, so a call that runs
out of time loses at most one chunk or one checkpoint interval:

    python -m bench.scale prompts --num 30000            # GPU: self-instruct prompts (Magpie) -> keep
    python -m bench.scale regenerate --size 30000 --budget-s 480   # GPU: answers, chunk by chunk
    python -m bench.scale pack-data --out $OUT            # regenerated set as .jsonl.xz parts < 16 MiB
    python -m bench.scale unpack-data DIR                 # (next lease) parts -> keep, no regeneration
    python -m bench.scale train --method peagle --size 10000 --train-s 300 --box-s 420 --out $OUT

``train`` time boxes exclude warm-up: the first ``--warmup-steps-excluded`` steps of every call
(compilation of the flex-attention kernels and CUDA graphs) are not counted against ``--box-s``, and
the horizon (cosine schedule, total steps) is ``--train-s`` divided by the seconds per step measured
after warm-up in the first call. A call that reaches its box stops right after a checkpoint; the next
call resumes from it (same samples order, same schedule). When the horizon is reached the head is
exported and returned in parts < 16 MiB (``bench.gpu_recipe join-head`` reassembles them).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import random
import time
from collections import Counter
from pathlib import Path

import torch

from bench.gpu_recipe import DRAFT_VOCAB, LAYERS, _keep, _read_jsonl_xz, _target, _write_jsonl_xz

CHUNK_CONVERSATIONS = 2048  # regeneration resumes at chunk granularity
PART_BYTES = 15 * 2**20     # returned files stay under the 16 MiB limit
RECIPE = Path(__file__).resolve().parents[1] / "configs" / "smollm2-135m-scale.yaml"
SELF_INSTRUCT_SHARE = 5 / 6  # configs/smollm2-135m-scale.yaml: sharegpt weight 1, self_instruct weight 5


def _dtype() -> str:
    return "bfloat16" if torch.cuda.is_available() else "float32"


def _engine(args, *, batch_size: int):
    from pipelines.data.engines import TransformersEngine

    return TransformersEngine(_target(args), dtype=_dtype(), max_model_len=args.max_model_len,
                              name="smollm2-135m-instruct", batch_size=batch_size,
                              static_cache=torch.cuda.is_available(), max_batch_tokens=args.max_batch_tokens)


# ---------------------------------------------------------------------------------------------- prompts


def prompts(args) -> None:
    """Self-instruct user prompts (``pipelines.selfinstruct.generate_prompts``) -> ``keep/selfinstruct.jsonl.xz``."""
    from pipelines.data.selfinstruct import generate_prompts, summary
    from pipelines.recipe import load_recipe

    keep = _keep(args)
    out = keep / "selfinstruct.jsonl.xz"
    if out.exists():
        print(f"{out} exists: {sum(1 for _ in _read_jsonl_xz(out))} prompts")
        return
    src = next(s for s in load_recipe(RECIPE if args.recipe is None else args.recipe).data.sources
               if s.kind == "self_instruct")
    cfg = src.self_instruct.model_copy(update={"num_prompts": args.num, "max_tokens": args.max_tokens})
    stats: Counter = Counter()
    t0 = time.perf_counter()
    rows = generate_prompts(_engine(args, batch_size=args.batch_size), cfg, batch_size=args.batch_size, stats=stats)
    wall = time.perf_counter() - t0
    _write_jsonl_xz(out, rows)
    res = {"requested": args.num, "kept": len(rows), "wall_s": wall, "generate_s": stats["generate_s"],
           "tokens_per_s": stats["num_generated_tokens"] / max(stats["generate_s"], 1e-9),
           "counts": {k: v for k, v in stats.items() if isinstance(v, int)}, "summary": summary(stats)}
    (keep / "scale_prompts.json").write_text(json.dumps(res, indent=2))
    print(json.dumps(res))


# ---------------------------------------------------------------------------------------------- regenerate


def _mixed_order(args) -> list[dict]:
    """The seeded 1:5 interleave of multi-turn ShareGPT and self-instruct rows; prefixes are the table's sizes."""
    keep = _keep(args)
    share = _read_jsonl_xz(Path(args.data) / "sharegpt.jsonl.xz")
    selfi = _read_jsonl_xz(keep / "selfinstruct.jsonl.xz")
    rng = random.Random(0)
    rng.shuffle(share)
    rng.shuffle(selfi)
    for r in share:
        r.setdefault("source", "sharegpt")
    out, i, j = [], 0, 0
    while i < len(share) or j < len(selfi):
        # keep the running share of self-instruct rows at SELF_INSTRUCT_SHARE while both last
        want_self = (j < len(selfi)) and (i >= len(share) or j < SELF_INSTRUCT_SHARE * (i + j + 1))
        if want_self:
            out.append(selfi[j])
            j += 1
        else:
            out.append(share[i])
            i += 1
    return out


def _chunks_dir(keep: Path) -> Path:
    d = keep / "regen"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _regenerated(keep: Path) -> list[dict]:
    return [r for p in sorted(_chunks_dir(keep).glob("chunk-*.jsonl.xz")) for r in _read_jsonl_xz(p)]


def regenerate(args) -> None:
    """Answer the first ``--size`` rows of the mixed order, ``CHUNK_CONVERSATIONS`` at a time, until the budget."""
    from pipelines.data.regenerate import regenerate_conversations
    from pipelines.recipe import RegenerateConfig

    keep = _keep(args)
    order = _mixed_order(args)[: args.size]
    cdir = _chunks_dir(keep)
    done_chunks = {int(p.name.split("-")[1].split(".")[0]) for p in cdir.glob("chunk-*.jsonl.xz")}
    cfg = RegenerateConfig(backend="transformers", temperature=0.0, max_tokens_per_turn=args.max_new_tokens,
                           batch_size=args.batch_size, max_turns=args.max_turns)
    engine = _engine(args, batch_size=args.batch_size)
    stats: Counter = Counter()
    t0, n_new = time.perf_counter(), 0
    for c, s in enumerate(range(0, len(order), CHUNK_CONVERSATIONS)):
        if c in done_chunks:
            continue
        if time.perf_counter() - t0 > args.budget_s:
            break
        rows = regenerate_conversations(order[s:s + CHUNK_CONVERSATIONS], engine, cfg, stats=stats)
        _write_jsonl_xz(cdir / f"chunk-{c:04d}.jsonl.xz", rows)  # written whole, then visible: resume unit
        n_new += len(rows)
        print(f"chunk {c}: {len(rows)} conversations, {stats['num_generated_tokens']} tokens in "
              f"{time.perf_counter() - t0:.0f} s", flush=True)
    wall = time.perf_counter() - t0
    total_chunks = -(-len(order) // CHUNK_CONVERSATIONS)
    done = len({int(p.name.split('-')[1].split('.')[0]) for p in cdir.glob('chunk-*.jsonl.xz')})
    res = {"size": args.size, "chunks_done": done, "chunks_total": total_chunks, "new_conversations": n_new,
           "generated_tokens": stats["num_generated_tokens"], "wall_s": wall,
           "tokens_per_s": stats["num_generated_tokens"] / max(wall, 1e-9), "max_turns": args.max_turns,
           "max_new_tokens": args.max_new_tokens, "batch_size": args.batch_size,
           "counts": {k: v for k, v in stats.items() if isinstance(v, int)}}
    prev = keep / "scale_regenerate.json"
    calls = json.loads(prev.read_text())["calls"] if prev.exists() else []
    prev.write_text(json.dumps({"calls": calls + [res]}, indent=2))
    print(json.dumps(res))


def pack_data(args) -> None:
    """All regenerated chunks -> one ``.jsonl.xz`` cut in parts < 16 MiB under ``--out``."""
    keep = _keep(args)
    rows = _regenerated(keep)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = keep / "regenerated.jsonl.xz"
    _write_jsonl_xz(tmp, rows)
    data = tmp.read_bytes()
    for i in range(0, len(data), PART_BYTES):
        (out / f"regenerated.jsonl.xz.part{i // PART_BYTES:02d}").write_bytes(data[i:i + PART_BYTES])
    print(f"{len(rows)} conversations, {len(data) / 2**20:.1f} MiB in {-(-len(data) // PART_BYTES)} parts")


def unpack_data(args) -> None:
    """Parts from ``pack-data`` -> ``keep/regen/chunk-0000.jsonl.xz`` (resumes as if regenerated here)."""
    keep = _keep(args)
    parts = sorted(Path(args.dir).glob("regenerated.jsonl.xz.part*"))
    if not parts:
        raise SystemExit(f"no regenerated.jsonl.xz.part* under {args.dir}")
    dst = _chunks_dir(keep) / "all.jsonl.xz"
    with open(dst, "wb") as f:
        f.writelines(p.read_bytes() for p in parts)
    rows = _read_jsonl_xz(dst)
    dst.unlink()
    for c, s in enumerate(range(0, len(rows), CHUNK_CONVERSATIONS)):
        _write_jsonl_xz(_chunks_dir(keep) / f"chunk-{c:04d}.jsonl.xz", rows[s:s + CHUNK_CONVERSATIONS])
    print(f"{len(rows)} regenerated conversations restored under {_chunks_dir(keep)}")


def _return_tar(src: Path, dst: Path) -> None:
    """``src`` as an uncompressed tar cut in ``<dst>.partNN`` files < 16 MiB (few files: a call returns <= 8).

    Here: ``cat DIR/head-X.tar.part* | tar x -C outputs/scale-heads``."""
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        tf.add(src, arcname=src.name)
    data = buf.getvalue()
    dst.parent.mkdir(parents=True, exist_ok=True)
    for i in range(0, len(data), PART_BYTES):
        Path(f"{dst}.part{i // PART_BYTES:02d}").write_bytes(data[i:i + PART_BYTES])
    print(f"{src} -> {dst}.part* ({len(data) / 2**20:.1f} MiB)")


# ---------------------------------------------------------------------------------------------- train


class BoxExpired(Exception):
    """Raised after a checkpoint once this call's post-warm-up time box is spent."""


def scale_tag(method: str, size: int, variant: str = "") -> str:
    """Name of one training run (its head ``head-<tag>``, its result ``scale_train_<tag>.json``): method,
    conversations (``10k`` from 1000 up), then the variant's suffix if any, e.g. ``peagle-29k-600s``."""
    tag = f"{method}-{size // 1000}k" if size >= 1000 else f"{method}-{size}"
    return f"{tag}-{variant}" if variant else tag


def train(args) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from bench.gpu_recipe import _online_samples
    from peagle_core.contract import export_head
    from peagle_core.drafter import Eagle3Drafter
    from peagle_core.drafter_config import DrafterConfig
    from peagle_core.objectives import build_objective
    from peagle_core.vocab import vocab_mapping_from_counts
    from pipelines.capture import count_assistant_tokens, prepare_samples
    from pipelines.recipe import load_recipe
    from pipelines.train import (
        TrainCallback,
        estimate_steps_per_epoch,
        init_drafter_from_target,
        load_target_embed,
        load_target_lm_head,
        train_in_process,
    )

    keep = _keep(args)
    method, tag = args.method, scale_tag(args.method, args.size, args.variant)
    state_path, ckpt = keep / f"scale_train_{tag}.json", keep / f"ckpt-{tag}"
    state = json.loads(state_path.read_text()) if state_path.exists() else {"calls": []}
    if state.get("done"):
        print(f"{tag} already trained: {state['head_dir']}")
        return
    recipe = load_recipe(RECIPE)
    tdir = _target(args)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    hf, tok = AutoConfig.from_pretrained(tdir), AutoTokenizer.from_pretrained(tdir)
    target = AutoModelForCausalLM.from_pretrained(tdir, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    target = target.to(device).eval()
    rows = _regenerated(keep)
    if len(rows) < args.size:
        raise SystemExit(f"only {len(rows)} regenerated conversations in {keep}/regen, --size {args.size}")
    rows = rows[: args.size]
    K = recipe.drafter.num_speculative_tokens
    prepared = prepare_samples(tok, rows, max_length_tokens=args.max_length, on_too_long="truncate")
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
    tcfg = recipe.training.model_copy(update={
        "method": method, "batch_tokens": args.batch_tokens, "checkpoint_every_steps": args.checkpoint_every,
        "warmup_steps": args.lr_warmup_steps, "lr": args.lr, "num_epochs": 1000})
    obj_cfg = tcfg.objective_config(K)
    if device == "cpu":
        obj_cfg = dataclasses.replace(obj_cfg, attention="dense")
    objective = build_objective(method, **dataclasses.asdict(obj_cfg))
    steps_per_epoch = estimate_steps_per_epoch(lengths, args.batch_tokens)
    stats: Counter = Counter()

    def samples_for_epoch(epoch: int):
        perm = torch.randperm(len(rows), generator=torch.Generator().manual_seed(epoch)).tolist()
        return _online_samples([rows[i] for i in perm], target, tok, dcfg.aux_layer_ids, args.max_length,
                               args.capture_batch, args.chunk, stats)

    W = args.warmup_steps_excluded
    marks: dict[str, float] = {}

    def timing_log(step: int, m: dict) -> None:
        marks.setdefault("first_step", step)
        if step - marks["first_step"] >= W and "t_warm" not in marks:
            marks["t_warm"], marks["step_warm"] = time.perf_counter(), step
        marks["t_last"], marks["step_last"] = time.perf_counter(), step

    if "horizon" not in state:  # calibrate on a throwaway copy: W warm-up steps, then timed steps
        n = W + args.calib_steps
        train_in_process(samples_for_epoch, copy.deepcopy(drafter), lm_head, objective,
                         tcfg.model_copy(update={"max_steps": n, "warmup_steps": 0}), steps_per_epoch=steps_per_epoch,
                         device=device, log_every_steps=1, on_log=timing_log)
        s_per_step = (marks["t_last"] - marks["t_warm"]) / max(1, marks["step_last"] - marks["step_warm"])
        state.update(horizon=max(1, int(args.train_s / s_per_step)), calib_s_per_step=s_per_step,
                     train_s_goal=args.train_s, size=args.size, method=method, steps_per_epoch=steps_per_epoch,
                     tokens_per_epoch=sum(lengths))
        state_path.write_text(json.dumps(state, indent=2))
        marks.clear()

    class Box(TrainCallback):
        def on_checkpoint(self, step: int, metrics: dict) -> None:
            if "t_warm" in marks and time.perf_counter() - marks["t_warm"] > args.box_s:
                raise BoxExpired(step)

    history: list[dict] = []

    def on_log(step: int, m: dict) -> None:
        timing_log(step, m)
        if step % args.log_every == 0:
            history.append({"step": step, **{k: float(v) for k, v in m.items() if isinstance(v, (int, float))}})
            print(json.dumps(history[-1]), flush=True)

    t0, stopped = time.perf_counter(), None
    res = None
    try:
        res = train_in_process(samples_for_epoch, drafter, lm_head, objective,
                               tcfg.model_copy(update={"max_steps": state["horizon"]}), checkpoint_dir=ckpt,
                               steps_per_epoch=steps_per_epoch, device=device, log_every_steps=1, on_log=on_log,
                               callbacks=[Box()])
    except BoxExpired as e:
        stopped = int(str(e))
    call = {"wall_s": time.perf_counter() - t0, "first_step": marks.get("first_step"),
            "last_step": marks.get("step_last"), "stopped_at_checkpoint": stopped,
            "timed_s": marks.get("t_last", 0) - marks.get("t_warm", 0),
            "timed_steps": marks.get("step_last", 0) - marks.get("step_warm", 0),
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
            "final": history[-1] if history else None}
    state["calls"].append(call)
    if res is not None:
        head = export_head(drafter.cpu(), keep / f"head-{tag}", dtype="bfloat16", include_embed_tokens=False,
                           overwrite=True, extra_config={"method": method, "num_speculative_tokens_trained": K,
                                                          "target": "smollm2-135m-instruct", "steps": res.step,
                                                          "conversations": args.size})
        state.update(done=True, steps=res.step, epochs=res.step / max(1, steps_per_epoch), head_dir=str(head))
        if args.out:
            _return_tar(head, Path(args.out) / f"head-{tag}.tar")
    state_path.write_text(json.dumps(state, indent=2))
    print(json.dumps({k: v for k, v in state.items() if k != "calls"} | {"call": call}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keep", default=os.environ.get("PEAGLE_KEEP", "~/keep"))
    ap.add_argument("--data", default=os.environ.get("PEAGLE_KEEP", "~/keep"), help="dir of sharegpt.jsonl.xz")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-batch-tokens", type=int, default=524288)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prompts")
    p.add_argument("--num", type=int, required=True)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--recipe", default=None)
    p = sub.add_parser("regenerate")
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--budget-s", type=float, default=480)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-turns", type=int, default=2)
    p = sub.add_parser("pack-data")
    p.add_argument("--out", required=True)
    p = sub.add_parser("unpack-data")
    p.add_argument("dir")
    p = sub.add_parser("train")
    p.add_argument("--method", choices=sorted(LAYERS), required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--train-s", type=float, required=True, help="GPU seconds of training (after warm-up), all calls")
    p.add_argument("--box-s", type=float, default=400, help="this call's post-warm-up time box")
    p.add_argument("--warmup-steps-excluded", type=int, default=10)
    p.add_argument("--calib-steps", type=int, default=20)
    p.add_argument("--batch-tokens", type=int, default=16384)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--lr-warmup-steps", type=int, default=50)
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--capture-batch", type=int, default=32)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--checkpoint-every", type=int, default=100)
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--out", default=None, help="return the finished head here, in parts < 16 MiB")
    p.add_argument("--variant", default="", help="suffix of the head / result names (a recipe variant: longer "
                   "training, another lr, ...), e.g. 600s -> head-peagle-29k-600s")
    args = ap.parse_args()
    {"prompts": prompts, "regenerate": regenerate, "pack-data": pack_data, "unpack-data": unpack_data,
     "train": train}[args.cmd](args)


if __name__ == "__main__":
    main()
