"""`python -m ray_jobs.capture --config FILE [--force] [--set section.field=value]`: the capture stage alone.

Reads the upstream stage's outputs from the run directory (`$PEAGLE_HOME/runs/<recipe name>`);
skips when its own outputs are current unless --force. See pipelines/pipeline.py.
"""

import sys

from pipelines.pipeline import main

if __name__ == "__main__":
    sys.exit(main(stages=["capture"], prog="ray_jobs.capture"))
