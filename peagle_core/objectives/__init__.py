"""Training objectives of a drafter head and their registry.

* ``base``: the :class:`Objective` interface (what a trainer calls), ``ObjectiveConfig``, the
  target head, per-depth metrics and the registry (``build_objective``);
* ``peagle``: P-EAGLE parallel drafting (``"peagle"``);
* ``eagle3``: the EAGLE-3 training-time-test baseline (``"eagle3"``).

Importing this package registers the built-in objectives; ``build_objective(method, **options)``
builds one by name.
"""

from peagle_core.objectives.base import (
    NUM_FORWARD_SLOTS_KEY,
    Objective,
    ObjectiveConfig,
    available_objectives,
    build_objective,
    objective_class,
    register_objective,
)
from peagle_core.objectives.eagle3 import Eagle3TTTConfig, Eagle3TTTObjective
from peagle_core.objectives.peagle import PEagleConfig, PEagleObjective

__all__ = [
    "NUM_FORWARD_SLOTS_KEY",
    "Eagle3TTTConfig",
    "Eagle3TTTObjective",
    "Objective",
    "ObjectiveConfig",
    "PEagleConfig",
    "PEagleObjective",
    "available_objectives",
    "build_objective",
    "objective_class",
    "register_objective",
]
