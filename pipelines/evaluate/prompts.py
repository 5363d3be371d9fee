"""Evaluation prompts: each ``evaluation.sources`` entry as chat-template prompt token ids, by eval set.

An eval set is named by ``SourceConfig.eval_set_name`` (rows of :func:`pipelines.evaluate.measure.evaluate` carry it as
``eval_set``). MT-Bench with ``turns: 2`` also asks each question's second turn after the target's own
(greedy) answer to the first, written by a ``pipelines.data.engines`` engine.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipelines.recipe import SourceConfig

log = logging.getLogger(__name__)


def prompt_token_ids(conversations: Sequence[Sequence[dict]], tokenizer) -> list[list[int]]:
    """Chat-template prompt ids of each conversation up to (excluding) its last assistant turn.

    Each conversation is a list of ``{role, content}``; a trailing assistant turn (the reference
    answer) is dropped and a generation prompt added.

    Raises:
        ValueError: a conversation without a user turn to answer.
    """
    out = []
    for i, msgs in enumerate(conversations):
        msgs = list(msgs)
        while msgs and msgs[-1]["role"] == "assistant":
            msgs = msgs[:-1]
        if not msgs or msgs[-1]["role"] != "user":
            raise ValueError(f"eval conversation {i} has no final user turn to answer: roles "
                             f"{[m['role'] for m in msgs]}")
        ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        out.append([int(t) for t in ids])
    return out


def load_eval_prompts(
    sources: Sequence[SourceConfig], tokenizer, *, num_prompts: int, seed: int = 0, max_prompt_tokens: int | None = None,
    engine=None, max_tokens: int = 256,
) -> dict[str, list[list[int]]]:
    """``{eval_set_name: prompt token ids}`` for each source (HumanEval, MT-Bench, ShareGPT, a user JSONL),
    ``num_prompts`` conversations drawn from each with ``seed``.

    Names (``SourceConfig.eval_set_name``): ``humaneval`` / ``mtbench`` / ``sharegpt``, ``mtbench-2turn`` for
    MT-Bench with ``turns: 2``, or the user file's stem. MT-Bench ``turns: 2`` holds, per question, the
    first-turn prompt and then the second-turn prompt asked after the target's own answer to the first
    (greedy, ``max_tokens`` new tokens, written by ``engine``: a ``pipelines.data.engines`` engine of the
    target); a question whose first answer the engine could not write keeps its first turn only.
    Prompts longer than ``max_prompt_tokens`` are dropped (with a warning). A ``traffic`` source gives
    its held-out slice (the newest rows of the log, ``pipelines.traffic``) unless its ``split`` says otherwise.

    Raises:
        ValueError: MT-Bench ``turns: 2`` without ``engine``; every error of ``load_conversations``
            (a self_instruct source among them).
    """
    out: dict[str, list[list[int]]] = {}
    for src in sources:
        ds = eval_conversations(src, num_prompts=num_prompts, seed=seed)
        convs = list(ds["messages"])
        if src.kind == "mtbench" and src.turns == 2:
            convs = mtbench_two_turns(ds.to_list(), engine, max_tokens)
        ids = prompt_token_ids(convs, tokenizer)
        if max_prompt_tokens is not None:
            kept = [p for p in ids if len(p) <= max_prompt_tokens]
            if len(kept) < len(ids):
                log.warning("dropped %d eval prompts longer than %d tokens", len(ids) - len(kept), max_prompt_tokens)
            ids = kept
        out[src.eval_set_name()] = ids
    return out


def eval_conversations(src: SourceConfig, *, num_prompts: int, seed: int = 0):
    """The conversations evaluation asks of ``src``: ``num_prompts`` of its held-out rows drawn with ``seed``
    (``pipelines.data.prompts.sample``: the first ``n`` of a larger draw are the ``n`` drawn), as a
    ``datasets.Dataset`` with ``messages`` (and ``id``). :func:`load_eval_prompts` tokenizes them; a caller that
    puts turns before them (``bench.long_context``) takes the messages.

    Raises:
        ValueError: every error of ``pipelines.data.prompts.load_conversations``.
    """
    from pipelines.data.prompts import load_conversations, sample

    return sample(load_conversations(src, seed=seed, heldout=True), num_prompts, seed)


@contextlib.contextmanager
def first_turn_engine(sources: Sequence[SourceConfig], target_path: str | Path, *, dtype: str, max_model_len: int,
                      name: str | None = None) -> Iterator[Any]:
    """A transformers engine of the target while eval prompts load, when an MT-Bench source has ``turns: 2``
    (it answers the first turns, :func:`mtbench_two_turns`); else None. Freed on exit, before vLLM starts."""
    if not any(s.kind == "mtbench" and s.turns == 2 for s in sources):
        yield None
        return
    import torch

    from pipelines.data.engines import make_engine

    engine = make_engine("transformers", target_path, dtype=dtype, max_model_len=max_model_len, name=name)
    try:
        yield engine
    finally:
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def mtbench_two_turns(rows: Sequence[dict], engine, max_tokens: int) -> list[list[dict]]:
    """For MT-Bench first-turn rows (``id = mtbench/<question_id>``): per question the first-turn
    conversation, then ``[user 1, the target's answer, user 2]`` (answer: ``engine``, greedy).

    Raises:
        ValueError: no ``engine``.
    """
    import json

    from pipelines import assets
    from pipelines.data.regenerate import regenerate_conversations
    from pipelines.recipe import RegenerateConfig

    if engine is None:
        raise ValueError("evaluation source mtbench with turns: 2 needs the target's engine to answer turn 1 first: "
                         "pass engine= (pipelines.data.engines.make_engine) to load_eval_prompts, or use turns: 1")
    second = {f"mtbench/{q['question_id']}": q["turns"][1]
              for q in map(json.loads, assets.mtbench_path().read_text().splitlines()) if len(q["turns"]) > 1}
    cfg = RegenerateConfig(temperature=0.0, max_tokens_per_turn=max_tokens, max_turns=1)
    answered = {r["id"]: r["messages"] for r in regenerate_conversations(rows, engine, cfg)}
    convs: list[list[dict]] = []
    for r in rows:
        convs.append(list(r["messages"]))
        if r["id"] in answered and r["id"] in second:
            convs.append(answered[r["id"]] + [{"role": "user", "content": second[r["id"]]}])
        else:
            log.warning("mtbench %s: no first answer from the engine; evaluating its first turn only", r["id"])
    return convs
