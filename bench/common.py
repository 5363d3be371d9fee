"""Shared helpers of the GPU benchmarks: timing, environment record, result files.

Benchmarks are scripts, not tests: each writes ``bench/results/<name>.json`` with the device,
versions and date, and ``bench/report.py`` turns the files into ``docs/benchmarks.md``.
"""

from __future__ import annotations

import datetime as _dt
import json
import lzma
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]  # the repository
RESULTS = ROOT / "bench" / "results"

# Drafter shapes of the targets the benchmarks model (public HF configs; 4-layer P-EAGLE heads).
TARGET_SHAPES = {
    "smollm2-135m": {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
                         "intermediate_size": 1536, "vocab_size": 49152, "num_hidden_layers": 30, "rope_theta": 100000.0},
    "gpt-oss-20b": {"hidden_size": 2880, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
                        "intermediate_size": 2880, "vocab_size": 201088, "num_hidden_layers": 24, "rope_theta": 150000.0},
    "llama-3.1-8b": {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                         "intermediate_size": 14336, "vocab_size": 128256, "num_hidden_layers": 32, "rope_theta": 500000.0},
}


# A first user turn about code: the CPU demo recipe's ShareGPT filter until 2026-12-07 (its prompts are python_functions
# since). bench.demo_sweep's "code" pool; bench.shifted_traffic's chat prompts are the ShareGPT turns it does not match.
CODE_TOPIC_REGEX = r"(?i)```|\bdef |\bpython\b|\bfunction\b|\bcode\b|\bjavascript\b|\bsql\b|\bclass \b|#include|\bscript\b|\bjava\b|c\+\+|\breact\b"


def environment() -> dict:
    env = {
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or "cpu",
        "cuda": torch.version.cuda,
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    return env


def time_ms(fn: Callable[[], object], *, warmup: int = 3, iters: int = 10) -> float:
    """Median wall time of ``fn`` in milliseconds (CUDA-synchronized)."""
    cuda = torch.cuda.is_available()
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def write_result(name: str, payload: dict, out_dir: Path | None = None) -> Path:
    out = (out_dir or RESULTS) / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"environment": environment(), **payload}, indent=2))
    return out


def keep_dir(path: str | Path) -> Path:
    """The device's ``~/keep`` (or ``--keep``): state that survives between calls on one warm machine."""
    p = Path(path).expanduser()
    p.mkdir(parents=True, exist_ok=True)
    return p


def read_jsonl_xz(path: str | Path) -> list[dict]:
    with lzma.open(path, "rt") as f:
        return [json.loads(line) for line in f]


def write_jsonl_xz(path: str | Path, rows: Iterable[dict]) -> int:
    """Write ``rows`` as xz-compressed JSON Lines, through a temporary sibling renamed into place
    (``peagle_core.atomic.replace_file``): a process killed while writing leaves no truncated file under
    ``path`` (resumable steps treat an existing file as done). Returns how many rows."""
    from peagle_core.atomic import replace_file

    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    n = 0
    with lzma.open(tmp, "wt", preset=9) as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
            n += 1
    replace_file(tmp, path)
    return n
