"""The pipeline's stages as objects: :class:`~pipelines.stages.base.Stage` (the interface) and one thin
subclass per stage, which wires its package's work into the pipeline and holds no logic of its own::

    regenerate ─► capture ─► train ─► evaluate ─► register ─► serve
    (data/)       (capture/)  (train/)  (evaluate/)  (registry/)  (serve/)

Each file says which recipe sections key the stage, calls its package's plain functions, checks its
outputs and returns its typed output. The order is ``pipelines.pipeline.STAGE_TYPES``. The files import
their packages inside methods, so the stage list (and ``peagle --help``) imports no torch, Ray or MLflow.

Nothing is imported here: import each module by its own name.
"""
