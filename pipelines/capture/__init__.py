"""Capture stage: target aux hidden states for drafter training, with Ray Data.

Per conversation the target's chat template is applied, the tokens it would generate (assistant
turns) are marked in ``loss_mask``, and one target forward records (see :mod:`peagle_core.shards`)::

    input_ids [N] int32, loss_mask [N] uint8, aux [N, 3*Ht], final_hidden [N, Ht]

``aux`` = HF ``hidden_states[i]`` for the aux layer ids (vLLM "input of layer i",
``vllm/model_executor/models/llama_eagle3.py``); ``final_hidden`` is after the target's final norm,
so the trainer gets the target distribution as ``lm_head(final_hidden)`` at ~1/8-1/55 of the bytes
of stored draft-vocab log-probs (reasoning in :mod:`peagle_core.shards`).

Two Ray Data stages: tokenization (chat template, loss mask, truncation; pure CPU) runs as
``map_batches`` tasks on CPU workers, and the model step (padded batch, target forward, hidden
states to host) runs on an actor pool holding the target on its GPU. :func:`capture_batch` chains
both in one process (no Ray). Two outputs: materialized shards on disk (:func:`run_capture`,
resumable) or a stream the trainer consumes (:func:`capture_stream`, nothing on disk).

One job per file:

* ``rows.py``: row formats between the stages (conversation rows, Arrow tokenized blocks, columns).
* ``tokenize.py``: chat template -> ids and loss mask, drops, the tokenize stages, token counts.
* ``forward.py``: the batched target forward (:func:`capture_tokenized`, :func:`capture_batch`).
* ``target.py``: resolving and loading the target, backend checks.
* ``actors.py``: the Ray Data model-stage actors and the stages' resources.
* ``materialize.py``: :func:`run_capture`, resumable shards, token counts and meta on disk.
* ``stream.py``: :func:`capture_stream`. ``dataset.py``: :func:`captured_dataset` (shards read back).

Backends: ``transformers`` (CPU and GPU; batches grouped by length, ``torch.inference_mode``, one
pinned host buffer per batch copied on a side stream while the next batch runs).
``vllm`` (vLLM >= 0.18 speculative method ``extract_hidden_states`` + ``ExampleHiddenStatesConnector``)
is the GPU-cluster path; it is CUDA-only, so here it raises before any compute.

Shape legend: N tokens of one sample, Ht target hidden.
"""

from pipelines.capture.actors import CaptureActor, CaptureShardActor
from pipelines.capture.dataset import captured_dataset
from pipelines.capture.forward import capture_batch, capture_tokenized, length_batches
from pipelines.capture.materialize import CaptureResult, run_capture
from pipelines.capture.rows import (
    conversation_rows,
    samples_to_columns,
    tokenized_from_batch,
    tokenized_to_arrow,
)
from pipelines.capture.stream import capture_stream
from pipelines.capture.target import load_target, resolve_target
from pipelines.capture.tokenize import (
    DROP_REASONS,
    ConversationError,
    count_assistant_tokens,
    prepare_samples,
    tokenize_conversation,
    tokenize_conversations,
    tokenize_rows,
    tokenize_shard_tasks,
)

__all__ = [
    "DROP_REASONS",
    "CaptureActor",
    "CaptureResult",
    "CaptureShardActor",
    "ConversationError",
    "capture_batch",
    "capture_stream",
    "capture_tokenized",
    "captured_dataset",
    "conversation_rows",
    "count_assistant_tokens",
    "length_batches",
    "load_target",
    "prepare_samples",
    "resolve_target",
    "run_capture",
    "samples_to_columns",
    "tokenize_conversation",
    "tokenize_conversations",
    "tokenize_rows",
    "tokenize_shard_tasks",
    "tokenized_from_batch",
    "tokenized_to_arrow",
]
