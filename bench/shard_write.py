"""How a capture shard reaches the disk: the shard writer (``peagle_core.shards.write_shard``: safetensors writes the
temp file itself, ``atomic_write_via``) against building the whole shard as one bytes object first (``save`` +
``atomic_write_bytes``, the writer before 2026-11-28), on the same tensors, alternately, fsync included.

    python -m bench.shard_write [--tokens 108800] [--repeats 3] [--name shard_write_gpu]

SmolLM2's layout (three aux hidden states and the final one, bf16: 4,613 bytes a token). The capture stage on 2 H200s
spent 71% of its actors' busy time in shard writes (``multi_gpu_capture_2.json``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.common import write_result


def main() -> None:
    from safetensors.torch import save

    from peagle_core import shards
    from peagle_core.atomic import atomic_write_bytes

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=108_800)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--name", default="shard_write", help="result name (shard_write_gpu: a GPU machine's disk)")
    args = ap.parse_args()
    length = 850
    samples = [{"sample_id": f"s{i}", "input_ids": torch.randint(0, 49152, (length,), dtype=torch.int32),
                "loss_mask": torch.ones(length, dtype=torch.bool),
                "aux": torch.randn(length, 3 * args.hidden).to(torch.bfloat16),
                "final_hidden": torch.randn(length, args.hidden).to(torch.bfloat16)}
               for i in range(max(1, args.tokens // length))]
    tokens = len(samples) * length
    times: dict[str, list[float]] = {"writer": [], "bytes_first": []}
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as d:
        for _ in range(args.repeats):
            t = time.perf_counter()
            shards.write_shard(Path(d) / "shard-00000.safetensors", samples, validate=False)
            times["writer"].append(time.perf_counter() - t)
            t = time.perf_counter()  # the same shard, built in memory first (tensors as write_shard lays them out)
            tensors = {"input_ids": torch.cat([s["input_ids"] for s in samples]),
                       "loss_mask": torch.cat([s["loss_mask"].to(torch.uint8) for s in samples]),
                       "aux": torch.cat([s["aux"] for s in samples]).contiguous(),
                       "final_hidden": torch.cat([s["final_hidden"] for s in samples]).contiguous()}
            [shards.sample_checksum(s) for s in samples]
            atomic_write_bytes(Path(d) / "shard-00001.safetensors", save(tensors))
            times["bytes_first"].append(time.perf_counter() - t)
        mib = (Path(d) / "shard-00000.safetensors").stat().st_size / 2**20
    rows = [{"path": name, "seconds": [round(x, 3) for x in v], "median_s": statistics.median(v),
             "mib_per_s": mib / statistics.median(v)} for name, v in times.items()]
    for r in rows:
        print(r)
    write_result(args.name, {"tokens": tokens, "mib": mib, "repeats": args.repeats, "rows": rows})


if __name__ == "__main__":
    main()
