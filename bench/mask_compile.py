"""``python -m bench.mask_compile``: seconds to the first P-EAGLE block mask of a training step, by document
length and number of sequence partitions (issue 26 item 4: a long-sequence run with ``training.num_partitions=2``
did not reach its first step in 9 minutes on an H100, ptxas compiling one kernel of the block-mask build).

Each case runs the path of ``peagle_core.objectives.peagle.PEagleObjective._segment`` up to its mask: one packed
batch of ``--tokens`` tokens in documents of L tokens (every token an assistant token), P-EAGLE elements with COD
(``peagle_core.elements.build_peagle_elements``), ``partition_elements`` into S segments, each segment's slots as
its forward runs them (``peagle_core.objectives.peagle.forward_slots``), then ``peagle_core.masks.element_mask`` (flex on CUDA: ``create_block_mask``
compiled). A case is a fresh process with its own inductor cache (``TORCHINDUCTOR_CACHE_DIR``) and a time limit,
``--batches`` batches one after the other (new COD draws; the first compiles). Rows go to
``bench/results/mask_compile.json``: per case the seconds per mask in order, or the limit it ran into.

Usage: python -m bench.mask_compile [--cases 1024:2,8192:1,8192:2] [--limit-s 80] [--block-mask blockwise]
  e.g. the block-count question (a smaller segment, not its partition, compiling slowly?):
  --cases 1024:1:8192,1024:1:16384,1024:2:16384
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from bench.common import RESULTS, environment

RESULT = "mask_compile"


def one_case(
    length: int, partitions: int, tokens: int, batches: int, cod: tuple[float, float], k: int, build: str
) -> None:
    """Print one JSON line per mask: batch, segment, slots T, seconds. ``build``: ``compiled`` (the train path's
    default, ``training.block_mask``), ``eager`` (``create_block_mask`` uncompiled: the whole ``[T, T]`` mask
    materialised) or ``blockwise`` (``peagle_core.masks.blockwise_block_tables``)."""
    import torch

    from peagle_core.batch import PackedBatch
    from peagle_core.elements import build_peagle_elements
    from peagle_core.masks import element_mask, flex_element_mask
    from peagle_core.objectives.peagle import forward_slots
    from peagle_core.partition import partition_elements

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ar = torch.arange(tokens, device=dev)
    g = torch.Generator().manual_seed(0)
    for b in range(batches):
        batch = PackedBatch(input_ids=torch.randint(0, 49152, (tokens,), device=dev),
                            loss_mask=torch.ones(tokens, dtype=torch.bool, device=dev), doc_ids=ar // length,
                            position_ids=ar % length, aux=torch.zeros(tokens, 3, device=dev),
                            final_hidden=torch.zeros(tokens, 1, device=dev))
        el = build_peagle_elements(batch, k, 16, cod_ratio=cod[0], cod_min_ratio=cod[1], generator=g)
        for seg in partition_elements(el, partitions, num_anchors=tokens):
            e, _ = forward_slots(el.index(seg.indices), k, flex=dev.type == "cuda")
            t = time.perf_counter()
            if build == "eager":
                flex_element_mask(e, compile=False)
            else:
                element_mask(e, attention="flex" if dev.type == "cuda" else "dense", block_mask=build)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            print(json.dumps({"batch": b, "segment": seg.index, "slots": e.num_elements,
                              "s": round(time.perf_counter() - t, 2)}), flush=True)


def _case(case: str, tokens: int) -> tuple[int, int, int]:
    """``"L:S[:N]"`` -> (L, S, N), N defaulting to ``tokens``.

    Raises:
        ValueError: not two or three integers.
    """
    nums = [int(x) for x in case.split(":")]
    if len(nums) not in (2, 3):
        raise ValueError(f"case {case!r}: expected L:S or L:S:N")
    return nums[0], nums[1], nums[2] if len(nums) == 3 else tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="1024:2,8192:1,8192:2",
                    help="L:S[:N]: document tokens, partitions and (default --tokens) tokens of the packed batch")
    ap.add_argument("--tokens", type=int, default=16384, help="tokens of the packed batch (the scale recipe's batch)")
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--limit-s", type=float, default=80, help="per case, process start included")
    ap.add_argument("--cod", default="0.03,0.008", help="cod_ratio,cod_min_ratio")
    ap.add_argument("--k", type=int, default=8, help="K_train (depths)")
    ap.add_argument("--block-mask", choices=["compiled", "eager", "blockwise"], default="compiled",
                    help="how the block mask is built (eager: create_block_mask uncompiled)")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # L:S, in the case's own process
    args = ap.parse_args()
    cod = tuple(float(x) for x in args.cod.split(","))
    if args.one:
        length, parts, tokens = _case(args.one, args.tokens)
        one_case(length, parts, tokens, args.batches, cod, args.k, args.block_mask)
        return
    rows = []
    for case in args.cases.split(","):
        length, parts, tokens = _case(case, args.tokens)
        env = os.environ | {"TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix=f"ind-{length}-{parts}-")}
        cmd = [sys.executable, "-m", "bench.mask_compile", "--one", case, "--tokens", str(args.tokens), "--batches",
               str(args.batches), "--cod", args.cod, "--k", str(args.k), "--block-mask", args.block_mask]
        t = time.perf_counter()
        try:
            run = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=args.limit_s)
            out, limited = run.stdout, False
        except subprocess.TimeoutExpired as e:  # its output so far comes as bytes
            out, limited = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), True
        masks = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
        rows.append({"doc_tokens": length, "partitions": parts, "tokens": tokens, "block_mask": args.block_mask,
                     "masks": masks, "wall_s": round(time.perf_counter() - t, 1),
                     "limit_s": args.limit_s if limited else None})
        print(json.dumps(rows[-1]), flush=True)
    write_rows(rows, {"tokens": args.tokens, "cod": list(cod), "k": args.k, "batches": args.batches,
                      "command": "python -m bench.mask_compile " + " ".join(sys.argv[1:])})


def _row_key(row: dict) -> tuple:
    return row["doc_tokens"], row["partitions"], row["tokens"], row["block_mask"]


def write_rows(rows: list[dict], run: dict) -> None:
    """Merge this run's rows into ``bench/results/mask_compile.json``: each new row carries its run (date, device,
    command, COD, K, batches); an earlier row of the same case (L, S, N, block mask) is replaced, the others kept.
    The first run's settings stay at the top level for the rows without their own ``run``."""
    path = RESULTS / f"{RESULT}.json"
    run = {"date": (e := environment())["date"], "device": e["device"]} | run
    old = json.loads(path.read_text()) if path.exists() else {"benchmark": RESULT, "environment": e} | run | {"rows": []}
    keys = {_row_key(r) for r in rows}
    old["rows"] = [r for r in old["rows"] if _row_key(r) not in keys] + [r | {"run": run} for r in rows]
    path.write_text(json.dumps(old, indent=2) + "\n")


if __name__ == "__main__":
    main()
