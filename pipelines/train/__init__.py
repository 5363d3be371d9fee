"""Training stage: fit a P-EAGLE (or EAGLE-3 TTT) drafter on captured target hidden states.

One job per file:

* ``plan.py``: the driver-side :class:`TrainPlan` (drafter and objective configs, draft vocabulary,
  epoch length, total steps), built once from a capture, from conversations (streaming) or a dataset;
* ``loop.py``: :class:`Trainer`, one worker's Ray-free loop, and the :class:`TrainCallback` extension point;
* ``checkpoint.py``: the checkpoint files, :class:`Checkpointer` (one process, DDP) and
  :class:`ShardedCheckpointer` (FSDP2);
* ``compact.py``: compact copies of a checkpoint (bf16 weights, frozen ones dropped, AdamW moments in bf16 or
  factored) that another machine expands and resumes from;
* ``optim.py``: AdamW and the warm-up + cosine schedule; ``data.py``: packing, data position, epoch length;
* ``order.py``: the seeded per-epoch sample order of a materialized capture (a pure function of seed,
  epoch, rank and world size; sample-exact resume) and the record of the sample ids trained per epoch;
* ``target_weights.py``: the target's ``lm_head`` / embeddings and the drafter's init from them;
* ``warm_start.py``: ``training.init_from``: resolve a registered (or local) head, fetch it, check it against
  the plan's drafter, load it on every worker;
* ``tracking.py``: progress lines and rank-0 MLflow (buffered through tracking-server outages);
* ``worker.py``: the Ray Train worker (``train_loop_per_worker``, its typed :class:`WorkerConfig`);
* ``driver.py``: :func:`run_train`, the Ray driver (fit, then export the head);
* ``local.py``: :func:`train_in_process`, the same loop without Ray.

``import pipelines.train`` imports neither Ray nor MLflow (they are imported where they are used).
"""

from pipelines.train.checkpoint import (
    MODEL_FILE,
    OPTIMIZER_FILE,
    RANK_FILE,
    SCHEDULER_FILE,
    STATE_FILE,
    Checkpointer,
    ShardedCheckpointer,
    latest_checkpoint,
    optimizer_digest,
)
from pipelines.train.data import estimate_steps_per_epoch, iter_packed_batches
from pipelines.train.driver import TrainRunResult, run_train
from pipelines.train.local import TrainResult, train_in_process
from pipelines.train.loop import DataPosition, TrainCallback, Trainer, TrainState
from pipelines.train.optim import build_optimizer, build_scheduler, lr_multiplier
from pipelines.train.order import (
    SAMPLE_LOG_DIR,
    CaptureReader,
    EpochRecord,
    OrderedCapture,
    chain_digest,
    epoch_file,
    epoch_order,
)
from pipelines.train.plan import (
    TrainPlan,
    plan_from_capture,
    plan_from_conversations,
    plan_from_tokenized,
    total_steps,
)
from pipelines.train.target_weights import (
    init_drafter_from_target,
    init_drafter_layers_from_target,
    load_target_embed,
    load_target_lm_head,
    load_target_tensor,
)
from pipelines.train.tracking import MlflowTracker, TrackingConfig
from pipelines.train.warm_start import (
    InitHead,
    check_init_head,
    fetch_init_head,
    load_init_weights,
    resolve_init_from,
)
from pipelines.train.worker import WorkerConfig, build_drafter, train_loop_per_worker

__all__ = [
    "MODEL_FILE", "OPTIMIZER_FILE", "RANK_FILE", "SAMPLE_LOG_DIR", "SCHEDULER_FILE", "STATE_FILE", "CaptureReader",
    "Checkpointer", "DataPosition", "EpochRecord", "InitHead", "MlflowTracker", "OrderedCapture", "ShardedCheckpointer", "TrackingConfig", "TrainCallback", "TrainPlan",
    "TrainResult", "TrainRunResult", "TrainState", "Trainer", "WorkerConfig", "build_drafter", "build_optimizer", "build_scheduler",
    "chain_digest", "check_init_head", "epoch_file", "epoch_order", "estimate_steps_per_epoch", "fetch_init_head",
    "init_drafter_from_target", "init_drafter_layers_from_target", "iter_packed_batches", "latest_checkpoint",
    "load_init_weights", "load_target_embed", "load_target_lm_head", "load_target_tensor", "lr_multiplier",
    "optimizer_digest", "plan_from_capture", "plan_from_conversations", "plan_from_tokenized", "resolve_init_from",
    "run_train", "total_steps",
    "train_in_process", "train_loop_per_worker",
]
