"""The data-scaling runs of issue 14 on one leased GPU (H100), in calls of <= 10 min and leases of <= 30 min.

The table trains P-EAGLE (4 layers, K_train=8) and EAGLE-3 (1 layer, TTT-7) on the first N conversations
of ONE regenerated set (so the 10k set is a prefix of the 30k set) for the same GPU minutes, then
evaluates every head with vLLM on the CPU box (``bench.eval_gpu_heads``). Training goes through the product
(``bench.scale_train``: the recipe with ``--set`` overrides, the train stage's plan, drafter and trainer). Data (the mix of
``configs/smollm2-135m-scale.yaml``): multi-turn ShareGPT (every user turn up to ``--max-turns``,
answered turn by turn by the target) and self-instruct prompts the target writes itself (Magpie,
``pipelines.data.selfinstruct``), 1 : 5, interleaved in a seeded order.

Every subcommand resumes from what ``--keep`` (default ``~/keep``) already holds, so a call that runs
out of time loses at most one chunk or one checkpoint interval:

    python -m bench.scale prompts --num 30000            # GPU: self-instruct prompts (Magpie) -> keep
    python -m bench.scale regenerate --size 30000 --budget-s 480   # GPU: answers, chunk by chunk
        [--engine vllm --shard 1/4 --kv-cache-gib 15]   # vLLM; one of 4 engines sharing the GPU
    python -m bench.scale pack-data --out $OUT            # regenerated set as .jsonl.xz parts < 16 MiB
    python -m bench.scale unpack-data DIR                 # (next lease) parts -> keep, no regeneration
    python -m bench.scale train --method peagle --size 10000 --train-s 300 --box-s 420 --out $OUT
        [--variant lr12e-4 --set training.lr=1.2e-3] [--run 2]   # a recipe variant; a repeat of a recipe
    python -m bench.scale record DIR/scale_train_<head>.json --data-build 2   # here: a row of the results
        [--stopped-at STEP --note WHY]                    # a run that will not finish
    python -m bench.scale export-checkpoint STATE CKPT_DIR --out DIR   # here: a head from a checkpoint's weights
    python -m bench.scale record-regenerate FILE... --build 3 [--lengths]   # here: calls (+ set lengths) -> results

A run is named by its recipe, ``<method>-<size>k[-<variant>]`` (its ``tag``), and ``--run`` (1, 2, ... for
repeats of the same recipe): the head ``head-<tag>`` (``head-<tag>-run<N>`` for N > 1), the row ``(tag, run)``
of ``bench/results/scale_train.json``. ``train`` and ``record``: :mod:`bench.scale_train`.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import random
import re
import time
from collections import Counter
from pathlib import Path

import torch

from bench.common import environment, keep_dir, read_jsonl_xz, write_jsonl_xz

CHUNK_CONVERSATIONS = 2048  # regeneration resumes at chunk granularity
PART_BYTES = 15 * 2**20     # returned files stay under the 16 MiB limit
RECIPE = Path(__file__).resolve().parents[1] / "configs" / "smollm2-135m-scale.yaml"
MIX = {"sharegpt": 1, "self_instruct": 5}  # configs/smollm2-135m-scale.yaml: the sources' weights
SELF_INSTRUCT_SHARE = MIX["self_instruct"] / sum(MIX.values())
LAYERS = {"peagle": 4, "eagle3": 1}  # drafter.num_layers per method (EAGLE-3 at its usual size)
DATA_DIR = Path(__file__).resolve().parent / "data" / "scale"  # the committed regenerated set


def scale_tag(method: str, size: int, variant: str = "") -> str:
    """The recipe name of a training run: method, conversations (``10k`` from 1000 up), then the variant's
    suffix if any, e.g. ``peagle-29k-600s``."""
    tag = f"{method}-{size // 1000}k" if size >= 1000 else f"{method}-{size}"
    return f"{tag}-{variant}" if variant else tag


def head_name(tag: str, run: int = 1) -> str:
    """``<tag>`` for a recipe's first run, ``<tag>-run<N>`` for a repeat (its head ``head-<name>``)."""
    return tag if run == 1 else f"{tag}-run{run}"


def checkpoint_head_name(name: str, step: int) -> str:
    """``<name>-step<N>``: a head exported from run ``name``'s step-``N`` checkpoint (``export-checkpoint``)."""
    return f"{name}-step{step}"


def checkpoint_ref(label: str) -> tuple[str, int | None]:
    """``(name, step)`` of a :func:`checkpoint_head_name` label; ``(label, None)`` for any other label."""
    name, _, step = label.rpartition("-step")
    return (name, int(step)) if name and step.isdigit() else (label, None)


def head_ref(dir_name: str) -> tuple[str, int]:
    """``(tag, run)`` of a head directory name (``head-<tag>`` or ``head-<tag>-run<N>``), inverse of
    :func:`head_name`."""
    name = dir_name.removeprefix("head-")
    m = re.fullmatch(r"(.+)-run(\d+)", name)
    return (m.group(1), int(m.group(2))) if m else (name, 1)


def _dtype() -> str:
    return "bfloat16" if torch.cuda.is_available() else "float32"


def _engine(args, *, batch_size: int):
    """The target's engine for ``--engine``: the product's static-cache transformers engine, or its vLLM engine
    (``pipelines.data.engines.make_engine``) with ``--max-num-seqs`` and ``--gpu-memory-utilization``."""
    from pipelines.assets import ensure_target
    from pipelines.data.engines import make_engine

    path = ensure_target("smollm2-135m-instruct", dtype=_dtype()).path
    if args.engine == "vllm":
        extra = {"max_num_seqs": args.max_num_seqs} if args.max_num_seqs else {}
        if args.kv_cache_gib:  # vLLM then skips its memory profile, which another engine on the GPU would skew
            extra["kv_cache_memory_bytes"] = int(args.kv_cache_gib * 2**30)
        return make_engine("vllm", path, dtype=_dtype(), max_model_len=args.max_model_len,
                           name="smollm2-135m-instruct", gpu_memory_utilization=args.gpu_memory_utilization, **extra)
    return make_engine("transformers", path, dtype=_dtype(), max_model_len=args.max_model_len,
                       name="smollm2-135m-instruct", batch_size=batch_size, static_cache=torch.cuda.is_available(),
                       max_batch_tokens=args.max_batch_tokens)


def _engine_record(args) -> dict:
    """What a result row says about the engine that made it."""
    rec = {"engine": args.engine, "max_model_len": args.max_model_len}
    if args.engine == "vllm":
        from pipelines.preflight import installed_vllm_version

        rec |= {"vllm": installed_vllm_version(), "max_num_seqs": args.max_num_seqs, "kv_cache_gib": args.kv_cache_gib}
    return rec


# ---------------------------------------------------------------------------------------------- prompts


def prompts(args) -> None:
    """Self-instruct user prompts (``pipelines.data.selfinstruct.generate_prompts``) -> ``keep/selfinstruct.jsonl.xz``."""
    from pipelines.data.selfinstruct import generate_prompts, summary
    from pipelines.recipe import load_recipe

    keep = keep_dir(args.keep)
    out = keep / "selfinstruct.jsonl.xz"
    if out.exists():
        print(f"{out} exists: {sum(1 for _ in read_jsonl_xz(out))} prompts")
        return
    src = next(s for s in load_recipe(RECIPE if args.recipe is None else args.recipe).data.sources
               if s.kind == "self_instruct")
    cfg = src.self_instruct.model_copy(update={"num_prompts": args.num, "max_tokens": args.max_tokens})
    stats: Counter = Counter()
    t0 = time.perf_counter()
    rows = generate_prompts(_engine(args, batch_size=args.batch_size), cfg, batch_size=args.batch_size, stats=stats)
    wall = time.perf_counter() - t0
    write_jsonl_xz(out, rows)
    res = {"requested": args.num, "kept": len(rows), "wall_s": wall, "generate_s": stats["generate_s"],
           "tokens_per_s": stats["num_generated_tokens"] / max(stats["generate_s"], 1e-9),
           "counts": {k: v for k, v in stats.items() if isinstance(v, int)}, "summary": summary(stats),
           **_engine_record(args)}
    (keep / "scale_prompts.json").write_text(json.dumps(res, indent=2))
    print(json.dumps(res))


# ---------------------------------------------------------------------------------------------- regenerate


def _mixed_order(args) -> list[dict]:
    """The seeded 1:5 interleave of multi-turn ShareGPT and self-instruct rows; prefixes are the table's sizes."""
    keep = keep_dir(args.keep)
    share = read_jsonl_xz(Path(args.data) / "sharegpt.jsonl.xz")
    selfi = read_jsonl_xz(keep / "selfinstruct.jsonl.xz")
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


def _done_chunks(chunks_dir: Path) -> set[int]:
    """Numbers of the chunks written under ``chunks_dir`` (``chunk-NNNN.jsonl.xz``)."""
    return {int(p.name.split("-")[1].split(".")[0]) for p in chunks_dir.glob("chunk-*.jsonl.xz")}


def regenerated(keep: Path) -> list[dict]:
    return [r for p in sorted(_chunks_dir(keep).glob("chunk-*.jsonl.xz")) for r in read_jsonl_xz(p)]


def regenerate(args) -> None:
    """Answer the first ``--size`` rows of the mixed order, ``CHUNK_CONVERSATIONS`` at a time, until the budget."""
    from pipelines.data.regenerate import regenerate_conversations
    from pipelines.recipe import RegenerateConfig

    shard, num_shards = args.shard
    keep = keep_dir(args.keep)
    order = _mixed_order(args)[: args.size]
    cdir = _chunks_dir(keep)
    done_chunks = _done_chunks(cdir)
    cfg = RegenerateConfig(backend=args.engine, temperature=0.0, max_tokens_per_turn=args.max_new_tokens,
                           batch_size=args.batch_size, max_turns=args.max_turns)
    engine = _engine(args, batch_size=args.batch_size)
    stats: Counter = Counter()
    t0, n_new = time.perf_counter(), 0
    total_chunks = -(-len(order) // CHUNK_CONVERSATIONS)
    # --shard I/N: this process answers the chunks c with c % N == I (N engines share the GPU, each its own chunks)
    todo = [c for c in range(total_chunks) if c not in done_chunks and c % num_shards == shard]

    def chunk_rows(c: int) -> list[dict]:
        return order[c * CHUNK_CONVERSATIONS:(c + 1) * CHUNK_CONVERSATIONS]

    for g in range(0, len(todo), args.chunks_per_call):
        if time.perf_counter() - t0 > args.budget_s:
            break
        group = todo[g:g + args.chunks_per_call]  # one engine call over several chunks: fewer stragglers' tails
        rows = regenerate_conversations([r for c in group for r in chunk_rows(c)], engine, cfg, stats=stats)
        by_id = {r["id"]: r for r in rows}
        for c in group:
            chunk = [by_id[str(r["id"])] for r in chunk_rows(c) if str(r["id"]) in by_id]
            write_jsonl_xz(cdir / f"chunk-{c:04d}.jsonl.xz", chunk)  # written whole, then visible: resume unit
            n_new += len(chunk)
        print(f"chunks {group[0]}-{group[-1]}: {len(rows)} conversations, {stats['num_generated_tokens']} tokens in "
              f"{time.perf_counter() - t0:.0f} s", flush=True)
    wall = time.perf_counter() - t0
    done = len(_done_chunks(cdir))
    res = {"size": args.size, "chunks_done": done, "chunks_total": total_chunks, "new_conversations": n_new,
           "generated_tokens": stats["num_generated_tokens"], "wall_s": wall,
           "tokens_per_s": stats["num_generated_tokens"] / max(wall, 1e-9), "max_turns": args.max_turns,
           "max_new_tokens": args.max_new_tokens, "batch_size": args.batch_size, "mix": MIX,
           "chunks_per_call": args.chunks_per_call, "shard": f"{shard}/{num_shards}", **_engine_record(args),
           "counts": {k: v for k, v in stats.items() if isinstance(v, int)}}
    env = environment()
    res |= {"date": env["date"][:10], "device": env["device"]}
    prev = keep / "scale_regenerate.json"
    with open(keep / "scale_regenerate.lock", "w") as lock:  # the shards of one call append one after another
        fcntl.flock(lock, fcntl.LOCK_EX)
        calls = json.loads(prev.read_text())["calls"] if prev.exists() else []
        prev.write_text(json.dumps({"calls": calls + [res]}, indent=2))
    print(json.dumps(res))


def set_lengths(rows: list[dict], tokenizer) -> dict:
    """Length distribution of regenerated conversations (issue 26 item 1): tokens per conversation with the chat
    template (``tokenizer.apply_chat_template``), percentiles, counts over 1,024 / 2,048 / 4,096 tokens, rows per
    source and per number of assistant turns."""
    lens = torch.tensor([len(tokenizer.apply_chat_template(r["messages"], tokenize=True, return_dict=True)["input_ids"])
                         for r in rows])
    q = torch.quantile(lens.double(), torch.tensor([0.1, 0.5, 0.9, 0.99, 1.0], dtype=torch.float64))
    turns = Counter(sum(m["role"] == "assistant" for m in r["messages"]) for r in rows)
    return {"conversations": len(rows), "sources": dict(Counter(r.get("source", "?") for r in rows)),
            "tokens_total": int(lens.sum()),
            "tokens_percentiles": {f"p{p}": int(v) for p, v in zip((10, 50, 90, 99, 100), q.round().tolist())},
            "tokens_mean": round(float(lens.double().mean()), 1),
            **{f"over_{n}": int((lens > n).sum()) for n in (1024, 2048, 4096)},
            "assistant_turns": {str(k): turns[k] for k in sorted(turns)}}


def record_regenerate(args) -> None:
    """Returned ``scale_regenerate.json`` files -> their calls in ``bench/results/scale_regenerate.json`` under
    ``build`` (a call already there is not added twice), and with ``--lengths`` the length distribution of the
    set under ``--keep`` (:func:`set_lengths`) as ``lengths[build]``."""
    from transformers import AutoTokenizer

    from bench.common import RESULTS
    from pipelines.assets import ensure_target

    path = RESULTS / "scale_regenerate.json"
    data = json.loads(path.read_text())
    for f in args.files:
        for call in json.loads(Path(f).read_text())["calls"]:
            call = {"build": args.build, **call}
            if call not in data["calls"]:
                data["calls"].append(call)
    if args.lengths:
        rows = regenerated(keep_dir(args.keep))
        tok = AutoTokenizer.from_pretrained(ensure_target("smollm2-135m-instruct", dtype=_dtype()).path)
        data.setdefault("lengths", {})[str(args.build)] = set_lengths(rows, tok) | {"note": args.note or ""}
    path.write_text(json.dumps(data, indent=2) + "\n")
    print(f"{path}: {len(data['calls'])} calls", json.dumps(data.get("lengths", {}).get(str(args.build)))[:400])


def pack_data(args) -> None:
    """All regenerated chunks -> one ``.jsonl.xz`` cut in parts < 16 MiB under ``--out``."""
    keep = keep_dir(args.keep)
    rows = regenerated(keep)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = keep / "regenerated.jsonl.xz"
    write_jsonl_xz(tmp, rows)
    data = tmp.read_bytes()
    for i in range(0, len(data), PART_BYTES):
        (out / f"regenerated.jsonl.xz.part{i // PART_BYTES:02d}").write_bytes(data[i:i + PART_BYTES])
    print(f"{len(rows)} conversations, {len(data) / 2**20:.1f} MiB in {-(-len(data) // PART_BYTES)} parts")


def unpack_data(args) -> None:
    """Parts from ``pack-data`` -> ``keep/regen/chunk-0000.jsonl.xz`` (resumes as if regenerated here)."""
    keep = keep_dir(args.keep)
    parts = sorted(Path(args.dir).glob("regenerated.jsonl.xz.part*"))
    if not parts:
        raise SystemExit(f"no regenerated.jsonl.xz.part* under {args.dir}")
    dst = _chunks_dir(keep) / "all.jsonl.xz"
    with open(dst, "wb") as f:
        f.writelines(p.read_bytes() for p in parts)
    rows = read_jsonl_xz(dst)
    dst.unlink()
    for c, s in enumerate(range(0, len(rows), CHUNK_CONVERSATIONS)):
        write_jsonl_xz(_chunks_dir(keep) / f"chunk-{c:04d}.jsonl.xz", rows[s:s + CHUNK_CONVERSATIONS])
    print(f"{len(rows)} regenerated conversations restored under {_chunks_dir(keep)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keep", default=os.environ.get("PEAGLE_KEEP", "~/keep"))
    ap.add_argument("--data", default=os.environ.get("PEAGLE_KEEP", "~/keep"), help="dir of sharegpt.jsonl.xz")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prompts")
    p.add_argument("--num", type=int, required=True)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--recipe", default=None)
    _engine_parser(p)
    p = sub.add_parser("regenerate")
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--budget-s", type=float, default=480)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-turns", type=int, default=2)
    p.add_argument("--chunks-per-call", type=int, default=1,
                   help=f"chunks of {CHUNK_CONVERSATIONS} conversations answered by one engine call (vLLM: 4-8)")
    p.add_argument("--shard", type=parse_shard, default=(0, 1), metavar="I/N",
                   help="answer only the chunks c with c %% N == I (several engines on one GPU, one process each)")
    _engine_parser(p)
    p = sub.add_parser("pack-data")
    p.add_argument("--out", required=True)
    p = sub.add_parser("unpack-data")
    p.add_argument("dir")
    _train_parser(sub.add_parser("train", help="train one head of the table (bench.scale_train)"))
    p = sub.add_parser("record", help="a returned scale_train_<head>.json -> bench/results/scale_train.json")
    p.add_argument("state")
    p.add_argument("--data-build", type=int, default=None, help="which regenerated set it trained on")
    p.add_argument("--note", default=None)
    p.add_argument("--stopped-at", type=int, default=None, help="the step of a run that will not finish")
    p = sub.add_parser("record-regenerate", help="returned scale_regenerate.json files -> bench/results")
    p.add_argument("files", nargs="*")
    p.add_argument("--build", type=int, required=True)
    p.add_argument("--lengths", action="store_true", help="also the length distribution of the set under --keep")
    p.add_argument("--note", default=None, help="what the lengths are of")
    p = sub.add_parser("export-checkpoint", help="a head from a run's checkpoint that will not go on (its weights only)")
    p.add_argument("state", help="the run's scale_train_<head>.json")
    p.add_argument("checkpoint", help="a checkpoint_<step> directory with its model.safetensors")
    p.add_argument("--out", required=True, help="the head goes to OUT/head-<name>-step<step>")
    args = ap.parse_args()
    from bench import scale_train

    {"prompts": prompts, "regenerate": regenerate, "pack-data": pack_data, "unpack-data": unpack_data,
     "train": scale_train.train, "record": scale_train.record, "record-regenerate": record_regenerate,
     "export-checkpoint": scale_train.export_checkpoint}[args.cmd](args)


def parse_shard(text: str) -> tuple[int, int]:
    """``"I/N"`` -> ``(I, N)`` with ``0 <= I < N``; raises ``argparse.ArgumentTypeError`` otherwise."""
    m = re.fullmatch(r"(\d+)/(\d+)", text)
    if not m or not int(m.group(1)) < int(m.group(2)):
        raise argparse.ArgumentTypeError(f"--shard {text!r}: use I/N with 0 <= I < N, e.g. 1/2")
    return int(m.group(1)), int(m.group(2))


def _engine_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", choices=["transformers", "vllm"], default="transformers",
                   help="the target's engine (pipelines.data.engines)")
    p.add_argument("--max-model-len", type=int, default=2048, help="the engine's context (SmolLM2: up to 8192)")
    p.add_argument("--max-batch-tokens", type=int, default=524288, help="transformers engine only")
    p.add_argument("--max-num-seqs", type=int, default=None, help="vLLM engine only (default: vLLM's)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85, help="vLLM engine only")
    p.add_argument("--kv-cache-gib", type=float, default=None,
                   help="vLLM engine only: a fixed KV cache (GiB) instead of vLLM's profile (several engines on a GPU)")


def _train_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--method", choices=sorted(LAYERS), required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--train-s", type=float, required=True, help="GPU seconds of training (after warm-up), all calls")
    p.add_argument("--box-s", type=float, default=400, help="this call's post-warm-up time box")
    p.add_argument("--warmup-steps-excluded", type=int, default=10)
    p.add_argument("--calib-steps", type=int, default=20)
    p.add_argument("--chunk", type=int, default=256, help="conversations per online capture call")
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--out", default=None, help="return the finished head here, in parts < 16 MiB; a call stopped at "
                   "a checkpoint returns that checkpoint (--return-form) as ckpt-<name>.tar.partNN instead")
    p.add_argument("--return-form", default=None, help="form of the returned checkpoint (pipelines.train.compact."
                   "FORMS); default bench.scale_train.DEFAULT_FORM, chosen by bench/resume_state.py")
    p.add_argument("--from-parts", action="append", default=[], metavar="DIR",
                   help="dirs holding ckpt-<name>.tar.part* (and scale_train_<name>.json) returned by an earlier "
                   "call: a new machine resumes from them (ignored when --keep has that step or a later one)")
    p.add_argument("--recipe", default=None, help=f"default {RECIPE.relative_to(RECIPE.parents[1])}")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="a recipe override on top of bench.scale_train.TRAIN_OVERRIDES (a variant's change)")
    p.add_argument("--variant", default="", help="the recipe variant's name, a suffix of the tag: e.g. 600s (longer "
                   "training) or lr12e-4 with --set training.lr=1.2e-3 -> head-peagle-29k-lr12e-4")
    p.add_argument("--run", type=int, default=1, help="repeat number of the same recipe (head-<tag>-run<N>)")


if __name__ == "__main__":
    main()
