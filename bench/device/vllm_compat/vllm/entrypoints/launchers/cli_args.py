"""Ray 2.60's ray.llm (built for vLLM 0.29) imports ``FrontendArgs`` from here; vLLM 0.26 keeps it in
``vllm.entrypoints.openai.cli_args``."""

from vllm.entrypoints.openai.cli_args import *
from vllm.entrypoints.openai.cli_args import FrontendArgs  # noqa: F401
