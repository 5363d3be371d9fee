"""The register stage: MLflow runs, model versions and the champion/challenger gate.

* ``refs.py``: :class:`~pipelines.registry.refs.HeadRef`, the one parser of ``models:/NAME@ALIAS`` and
  ``models:/NAME/VERSION`` and its resolution to a pinned version (every caller: serve, warm start,
  register, evaluate).
* ``client.py``: the MLflow client of the tracking store, ``tracking_guard``; ``runs.py``: the pipeline's
  run; ``params.py``: nested parameters flattened; ``provenance.py``: git SHA and package versions.
* ``register.py``: registering, finding and downloading head versions; ``promotion.py``: the gate.
* Wired into the pipeline by :class:`pipelines.stages.register.RegisterStage`.

Nothing is imported here: import each module by its own name.
"""
