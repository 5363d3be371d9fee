"""``python -m pipelines.cli``: the ``peagle`` command."""

from pipelines.cli import main

main()
