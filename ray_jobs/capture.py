"""`python -m ray_jobs.capture --config FILE [--force] [--set section.field=value] [--run-dir DIR] [--verbose]`:
the capture stage alone, i.e. `peagle run --config FILE --stage capture`.

Reads the upstream stage's outputs from the run directory (`$PEAGLE_HOME/runs/<recipe name>`);
skips when its own outputs are current unless --force. See pipelines/pipeline.py.
"""

from pipelines.cli.run import stage_job

if __name__ == "__main__":
    stage_job(["capture"], prog="ray_jobs.capture")
