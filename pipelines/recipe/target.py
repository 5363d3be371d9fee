"""``target``: the model whose next tokens the drafter learns to predict; aux layer id and token id checks.

Aux layer ids use vLLM's meaning, "input of layer i" = HF ``hidden_states[i]``; vLLM's default is
(2, N // 2, N - 3) (vllm/model_executor/models/llama_eagle3.py).
"""

from __future__ import annotations

from pydantic import Field

from peagle_core.drafter_config import default_aux_layer_ids
from pipelines.assets import DEFAULT_TARGET, EMBEDDED_TARGETS
from pipelines.recipe.base import Dtype, Section


class TargetConfig(Section):
    """The target model whose next tokens the drafter learns to predict."""

    model: str = Field(
        DEFAULT_TARGET,
        description="Embedded asset name (e.g. 'smollm2-135m-instruct', converted once under PEAGLE_HOME) "
        "or a local HF model directory (config.json + safetensors), or a hub id on clusters.",
    )
    dtype: Dtype = Field("float32", description="Dtype the target runs in (float32 on CPU: no native bf16 there).")
    aux_layer_ids: tuple[int, int, int] | None = Field(
        None,
        description="Three target layers whose INPUT hidden states (= HF hidden_states[i], vLLM "
        "'input of layer i') feed the drafter; None = vLLM default (2, N//2, N-3).",
    )
    num_hidden_layers: int | None = Field(
        None, ge=1, description="Declared number of target layers N (for recipes whose weights are not local)."
    )
    hidden_size: int | None = Field(None, ge=1, description="Declared target hidden size H (units: features).")
    vocab_size: int | None = Field(None, ge=1, description="Declared target vocab size V (embedding rows).")

    @property
    def embedded(self):
        """The :class:`pipelines.assets.EmbeddedTarget` spec when ``model`` names one, else None."""
        return EMBEDDED_TARGETS.get(self.model)

    def known(self, key: str) -> int | None:
        """Declared value of ``key`` (num_hidden_layers|hidden_size|vocab_size), else the embedded
        asset's, else None."""
        value = getattr(self, key)
        if value is None and self.embedded is not None:
            value = getattr(self.embedded, key)
        return value

    def resolve_aux_layer_ids(self, num_hidden_layers: int | None = None) -> tuple[int, int, int]:
        """Aux layer ids for a target with ``num_hidden_layers`` layers (default: the known count).

        Raises:
            ValueError: N unknown, or an id outside [0, N).
        """
        n = num_hidden_layers if num_hidden_layers is not None else self.known("num_hidden_layers")
        if n is None:
            raise ValueError(
                f"target.num_hidden_layers is unknown for target.model={self.model!r}; declare it in the "
                "recipe or call resolve_aux_layer_ids(config.num_hidden_layers)"
            )
        ids = self.aux_layer_ids if self.aux_layer_ids is not None else default_aux_layer_ids(n)
        check_aux_layer_ids(ids, n)
        return tuple(ids)

    def check_token_id(self, token_id: int, field: str, vocab_size: int | None = None) -> None:
        """Raise ValueError if ``token_id`` (named ``field`` in the message) is outside [0, V)."""
        v = vocab_size if vocab_size is not None else self.known("vocab_size")
        if token_id < 0 or (v is not None and token_id >= v):
            raise ValueError(
                f"{field}={token_id} is outside the target vocab [0, {v}); pick a reserved, unused token "
                f"id of the target tokenizer below {v}"
            )

    def reserved_mask_token_id(self) -> int | None:
        """Default P-EAGLE mask token id of an embedded target (a special token its chat template
        never emits), else None."""
        return self.embedded.reserved_token_id if self.embedded is not None else None


def check_aux_layer_ids(ids, n: int) -> None:
    """Check that every aux layer id lies in [0, n) for a target with ``n`` layers.

    Raises:
        ValueError: an id outside [0, n), with vLLM's default for that ``n``.
    """
    for i in ids:
        if i < 0 or i >= n:
            raise ValueError(
                f"target.aux_layer_ids={list(ids)} has id {i} outside [0, {n}) for a target with "
                f"num_hidden_layers={n}; use ids < {n} (vLLM default: {list(default_aux_layer_ids(n))})"
            )
