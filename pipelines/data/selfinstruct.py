"""Self-instruct prompts: the target writes its own user turns (Magpie, arXiv 2406.08464).

Method: an aligned chat model given only its chat template up to the opening of a user turn writes a
plausible user message. The *pre-query* string is derived from the tokenizer's own template, for any
template: render ``[system?, {"role": "user", "content": SENTINEL}]`` (no generation prompt) and cut
at the sentinel. For ChatML (SmolLM2) that is the template's system turn + ``"<|im_start|>user\\n"``;
what follows the sentinel (``"<|im_end|>\\n"``) is the end of the user turn, whose first token (a
special token) stops the completion besides the EOS ids. Sampling is seeded per request
(``request_seed(seed, "self_instruct", i)``), so the same ``seed`` gives the same prompts on vLLM; the
transformers engine seeds once per batch (same prompts for the same ``batch_size``).

Filters, in order, each counted (:data:`COUNT_KEYS`): ``context_full`` (the pre-query leaves no
room), ``unfinished`` (no end-of-turn within ``max_tokens``), ``empty``, ``too_short`` / ``too_long``
(characters after strip, ``min_chars`` / ``max_chars``), ``exact_duplicates`` (same text after
collapsing whitespace), ``near_duplicates`` (``datasketch`` MinHash of lower-cased word 3-grams in a
``MinHashLSH`` at ``dedup_threshold``; an LSH candidate counts only if its estimated Jaccard
similarity is >= the threshold); the first occurrence is kept. Kept prompts become conversation rows
``{id: "self_instruct/<seed>/<request index>", messages: [system?, user], source: "self_instruct"}``
that the regenerate stage answers like any other conversation; with ``turns: k`` (:func:`pack_turns`) k consecutive
kept prompts make one conversation of k user turns, answered one after another on the growing history: long
histories of the target's own answers, the data a head needs to keep its acceptance after thousands of tokens.

Where it runs (design): self-instruct prompts are data that needs the target's engine, so they are
written before the sources are mixed, not inside ``regenerate_conversations``:
``pipelines.data.prompt_dataset.load_prompt_dataset(data, write_prompts=SelfInstructWriter(target, regenerate,
data, ...))`` calls the writer once per self_instruct source; the writer starts one engine of the
recipe's ``regenerate.backend`` (:class:`~pipelines.data.engines.VLLMEngine` also for the
``ray_data_llm`` runner; in a Ray actor when ``use_ray``), writes the prompts, releases the engine,
and returns the rows, which then go through the same per-source steps (``filter_regex``,
``num_samples``), weighted mixing and train/held-out split as every other source. Without a writer
``load_prompt_dataset`` raises ``ValueError`` naming this class. Cost: one extra engine start.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pipelines.data.engines import CompletionParams, Engine, engine_setup, make_engine, request_seed

if TYPE_CHECKING:
    from pipelines.recipe import DataConfig, RegenerateConfig, SelfInstructConfig, SourceConfig, TargetConfig

log = logging.getLogger(__name__)

SENTINEL = "PEAGLE_SELF_INSTRUCT_QUERY_7F3A"
SOURCE = "self_instruct"
NUM_PERM = 128  # MinHash permutations (datasketch default)
SHINGLE_WORDS = 3
COUNT_KEYS = ("generated", "context_full", "unfinished", "empty", "too_short", "too_long", "exact_duplicates",
              "near_duplicates", "kept")


@dataclass(frozen=True)
class PreQuery:
    """The chat template up to the opening of a user turn.

    ``text``: what the target continues; ``system``: the system turn it holds (None: none given);
    ``stop_token_ids``: the end-of-user-turn token (a special token), empty when the template ends a
    user turn in plain text; ``stop_text``: that end as text (the completion is cut there as well).
    """

    text: str
    system: str | None
    stop_token_ids: tuple[int, ...]
    stop_text: str


def pre_query(tokenizer, system_prompt: str | None = None) -> PreQuery:
    """The pre-query string of ``tokenizer``'s chat template (module doc), with an optional system turn.

    Raises:
        ValueError: the template has no chat template or drops the user message.
    """
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else [])
    messages.append({"role": "user", "content": SENTINEL})
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("self_instruct needs the target's chat template; the tokenizer has none")
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    at = rendered.find(SENTINEL)
    if at < 0:
        raise ValueError(f"the chat template dropped the user message; cannot derive its pre-query string "
                         f"(rendered: {rendered[:200]!r})")
    end = rendered[at + len(SENTINEL):].strip()
    stop: tuple[int, ...] = ()
    if end:
        first = tokenizer(end, add_special_tokens=False)["input_ids"][:1]
        special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
        if first and first[0] in special:
            stop = (int(first[0]),)
    return PreQuery(text=rendered[:at], system=system_prompt, stop_token_ids=stop, stop_text=end)


def _normalized(text: str) -> str:
    return " ".join(text.split())


def _minhash(text: str):
    from datasketch import MinHash

    words = text.lower().split()
    grams = {" ".join(words[i:i + SHINGLE_WORDS]) for i in range(max(1, len(words) - SHINGLE_WORDS + 1))}
    m = MinHash(num_perm=NUM_PERM)
    m.update_batch([g.encode("utf-8") for g in grams])
    return m


def deduplicate(texts: Sequence[str], threshold: float | None, stats: Counter | None = None) -> list[int]:
    """Indices of ``texts`` kept after exact- and near-duplicate removal (first occurrence kept, in order).

    Exact: equal after collapsing whitespace. Near (``threshold`` not None): MinHashLSH candidates
    whose estimated Jaccard similarity of word 3-grams is >= ``threshold``. ``stats`` receives
    ``exact_duplicates`` and ``near_duplicates``.
    """
    from datasketch import MinHashLSH

    stats = stats if stats is not None else Counter()
    seen: set[str] = set()
    lsh = MinHashLSH(threshold=threshold, num_perm=NUM_PERM) if threshold is not None else None
    hashes: dict[str, Any] = {}
    keep = []
    for i, text in enumerate(texts):
        key = _normalized(text)
        if key in seen:
            stats["exact_duplicates"] += 1
            continue
        seen.add(key)
        if lsh is not None:
            m = _minhash(text)
            if any(m.jaccard(hashes[c]) >= threshold for c in lsh.query(m)):
                stats["near_duplicates"] += 1
                continue
            hashes[str(i)] = m
            lsh.insert(str(i), m)
        keep.append(i)
    return keep


def filter_prompts(gens: Sequence[Any], cfg: SelfInstructConfig, stop_text: str = "",
                   stats: Counter | None = None) -> list[tuple[int, str]]:
    """``(request index, prompt text)`` of the completions ``gens`` (:class:`~pipelines.data.engines.Generation`
    or None) that pass the filters of the module doc, in order; counts go to ``stats``."""
    stats = stats if stats is not None else Counter()
    passed = []
    for i, g in enumerate(gens):
        stats["generated"] += 1
        if g is None:
            stats["context_full"] += 1
            continue
        text = g.text
        finished = g.finish_reason != "length"
        if stop_text and stop_text in text:
            text, finished = text[: text.index(stop_text)], True
        text = text.strip()
        if not finished:
            stats["unfinished"] += 1
        elif not text:
            stats["empty"] += 1
        elif len(text) < cfg.min_chars:
            stats["too_short"] += 1
        elif len(text) > cfg.max_chars:
            stats["too_long"] += 1
        else:
            passed.append((i, text))
    kept = deduplicate([t for _, t in passed], cfg.dedup_threshold, stats)
    stats["kept"] += len(kept)
    return [passed[k] for k in kept]


def generate_prompts(engine: Engine, cfg: SelfInstructConfig, *, batch_size: int = 256,
                     stats: Counter | None = None) -> list[dict[str, Any]]:
    """Let ``engine`` (with ``complete`` and ``tokenizer``) write ``cfg.num_prompts`` user prompts,
    filter and deduplicate them (module doc), in batches of ``batch_size`` completions.

    Returns:
        conversation rows ``{id, messages: [system?, user], source: "self_instruct"}`` in request
        order; ``stats`` receives the counts of :data:`COUNT_KEYS`, ``num_generated_tokens`` and
        ``generate_s`` (also logged).

    Raises:
        ValueError: the target's chat template gives no pre-query string (:func:`pre_query`).
    """
    stats = stats if stats is not None else Counter()
    pq = pre_query(engine.tokenizer, cfg.system_prompt)
    params = CompletionParams(temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=cfg.max_tokens,
                              stop_token_ids=pq.stop_token_ids)
    seeds = [request_seed(cfg.seed, SOURCE, i) for i in range(cfg.num_prompts)]
    gens: list[Any] = []
    t0 = time.perf_counter()
    for start in range(0, cfg.num_prompts, batch_size):
        chunk = seeds[start:start + batch_size]
        gens.extend(engine.complete([pq.text] * len(chunk), params, chunk))
        log.info("self_instruct: %d/%d prompts written", len(gens), cfg.num_prompts)
    stats["generate_s"] += time.perf_counter() - t0
    stats["num_generated_tokens"] += sum(g.num_tokens for g in gens if g is not None)
    kept = filter_prompts(gens, cfg, pq.stop_text, stats)
    log.info("self_instruct (seed %d): %s", cfg.seed, summary(stats))
    return pack_turns(kept, cfg, pq.system)


# the assistant turns between packed user turns: replaced by the target's answers in the regenerate stage (a recipe
# with a self_instruct source must regenerate: pipelines.recipe.load), never trained on
ANSWER_PLACEHOLDER = "[answered by the target in the regenerate stage]"


def pack_turns(kept: Sequence[tuple[int, str]], cfg: SelfInstructConfig, system: str | None) -> list[dict[str, Any]]:
    """Conversation rows of the kept prompts ``(request index, text)``: one user turn each, or with
    ``cfg.turns`` = k > 1, k consecutive prompts a conversation (the last one may have fewer), their assistant turns
    :data:`ANSWER_PLACEHOLDER` until the regenerate stage answers them. Ids: ``self_instruct/<seed>/<request index>``
    of the first prompt, with ``+<n>`` for a conversation of n > 1 turns."""
    k = cfg.turns or 1
    head = [{"role": "system", "content": system}] if system else []
    rows = []
    for start in range(0, len(kept), k):
        chunk = kept[start:start + k]
        turns = [m for j, (_, text) in enumerate(chunk) for m in (
            [{"role": "user", "content": text}] if j == len(chunk) - 1
            else [{"role": "user", "content": text}, {"role": "assistant", "content": ANSWER_PLACEHOLDER}])]
        suffix = f"+{len(chunk)}" if len(chunk) > 1 else ""
        rows.append({"id": f"{SOURCE}/{cfg.seed}/{chunk[0][0]}{suffix}", "messages": [*head, *turns],
                     "source": SOURCE})
    return rows


def summary(stats: Mapping[str, Any]) -> str:
    """``"generated 8, context_full 0, ..., kept 6"``: the counts of :data:`COUNT_KEYS`."""
    return ", ".join(f"{k} {int(stats.get(k, 0))}" for k in COUNT_KEYS)


class SelfInstructActor:
    """Ray actor holding one engine that writes self-instruct prompts."""

    def __init__(self, backend: str, model_path: str, engine_kwargs: Mapping[str, Any]):
        self.engine = make_engine(backend, model_path, **dict(engine_kwargs))

    def write(self, cfg: SelfInstructConfig, batch_size: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        stats: Counter = Counter()
        rows = generate_prompts(self.engine, cfg, batch_size=batch_size, stats=stats)
        return rows, dict(stats)


class SelfInstructWriter:
    """The ``write_prompts`` callable of :func:`pipelines.data.prompt_dataset.load_prompt_dataset`: for each
    self_instruct source, start one engine of ``regenerate.backend`` (``make_engine`` with
    :func:`pipelines.data.engines.engine_setup`'s arguments; a Ray actor of ``num_cpus_per_worker`` CPUs
    and one GPU when the cluster has one, or in-process when ``use_ray`` is false), write the prompts,
    release the engine. ``stats``: the counts of every call, in call order.
    """

    def __init__(self, target_cfg: TargetConfig, regen_cfg: RegenerateConfig, data_cfg: DataConfig, *,
                 use_ray: bool = True, num_cpus_per_worker: float = 1,
                 engine_kwargs: Mapping[str, Any] | None = None):
        self.target_cfg, self.regen_cfg, self.data_cfg = target_cfg, regen_cfg, data_cfg
        self.use_ray, self.num_cpus_per_worker = use_ray, num_cpus_per_worker
        self.engine_kwargs = dict(engine_kwargs or {})
        self.stats: list[dict[str, Any]] = []

    def __call__(self, source_cfg: SourceConfig) -> list[dict[str, Any]]:
        """Rows of the kept prompts of ``source_cfg`` (kind self_instruct).

        Raises:
            ValueError: ``source_cfg`` is not a self_instruct source.
        """
        if source_cfg.kind != "self_instruct" or source_cfg.self_instruct is None:
            raise ValueError(f"SelfInstructWriter writes self_instruct sources, got kind {source_cfg.kind!r}")
        cfg, batch_size = source_cfg.self_instruct, self.regen_cfg.batch_size
        model_path, kwargs = engine_setup(self.target_cfg, self.regen_cfg, self.data_cfg,
                                          num_cpus_per_worker=self.num_cpus_per_worker,
                                          engine_kwargs=self.engine_kwargs)
        if not self.use_ray:
            engine = make_engine(self.regen_cfg.backend, model_path, **kwargs)
            stats: Counter = Counter()
            rows = generate_prompts(engine, cfg, batch_size=batch_size, stats=stats)
            del engine
            self.stats.append(dict(stats))
            return rows
        import ray

        if not ray.is_initialized():
            ray.init()  # as ray.data does on first use
        num_gpus = 1 if ray.cluster_resources().get("GPU", 0) >= 1 else 0
        actor = ray.remote(num_cpus=self.num_cpus_per_worker, num_gpus=num_gpus)(SelfInstructActor).remote(
            self.regen_cfg.backend, str(model_path), kwargs)
        try:
            rows, stats = ray.get(actor.write.remote(cfg, batch_size))
        finally:
            ray.kill(actor)
        log.info("self_instruct (seed %d, in a Ray actor): %s", cfg.seed, summary(stats))
        self.stats.append(stats)
        return rows
