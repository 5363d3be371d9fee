"""`python -m ray_jobs.serve --config FILE [--force] [--set section.field=value]`: the serve stage alone.

Reads the upstream stage's outputs from the run directory (`$PEAGLE_HOME/runs/<recipe name>`);
skips when its own outputs are current unless --force. See pipelines/pipeline.py.
"""

import sys

from pipelines.pipeline import main

if __name__ == "__main__":
    sys.exit(main(stages=["serve"], prog="ray_jobs.serve"))
