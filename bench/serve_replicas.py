"""Do N GPU vLLM replicas of peagle's endpoint start together on one host? The serve stage's own deployment
(:func:`pipelines.stages.serve.serve_app_args` of a recipe, rolled out by :func:`pipelines.serve.rollout.roll`)
with ``min_replicas`` = ``max_replicas`` = N and the target alone (no head: the replicas' engine start is what is
checked, not drafting), on a Ray cluster that is already up (``pipelines.local_ray start --num-gpus N``).

On 4 H200s (2026-11-27) Serve's autoscaler asked for 4 replicas under load, and the ones that started beside a
running replica failed in vLLM 0.26's default Ray executor (:data:`pipelines.serve.GPU_REPLICA_ENV`); this
deploys N at once with the replicas' environment as the serve stage sets it, and writes the seconds until all N
ran, or the roll's error, to ``bench/results/serve_replicas.json`` (``--out-dir``: elsewhere).

    RAY_ADDRESS=<GCS address> python -m bench.serve_replicas --config configs/smollm2-135m-4gpu.yaml --replicas 2
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bench.common import write_result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/smollm2-135m-4gpu.yaml")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE", help="recipe override")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--out-dir", type=Path, default=None)
    ap.add_argument("--note", default="")
    opts = ap.parse_args(argv)

    import ray

    from pipelines.recipe import load_recipe
    from pipelines.serve.client import chat_once
    from pipelines.serve.rollout import RolloutError, ray_serve, roll
    from pipelines.stages.base import engine_settings
    from pipelines.stages.serve import serve_app_args

    recipe = load_recipe(opts.config, opts.set)
    args = serve_app_args(recipe, engine_settings(recipe), tracking_uri=None, head=None,
                          min_replicas=opts.replicas, max_replicas=opts.replicas)
    ray.init()
    serve = ray_serve()
    serve.start(http_options={"host": "127.0.0.1", "port": opts.port})
    row: dict = {"config": opts.config, "sets": opts.set, "replicas": opts.replicas, "gpus": _gpu_names(),
                 "replica_env": replica_env(args), "note": opts.note}
    t0 = time.monotonic()
    try:
        rolled = roll(args)
        row |= {"ok": True, "seconds": round(rolled.seconds, 1), "backend": rolled.backend,
                "smoke_answer": chat_once(f"http://127.0.0.1:{opts.port}", args.resolved_model_id())}
    except RolloutError as e:
        row |= {"ok": False, "seconds": round(time.monotonic() - t0, 1), "error": str(e)[-2000:]}
    print(json.dumps(row))
    print(f"wrote {write_result('serve_replicas', {'benchmark': 'serve_replicas', **row}, opts.out_dir)}")
    return 0 if row["ok"] else 1


def replica_env(args) -> dict[str, str]:
    """The replicas' environment variables as the serve stage sets them (``build_llm_config``'s runtime env)."""
    from pipelines.serve import build_llm_config

    config = build_llm_config(args, target_path="-", target_config=None, head=None)
    return dict((config.runtime_env or {}).get("env_vars") or {})


def _gpu_names() -> list[str]:
    import torch

    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


if __name__ == "__main__":
    raise SystemExit(main())
