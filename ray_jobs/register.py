"""`python -m ray_jobs.register --config FILE [--force] [--set section.field=value] [--run-dir DIR] [--verbose]`:
the register stage alone, i.e. `peagle run --config FILE --stage register`.

Reads the upstream stage's outputs from the run directory (`$PEAGLE_HOME/runs/<recipe name>`);
skips when its own outputs are current unless --force. See pipelines/pipeline.py.
"""

from pipelines.cli.run import stage_job

if __name__ == "__main__":
    stage_job(["register"], prog="ray_jobs.register")
