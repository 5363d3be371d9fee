"""`python -m ray_jobs.evaluate --config FILE [--force] [--set section.field=value] [--run-dir DIR] [--verbose]`:
the evaluate stage alone, i.e. `peagle run --config FILE --stage evaluate`.

Reads the upstream stage's outputs from the run directory (`$PEAGLE_HOME/runs/<recipe name>`);
skips when its own outputs are current unless --force. See pipelines/pipeline.py.
"""

from pipelines.cli.run import stage_job

if __name__ == "__main__":
    stage_job(["evaluate"], prog="ray_jobs.evaluate")
