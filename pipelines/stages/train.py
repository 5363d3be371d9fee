"""Stage ``train``: captured hidden states -> an exported head (``pipelines.train.run_train`` on Ray Train).

Writes ``train/head/`` (the exported head) and Ray Train checkpoints under ``ray_results/`` (run
name ``<recipe>-<key[:10]>``: an interrupted run resumes from its latest checkpoint; failed workers
are restarted from it up to ``training.max_failures`` times), with ``sample_ids/epoch_XXXX.json`` beside
them (the ids trained per epoch). A materialized capture is read in the seeded per-epoch order of
``pipelines.train.order`` (sample-exact resume). Streaming capture: the dataset is ``capture_stream``
over the regenerated rows (a resume is step-exact, not sample-exact) and the epoch length comes
from the plan (``pipelines.train.plan_from_conversations``: the conversations tokenized once).
Key: drafter + training sections (without ``training.max_failures``).

Warm start (``training.init_from``, ``pipelines.train.warm_start``): the reference is resolved once per
pipeline run, when the stage is built (before any compute: a bad reference raises ValueError there), to a
model version and its ``head_sha256``; the key holds those instead of the reference, so
``models:/NAME@champion`` re-trains after a promotion and a re-registered head with other files re-keys.
The run downloads that pinned version to ``train/init_head/`` and the plan checks it against the drafter
before Ray Train starts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipelines import settings
from pipelines.preflight import Machine, Problem, Severity, not_installed
from pipelines.stages.base import OMIT_IF_NONE, Stage, StageOutput, cpus_per_worker, key_dump, tree_bytes
from pipelines.stages.capture import CaptureOutput, backend_problems
from pipelines.stages.regenerate import RegenerateOutput

log = logging.getLogger(__name__)
FLEX_ATTENTION = "torch.nn.attention.flex_attention"  # peagle_core.masks: the block-sparse P-EAGLE mask


@dataclass
class TrainOutput(StageOutput):
    """``head_dir``: the exported head; ``history``: rank-0 metric rows; ``stream``: the streaming
    epoch length (``{"steps_per_epoch": n}``, empty when materialized); ``bytes_written_run_dir``: how much the run
    directory grew while the stage ran (bytes; 0 when it did not grow, e.g. a resumed run that rewrote its head)."""

    head_dir: str
    step: int
    resumed_from_step: int | None = None
    checkpoint: str | None = None
    mlflow_run_id: str | None = None
    history: list[dict] = field(default_factory=list)
    bytes_written_run_dir: int = 0
    streaming: bool = False
    hidden_state_bytes_on_disk: int | None = None
    stream: dict[str, Any] | None = field(default=None, metadata=OMIT_IF_NONE)
    init_from: dict[str, Any] | None = field(default=None, metadata=OMIT_IF_NONE)


class TrainStage(Stage):
    name = "train"
    Output = TrainOutput

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self._stream_num_tokens: int | None = None  # set by run from the plan (for the summary's estimate)
        self._init_head = None  # training.init_from resolved once per run: the key and the download agree
        ref = ctx.recipe.training.init_from
        if ref is not None:
            from pipelines.train.warm_start import resolve_init_from

            self._init_head = resolve_init_from(ref, tracking_uri=ctx.tracking_uri)

    @staticmethod
    def requirements(recipe) -> tuple[str, ...]:
        from pipelines.registry.refs import HeadRef

        init = recipe.training.init_from
        return ("mlflow",) if init is not None and HeadRef.is_ref(init) else ()

    @staticmethod
    def num_gpus(recipe) -> tuple[int, str]:
        """One GPU per Ray Train worker; with ``capture.streaming``, also one per capture actor: both pools run at
        once, and on a cluster without the GPUs for both the capture actors wait forever while the workers wait
        for their rows (2x H200, 2026-11-28: 2 + 2 on 2 GPUs, 0 steps in 5 minutes)."""
        t = recipe.training
        if not t.use_gpu:
            return 0, ""
        use = f"one per Ray Train worker, training.num_workers={t.num_workers}"
        if recipe.capture.streaming:
            n = recipe.capture.num_workers
            return t.num_workers + n, f"{use}, and one per streaming capture actor beside them, capture.num_workers={n}"
        return t.num_workers, use

    @classmethod
    def preflight(cls, recipe, machine: Machine) -> list[Problem]:
        """Also: an objective for ``training.method`` (``peagle_core.objectives``), FlexAttention for
        ``training.attention: flex``, and ``capture.backend`` when the capture streams into this stage."""
        from peagle_core.objectives import available_objectives

        t = recipe.training
        problems = super().preflight(recipe, machine)
        problems += cls.choice_problems("training.method", t.method, dict.fromkeys(available_objectives(), ()),
                                        machine)
        if t.attention == "flex" and (reason := machine.lacks(FLEX_ATTENTION)) is not None:
            problems.append(cls.problem(Severity.MACHINE, f"training.attention=flex needs {FLEX_ATTENTION}: {reason}; "
                                        "use training.attention=auto or dense", "training.attention"))
        if recipe.capture.streaming:  # the target forward of a streaming capture runs in this stage
            problems += backend_problems(cls, recipe, machine)
        return problems

    def _warn_if_pools_do_not_fit(self) -> None:
        """Inside ``ray job submit`` the pre-flight does not know the cluster's GPUs (:meth:`Machine.probe`):
        say now, before the pools start, when the cluster has fewer than :meth:`num_gpus` (it may still autoscale
        up; otherwise the stage waits, as Ray does for any actor it cannot place)."""
        import ray

        need, use = self.num_gpus(self.recipe)
        have = int(ray.cluster_resources().get("GPU", 0))
        if need and have < need:
            log.warning("the train stage with capture.streaming needs %d GPUs (%s); the Ray cluster has %d now: "
                        "unless it scales up, the stage waits for them. Lower capture.num_workers or "
                        "training.num_workers, or set capture.streaming=false", need, use, have)

    def sections(self, recipe):
        # how many failures to recover from and how the (same) block mask is built do not change the head: not
        # in the key; a warm start is keyed on the head it resolved to (absent when None: older recipes keep
        # their keys)
        training = key_dump(recipe.training, exclude={"max_failures", "block_mask", "init_from"})
        if recipe.training.init_from is not None:
            assert self._init_head is not None and self._init_head.ref == recipe.training.init_from
            training["init_from"] = self._init_head.key()
        return (recipe.drafter, training)

    def run(self) -> TrainOutput:
        import ray.data

        from pipelines.train import OrderedCapture, plan_from_capture, plan_from_conversations, run_train

        r = self.recipe
        cap = self.ctx.upstream(CaptureOutput)
        before = tree_bytes(self.ctx.run_dir)
        init = None
        if self._init_head is not None:  # the pinned version, checked against the drafter by the plan
            from pipelines.train.warm_start import fetch_init_head

            init = fetch_init_head(self._init_head, self.dir / "init_head", tracking_uri=self.ctx.tracking_uri)
            self.ctx.say(f"warm start from {init.describe()}")
        if cap.streaming:
            from pipelines.capture import capture_stream

            self._warn_if_pools_do_not_fit()

            rows = self.ctx.upstream(RegenerateOutput).rows()
            items = [{"id": x["id"], "messages": x["messages"]} for x in rows]
            # no manifest: the plan tokenizes the conversations (no target forward) for lengths and counts
            plan = plan_from_conversations(r.training, r.drafter, r.target, items,
                                           max_length_tokens=r.data.max_length_tokens,
                                           on_too_long=r.capture.on_too_long, init_head=init)
            self._stream_num_tokens = plan.num_tokens
            data = capture_stream(ray.data.from_items(items), r.target, r.capture, r.data,
                                  num_cpus_per_worker=cpus_per_worker(r.capture.num_workers),
                                  engine_kwargs=self.ctx.engine.vllm_kwargs)
        else:  # each worker reads its slice of the seeded per-epoch order: a resume is sample-exact
            plan = plan_from_capture(r.training, r.drafter, r.target, cap.capture_dir, init_head=init)
            data = OrderedCapture(str(cap.capture_dir))
        from pipelines.train.progress import format_metrics, train_progress

        tracking_uri = self.ctx.tracking_uri
        if not_installed("mlflow"):
            tracking_uri = ""  # the driver's `""`: no MLflow run
            self.ctx.say("MLflow is not installed on this machine: training metrics go to the log only")
        with train_progress(plan.total_steps) as callbacks:
            res = run_train(plan, data, self.dir, run_name=f"{r.name}-{self.ctx.key(self.name)[:10]}",
                            storage_path=self.ctx.run_dir / "ray_results", mlflow_tracking_uri=tracking_uri,
                            mlflow_experiment=settings.TRAIN_EXPERIMENT, export_dtype=self.ctx.engine.export_dtype,
                            recipe_text=r.dump_resolved(), callbacks=callbacks)
        history = (res.return_value or {}).get("history") or []
        last = history[-1] if history else {}
        resumed = f" (resumed from {res.resumed_from_step})" if res.resumed_from_step else ""
        self.ctx.say(f"{res.step} steps{resumed}, last {format_metrics(last)}; head {res.head_dir}")
        return TrainOutput(
            head_dir=str(res.head_dir), step=res.step, resumed_from_step=res.resumed_from_step,
            checkpoint=res.checkpoint_path, mlflow_run_id=res.mlflow_run_id, history=history,
            bytes_written_run_dir=max(0, tree_bytes(self.ctx.run_dir) - before), streaming=cap.streaming,
            hidden_state_bytes_on_disk=0 if cap.streaming else cap.bytes_on_disk,
            stream={"steps_per_epoch": plan.steps_per_epoch} if cap.streaming else {},
            init_from={"ref": init.ref, **init.key()} if init is not None else None)

    # ------------------------------------------------------------------------------------------

    def is_valid(self, out: TrainOutput) -> bool:
        from peagle_core.contract import validate_head, verify_checksums

        head = Path(out.head_dir)
        verify_checksums(head)
        validate_head(head, parallel_drafting=self.recipe.training.method == "peagle")
        return True

    def summary(self, out: TrainOutput) -> tuple[str, dict[str, Any]]:
        s = {"step": out.step, "head_dir": out.head_dir, "bytes_written_run_dir": out.bytes_written_run_dir,
             "streaming": out.streaming, "hidden_state_bytes_on_disk": out.hidden_state_bytes_on_disk,
             "mlflow_run_id": out.mlflow_run_id}
        if out.init_from:
            s["init_from"] = out.init_from
        if out.streaming and self._stream_num_tokens is not None:
            from peagle_core.storage import bytes_per_token
            from pipelines.assets import resolve_target

            hidden_size = int(resolve_target(self.recipe.target)[1]["hidden_size"])
            s["materialized_capture_bytes_estimate"] = self._stream_num_tokens * bytes_per_token(
                hidden_size, self.recipe.capture.dtype)
        return "train", s
