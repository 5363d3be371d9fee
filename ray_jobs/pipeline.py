"""The main job: ``python -m ray_jobs.pipeline --config FILE [--force] [--set section.field=value] [--run-dir DIR]
[--verbose]``, i.e. ``peagle run --config FILE``.

Runs regenerate → capture → train → evaluate → register → serve from one recipe (see
pipelines/pipeline.py), e.g. on a cluster::

    ray job submit --address http://127.0.0.1:8265 --working-dir . \\
        -- python -m ray_jobs.pipeline --config configs/smollm2-135m-cpu.yaml

Prints stage timings and a summary (AL and tokens/s vs no speculation, MLflow run and model
version, endpoint URL + curl line); the Serve app stays up after the job ends.
"""

from pipelines.cli.run import stage_job
from pipelines.pipeline import STAGES

if __name__ == "__main__":  # vLLM spawns processes: no work at import time
    stage_job(STAGES, prog="ray_jobs.pipeline")
