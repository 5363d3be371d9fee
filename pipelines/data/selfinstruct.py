"""Self-instruct prompts: the target writes its own user turns (Magpie, arXiv 2406.08464).

Method: an aligned chat model given only its chat template up to the opening of a user turn writes a
plausible user message. The *pre-query* string is derived from the tokenizer's own template, for any
template: render ``[system?, {"role": "user", "content": SENTINEL}]`` (no generation prompt) and cut
at the sentinel. For ChatML (SmolLM2) that is the template's system turn + ``"<|im_start|>user\\n"``;
what follows the sentinel (``"<|im_end|>\\n"``) is the end of the user turn, whose first token (a
special token) stops the completion besides the EOS ids. Sampling is seeded per request
(``request_seed(seed, "self_instruct", i)``), so the same ``seed`` gives the same prompts on vLLM whatever the
number of engines and however a run was interrupted (up to vLLM's own batch-dependent numerics); the
transformers engine seeds once per batch (the seed of its first request), so it gives the same prompts for the
same ``regenerate.batch_size``: requests are cut into ranges at its multiples (:func:`missing_ranges`) whatever
the number of engines, unless a run resumes from parts written with another ``batch_size``.

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
data, ...))`` calls the writer once per self_instruct source. The writer spreads the source's request indices,
in ranges of ``regenerate.batch_size``, over the regenerate stage's engine pool: ``regenerate.num_workers``
engine actors of ``regenerate.backend`` (:class:`~pipelines.data.engines.VLLMEngine` also for the
``ray_data_llm`` runner; ``regenerate.engines_per_gpu`` of them a GPU, as :mod:`pipelines.data.engine_pool`
places them; one in-process engine without Ray), each handed the next range as it finishes one. The pool serves
every self_instruct source and is released when the writer closes (``with SelfInstructWriter(...) as writer``).
The rows then go through the same per-source steps (``filter_regex``, ``num_samples``), weighted mixing and
train/held-out split as every other source. Without a writer ``load_prompt_dataset`` raises ``ValueError`` naming
this class. Cost: one extra engine start per engine, whatever the number of self_instruct sources.

Parts (:func:`write_prompts`): every range's raw completions (before any filter) are kept as they come back,
atomically, in a parts directory (the stage gives ``regenerate/self_instruct-parts-<key>``, keyed by what
changes the completions: :data:`FILTER_FIELDS` are not; :mod:`pipelines.data.parts`). A rerun takes them and
completes only the missing request indices; the filters and duplicate removal run once all completions are in,
over the whole ordered list, so the kept prompts are those of an uninterrupted run. ``bench.parts_carry``
carries the parts from one lent machine to the next.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Container, Iterator, Mapping, Sequence
from contextlib import closing
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

from pipelines.data.engine_pool import check_pool_fits, engine_share, start_engine
from pipelines.data.engines import (
    CompletionParams,
    Engine,
    Generation,
    engine_setup,
    make_engine,
    request_seed,
)
from pipelines.data.parts import read_range_parts, write_range_part

if TYPE_CHECKING:
    from pipelines.recipe import DataConfig, RegenerateConfig, SelfInstructConfig, SourceConfig, TargetConfig

log = logging.getLogger(__name__)

SENTINEL = "PEAGLE_SELF_INSTRUCT_QUERY_7F3A"
SOURCE = "self_instruct"
NUM_PERM = 128  # MinHash permutations (datasketch default)
SHINGLE_WORDS = 3
# SelfInstructConfig fields applied after the completions (their number, the filters, the packing): not in the key
# of a parts directory, so changing them keeps the completions already written
FILTER_FIELDS = frozenset({"num_prompts", "min_chars", "max_chars", "dedup_threshold", "turns"})
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


def _minhash(text: str, empty):
    """The MinHash of ``text``'s lower-cased word 3-grams, from ``empty`` (a ``datasketch.MinHash`` of
    :data:`NUM_PERM` made once: a new one draws its permutations again, ~45% of the time of deduplicating 780k
    prompts)."""
    words = text.lower().split()
    grams = {" ".join(words[i:i + SHINGLE_WORDS]) for i in range(max(1, len(words) - SHINGLE_WORDS + 1))}
    m = empty.copy()
    m.update_batch([g.encode("utf-8") for g in grams])
    return m


def deduplicate(texts: Sequence[str], threshold: float | None, stats: Counter | None = None,
                advance: Callable[[int], None] | None = None) -> list[int]:
    """Indices of ``texts`` kept after exact- and near-duplicate removal (first occurrence kept, in order).

    Exact: equal after collapsing whitespace. Near (``threshold`` not None): MinHashLSH candidates
    whose estimated Jaccard similarity of word 3-grams is >= ``threshold``. ``stats`` receives
    ``exact_duplicates`` and ``near_duplicates``; ``advance(1)`` (a progress meter) is called for each text.
    """
    from datasketch import MinHash, MinHashLSH

    stats = stats if stats is not None else Counter()
    seen: set[str] = set()
    lsh = MinHashLSH(threshold=threshold, num_perm=NUM_PERM) if threshold is not None else None
    empty = MinHash(num_perm=NUM_PERM)
    hashes: dict[str, Any] = {}
    keep = []
    for i, text in enumerate(texts):
        if advance is not None:
            advance(1)
        key = _normalized(text)
        if key in seen:
            stats["exact_duplicates"] += 1
            continue
        seen.add(key)
        if lsh is not None:
            m = _minhash(text, empty)
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
    from pipelines.console import progress

    # minutes for the 480k prompts of a large recipe (~0.2 ms a prompt): a progress line like the generation's
    with progress(f"self_instruct duplicates (seed {cfg.seed})", total=len(passed), unit="prompts") as meter:
        kept = deduplicate([t for _, t in passed], cfg.dedup_threshold, stats, advance=meter)
    stats["kept"] += len(kept)
    return [passed[k] for k in kept]


def completion_params(cfg: SelfInstructConfig, pq: PreQuery) -> CompletionParams:
    """Sampling of the self-instruct completions: ``cfg``'s, stopped at the end of the user turn."""
    return CompletionParams(temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=cfg.max_tokens,
                            stop_token_ids=pq.stop_token_ids)


def complete_range(engine: Engine, cfg: SelfInstructConfig, pq: PreQuery, start: int, stop: int,
                   ) -> list[Generation | None]:
    """The raw completions of request indices ``[start, stop)``: one ``engine.complete`` call of the pre-query,
    each request seeded ``request_seed(cfg.seed, "self_instruct", i)``."""
    seeds = [request_seed(cfg.seed, SOURCE, i) for i in range(start, stop)]
    return engine.complete([pq.text] * len(seeds), completion_params(cfg, pq), seeds)


def missing_ranges(num_prompts: int, done: Container[int], batch_size: int) -> list[tuple[int, int]]:
    """``[start, stop)`` ranges of the request indices below ``num_prompts`` not in ``done``: contiguous runs, cut
    at the multiples of ``batch_size``, in order. Without ``done`` the same cut for any number of engines:
    ``(0, b), (b, 2b), ...``."""
    out = []
    for cell in range(0, num_prompts, batch_size):
        i, stop = cell, min(cell + batch_size, num_prompts)
        while i < stop:
            if i in done:
                i += 1
                continue
            j = i
            while j < stop and j not in done:
                j += 1
            out.append((i, j))
            i = j
    return out


# (start, raw completions of requests start.., engine seconds) per range, in any order: what a runner yields
Completions = Iterator[tuple[int, list[Generation | None], float]]


def write_prompts(complete: Callable[[list[tuple[int, int]]], Completions], cfg: SelfInstructConfig,
                  pq: PreQuery, *, batch_size: int, parts_dir: str | Path | None = None,
                  stats: Counter | None = None) -> list[dict[str, Any]]:
    """``cfg.num_prompts`` prompts: the completions ``parts_dir`` holds (:func:`~pipelines.data.parts.read_range_parts`),
    then the :func:`missing_ranges` of ``batch_size`` from ``complete(ranges)`` (a generator, e.g. an engine pool's;
    each range kept in ``parts_dir`` as it comes back, :func:`~pipelines.data.parts.write_range_part`), then the
    filters and duplicate removal over all of them in request order (module doc), as an uninterrupted run.

    Progress: prompts written, their rate and ETA (``pipelines.console.progress``: a line every 30 s off a
    terminal). ``stats``: the counts of :data:`COUNT_KEYS`, ``num_generated_tokens`` (parts' too),
    ``generate_s`` (this run's engine seconds, summed over engines) and ``resumed_prompts``.

    Returns:
        the rows of :func:`pack_turns`.

    Raises:
        RuntimeError: ``complete`` ended without every range (nothing is filtered; the parts stay).
    """
    from pipelines.console import progress

    stats = stats if stats is not None else Counter()
    gens: dict[int, Generation | None] = {}
    if parts_dir is not None:
        gens = {i: None if g is None else Generation(**g)
                for i, g in read_range_parts(parts_dir, cfg.num_prompts).items()}
        if gens:
            log.info("self_instruct (seed %d): %d of %d completions taken from the parts in %s", cfg.seed, len(gens),
                     cfg.num_prompts, parts_dir)
    stats["resumed_prompts"] += len(gens)
    todo = missing_ranges(cfg.num_prompts, gens, batch_size)
    with (progress(f"self_instruct (seed {cfg.seed})", total=sum(b - a for a, b in todo), unit="prompts") as meter,
          closing(complete(todo)) as results):
        for start, out, seconds in results:
            if parts_dir is not None:
                write_range_part(parts_dir, start, [None if g is None else asdict(g) for g in out])
            gens.update(enumerate(out, start))
            stats["generate_s"] += seconds
            meter(len(out))
            log.info("self_instruct (seed %d): %d/%d prompts written", cfg.seed, len(gens), cfg.num_prompts)
    if len(gens) != cfg.num_prompts:  # a runner that dropped a range: never filter a partial list
        raise RuntimeError(f"self_instruct (seed {cfg.seed}): {cfg.num_prompts - len(gens)} of {cfg.num_prompts} "
                           "requests came back from no engine")
    ordered = [gens[i] for i in range(cfg.num_prompts)]
    stats["num_generated_tokens"] += sum(g.num_tokens for g in ordered if g is not None)
    kept = filter_prompts(ordered, cfg, pq.stop_text, stats)
    log.info("self_instruct (seed %d): %s", cfg.seed, summary(stats))
    return pack_turns(kept, cfg, pq.system)


def in_process(engine: Engine, cfg: SelfInstructConfig, pq: PreQuery, ranges: list[tuple[int, int]]) -> Completions:
    """The runner of one engine in this process: :func:`complete_range` of each range, in order."""
    for start, stop in ranges:
        t0 = time.perf_counter()
        out = complete_range(engine, cfg, pq, start, stop)
        yield start, out, time.perf_counter() - t0


def generate_prompts(engine: Engine, cfg: SelfInstructConfig, *, batch_size: int = 256,
                     stats: Counter | None = None, parts_dir: str | Path | None = None) -> list[dict[str, Any]]:
    """Let ``engine`` (with ``complete`` and ``tokenizer``) write ``cfg.num_prompts`` user prompts,
    filter and deduplicate them (module doc), in calls of ``batch_size`` completions (:func:`write_prompts`;
    ``parts_dir``: keep each call's completions there and take those an earlier run kept).

    Returns:
        conversation rows ``{id, messages: [system?, user], source: "self_instruct"}`` in request
        order; ``stats`` receives the counts of :func:`write_prompts` (also logged).

    Raises:
        ValueError: the target's chat template gives no pre-query string (:func:`pre_query`).
    """
    pq = pre_query(engine.tokenizer, cfg.system_prompt)
    return write_prompts(lambda ranges: in_process(engine, cfg, pq, ranges), cfg, pq, batch_size=batch_size,
                         parts_dir=parts_dir, stats=stats)


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
    """Ray actor of the engine pool holding one engine (``make(backend, model_path, **engine_kwargs)``, started by
    :func:`~pipelines.data.engine_pool.start_engine` beside the other ``engines_per_gpu - 1`` engines of its GPU)
    that completes ranges of self-instruct requests."""

    def __init__(self, backend: str, model_path: str, engine_kwargs: Mapping[str, Any], engines_per_gpu: int = 1,
                 make: Callable[..., Engine] = make_engine):
        self.engine = start_engine(partial(make, backend, model_path), model_path, engines_per_gpu, engine_kwargs)

    def complete(self, cfg: SelfInstructConfig, pq: PreQuery, start: int, stop: int,
                 ) -> tuple[int, list[Generation | None], float]:
        """``(start, completions of [start, stop), engine seconds)``: :func:`complete_range`."""
        return next(in_process(self.engine, cfg, pq, [(start, stop)]))


class SelfInstructWriter:
    """The ``write_prompts`` callable of :func:`pipelines.data.prompt_dataset.load_prompt_dataset`: for each
    self_instruct source, the completions of :func:`write_prompts` from engines of ``regenerate.backend``
    (``make_engine`` with :func:`pipelines.data.engines.engine_setup`'s arguments), started only when requests
    are left: with ``use_ray``, a pool of ``regenerate.num_workers`` engine actors (at most one per range) with
    the regenerate pool's resources (:func:`~pipelines.data.engine_pool.engine_share` of ``num_cpus_per_worker``,
    ``regenerate.engines_per_gpu`` engines a GPU), each handed the next range as it finishes one; else one
    engine in-process. The pool serves every source of the recipe (a later source that needs more engines adds
    them; an engine's start is ~1.5 min of a GPU on an H200) and ends with :meth:`close` (the writer is a context
    manager); the in-process engine ends with its source.

    ``parts_dir(cfg)``: the directory that keeps the completions of the source of self_instruct config ``cfg``
    (the stage gives ``regenerate/self_instruct-parts-<key>``); None: none kept. ``make``: the engine factory
    (tests). ``stats``: the counts of every call, in call order; ``parts_dirs``: the parts directories used.
    """

    def __init__(self, target_cfg: TargetConfig, regen_cfg: RegenerateConfig, data_cfg: DataConfig, *,
                 use_ray: bool = True, num_cpus_per_worker: float = 1,
                 engine_kwargs: Mapping[str, Any] | None = None,
                 parts_dir: Callable[[SelfInstructConfig], Path] | None = None,
                 make: Callable[..., Engine] = make_engine):
        self.target_cfg, self.regen_cfg, self.data_cfg = target_cfg, regen_cfg, data_cfg
        self.use_ray, self.num_cpus_per_worker = use_ray, num_cpus_per_worker
        self.engine_kwargs = dict(engine_kwargs or {})
        self.parts_dir, self.make = parts_dir, make
        self.stats: list[dict[str, Any]] = []
        self.parts_dirs: list[Path] = []
        self._actors: list[Any] = []  # the Ray pool's engine actors, kept from one source to the next

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """End the pool's engines (their GPUs go back to the cluster); a later source starts a new pool."""
        if self._actors:
            import ray

            for a in self._actors:
                ray.kill(a)
        self._actors = []

    def __call__(self, source_cfg: SourceConfig) -> list[dict[str, Any]]:
        """Rows of the kept prompts of ``source_cfg`` (kind self_instruct).

        Raises:
            ValueError: ``source_cfg`` is not a self_instruct source; the Ray cluster cannot hold the engine pool
                (:func:`~pipelines.data.engine_pool.check_pool_fits`, before any engine starts); the target's
                chat template gives no pre-query string (:func:`pre_query`).
        """
        from transformers import AutoTokenizer

        if source_cfg.kind != "self_instruct" or source_cfg.self_instruct is None:
            raise ValueError(f"SelfInstructWriter writes self_instruct sources, got kind {source_cfg.kind!r}")
        cfg = source_cfg.self_instruct
        model_path, kwargs = engine_setup(self.target_cfg, self.regen_cfg, self.data_cfg,
                                          num_cpus_per_worker=self.num_cpus_per_worker,
                                          engine_kwargs=self.engine_kwargs)
        pq = pre_query(AutoTokenizer.from_pretrained(str(model_path)), cfg.system_prompt)
        parts = None if self.parts_dir is None else Path(self.parts_dir(cfg))
        if parts is not None:
            self.parts_dirs.append(parts)
        stats: Counter = Counter()
        runner = self._pool if self.use_ray else self._in_process
        rows = write_prompts(lambda ranges: runner(model_path, kwargs, cfg, pq, ranges, stats), cfg, pq,
                             batch_size=self.regen_cfg.batch_size, parts_dir=parts, stats=stats)
        self.stats.append(dict(stats))
        return rows

    def _in_process(self, model_path: Path, kwargs: dict[str, Any], cfg: SelfInstructConfig, pq: PreQuery,
                    ranges: list[tuple[int, int]], stats: Counter) -> Completions:
        if not ranges:
            return
        if self.regen_cfg.num_workers > 1:
            log.warning("self_instruct in-process (use_ray=False): one engine; regenerate.num_workers=%d ignored",
                        self.regen_cfg.num_workers)
        stats["num_engines"] = 1
        yield from in_process(self.make(self.regen_cfg.backend, model_path, **kwargs), cfg, pq, ranges)

    def _pool(self, model_path: Path, kwargs: dict[str, Any], cfg: SelfInstructConfig, pq: PreQuery,
              ranges: list[tuple[int, int]], stats: Counter) -> Completions:
        if not ranges:
            return
        import ray
        from ray.util import ActorPool

        if not ray.is_initialized():
            ray.init()  # as ray.data does on first use
        num_cpus, num_gpus = share = engine_share(self.regen_cfg, self.num_cpus_per_worker)
        num_engines = min(self.regen_cfg.num_workers, len(ranges))
        started = max(0, num_engines - len(self._actors))
        if started:
            check_pool_fits(self.regen_cfg, num_engines, share, ray.cluster_resources())
            actor = ray.remote(SelfInstructActor).options(num_cpus=num_cpus, num_gpus=num_gpus)
            self._actors += [actor.remote(self.regen_cfg.backend, str(model_path), kwargs,
                                          self.regen_cfg.engines_per_gpu, self.make) for _ in range(started)]
        stats["num_engines"], stats["engines_started"] = min(len(self._actors), len(ranges)), started
        try:
            yield from ActorPool(self._actors).map_unordered(lambda a, r: a.complete.remote(cfg, pq, *r), ranges)
        except BaseException:
            self.close()  # an engine may be mid-range: never hand it the next source's
            raise
