"""Ray 2.60's ray.llm (built for vLLM 0.29) imports ``ErrorInfo`` and ``ErrorResponse`` from here; vLLM 0.26
keeps them in ``vllm.entrypoints.openai.engine.protocol``."""

from vllm.entrypoints.openai.engine.protocol import *
from vllm.entrypoints.openai.engine.protocol import ErrorInfo, ErrorResponse  # noqa: F401
