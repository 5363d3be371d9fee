"""The pipeline's stages, in order: one :class:`~pipelines.stages.base.Stage` subclass per file.

::

    regenerate ─► capture ─► train ─► evaluate ─► register ─► serve

Each file wires one stage module (``pipelines.<stage>``) into the pipeline: the recipe sections it
reads (its key), its run, its validity check and its typed output. ``pipelines.pipeline.PipelineRun``
runs them in this order.
"""

from __future__ import annotations

from pipelines.stages.base import Stage
from pipelines.stages.capture import CaptureStage
from pipelines.stages.evaluate import EvaluateStage
from pipelines.stages.regenerate import RegenerateStage
from pipelines.stages.register import RegisterStage
from pipelines.stages.serve import ServeStage
from pipelines.stages.train import TrainStage

STAGE_TYPES: tuple[type[Stage], ...] = (RegenerateStage, CaptureStage, TrainStage, EvaluateStage, RegisterStage,
                                        ServeStage)
STAGES: tuple[str, ...] = tuple(s.name for s in STAGE_TYPES)
