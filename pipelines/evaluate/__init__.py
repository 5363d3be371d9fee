"""The evaluate stage: the trained head's acceptance length and tokens/s with real vLLM.

* ``prompts.py``: eval sets as prompt token ids; ``measure.py``: the engine sweep (method x K x
  concurrency, one vLLM subprocess per engine: ``python -m pipelines.evaluate.measure --worker``);
  ``report.py``: table, best K, markdown and plots; ``step_costs.py``: a decoding step split in phases;
  ``k_schedule.py``: the measured K per batch size (built here, tagged by the registry, served by vLLM).
* Wired into the pipeline by :class:`pipelines.stages.evaluate.EvaluateStage`.

Nothing is imported here: import each module by its own name.
"""
