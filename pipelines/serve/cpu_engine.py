"""The vLLM engine of a CPU ``LLMServer`` replica, without the worker process Ray Serve LLM asks for.

Ray Serve LLM sets ``distributed_executor_backend="mp"`` for every CPU replica
(``ray/llm/_internal/serve/engines/vllm/vllm_models.py``, ``get_initialization_kwargs``). vLLM keeps an explicit
``mp`` even for one worker (``vllm/config/parallel.py`` downgrades only an unset backend to ``uni``), so a CPU
replica runs three processes that each import vLLM and torch: the replica, vLLM's engine core, and a
``MultiprocExecutor`` worker under it. :class:`UniprocVLLMEngine` sets ``uni`` where the engine has one worker: the
model runs inside the engine core process, which still keeps the replica's event loop free. What that saved on the
2-core CI box: ``docs/pitfalls.md`` ("Ray Serve LLM's executor on CPU").

Ray loads it through its own escape hatch for the engine class, the ``RAYLLM_VLLM_ENGINE_CLS`` environment variable
of the replica (:data:`pipelines.serve.CPU_REPLICA_ENV`; ``ray/llm/_internal/serve/core/server/llm_server.py``,
``_get_default_engine_class``), so only the replica imports this module (and vLLM with it).
"""

from __future__ import annotations

import logging

from ray.llm._internal.serve.engines.vllm.vllm_engine import VLLMEngine

log = logging.getLogger(__name__)


class UniprocVLLMEngine(VLLMEngine):
    """Ray Serve LLM's ``VLLMEngine`` with vLLM's ``uni`` executor where the engine has one worker."""

    def _prepare_engine_config(self, callback_ctx):
        engine_args, frontend_args, config = super()._prepare_engine_config(callback_ctx)
        parallel = config.parallel_config
        if parallel.world_size == 1 and parallel.distributed_executor_backend == "mp":
            parallel.distributed_executor_backend = "uni"
            engine_args.distributed_executor_backend = "uni"
            log.info("one worker: vLLM's uni executor (the model runs in the engine core process)")
        return engine_args, frontend_args, config


__all__ = ["UniprocVLLMEngine"]
