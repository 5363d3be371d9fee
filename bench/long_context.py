"""Acceptance length against the position in the sequence (issue 26 item 4): the same final questions asked after
chat histories of growing length, each head measured in real vLLM through the evaluate stage's function.

    python -m bench.long_context --keep outputs/keep99 \\
        --head peagle-99k-600s=outputs/scale-heads/head-peagle-99k-600s-step800 \\
        --head peagle-29k-k4-180s=outputs/scale-heads/head-peagle-29k-k4-180s \\
        --lengths 0,1024,2048,4096,7168 --k 5 --num-prompts 4 --max-tokens 96 --name long_context

Prompts: for every history length L (``--lengths``, tokens) the same ``--num-prompts`` final questions, the first
ones evaluation asks of ``--questions`` (``pipelines.evaluate.prompts.eval_conversations``, seed 0), each after a
chat history that adds >= L tokens to its prompt (L = 0: the bare question, the prompt evaluation uses). A history
is whole earlier conversations (user turns and the target's own answers) of data build ``--build`` under
``--keep`` (``bench.scale.regenerated``), taken only from the set's held-out tail: the conversations after the
largest prefix any training run of that build used (``bench/results/scale_train.json``; ``bench.scale_train``
trains on the first ``size`` conversations). Each question draws its own conversations, the nearest one first, so
a longer history adds older conversations in front of a shorter one's; conversations that alone add more than
``--max-conversation-tokens`` are skipped (a history overshoots L by less than that). Prompts are the target's
chat template over history + final user turn + generation prompt (``pipelines.evaluate.prompts.prompt_token_ids``).

Measurement: ``bench.eval_gpu_heads.run_set`` per L (eval set ``<questions>-ctx<L>``), one fresh engine per head,
greedy, c=1, vLLM's spec-decode counters (AL, acceptance per position); the engine's ``max_model_len`` is the
target's context (``max_position_embeddings``) unless ``--max-model-len`` says otherwise, and every prompt plus
``--max-tokens`` must fit it. ``--none`` adds no speculation per L (tokens/s and speed-up; off by default: on the
CPU the prefill of long prompts dominates the wall time). The result file ``bench/results/<name>.json`` is
rewritten after each head and a rerun skips the (L, head, K) rows it holds (``bench.eval_gpu_heads.Eval``); it
records per set the history lengths and conversation ids, and per head its training cut
(``data.max_length_tokens`` of the head's ``recipe.yaml``). Report: :mod:`bench.report_long_context`.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.common import RESULTS, keep_dir
from bench.eval_gpu_heads import ENGINES, Eval, run_set
from bench.scale import RECIPE, regenerated
from bench.scale_train import RESULT as TRAIN_RESULT
from pipelines.evaluate.prompts import prompt_token_ids

HEAD_RECIPE = "recipe.yaml"  # the resolved recipe an exported head carries (bench.harness, pipelines.train.driver)
HISTORY_ROLES = ("user", "assistant")


def set_name(questions: str, context_tokens: int) -> str:
    """The eval set of ``questions`` after a history of >= ``context_tokens`` tokens, e.g. ``humaneval-ctx2048``."""
    return f"{questions}-ctx{context_tokens}"


def held_out_start(train_rows: Sequence[dict], build: int) -> int:
    """Index of the first conversation of data build ``build`` that no training run used: runs train on a prefix
    (``bench.scale_train``: the first ``size`` conversations), so the largest ``size`` among ``train_rows``
    (``scale_train.json`` rows) of that ``data_build``.

    Raises:
        ValueError: no row of that build.
    """
    sizes = [r["size"] for r in train_rows if r.get("data_build") == build]
    if not sizes:
        raise ValueError(f"no training run of data build {build} in bench/results/{TRAIN_RESULT}.json: the held-out "
                         "tail is unknown; give the --build its heads were trained on")
    return max(sizes)


def held_out_pool(keep: Path, build: int) -> tuple[list[dict], int]:
    """``(conversations, start)``: data build ``build``'s regenerated conversations under ``keep``
    (``bench.scale.regenerated``) from :func:`held_out_start` on.

    Raises:
        ValueError: the set under ``keep`` does not have build ``build``'s conversation count
            (``scale_regenerate.json``'s ``lengths``), or nothing is held out.
    """
    train_rows = json.loads((RESULTS / f"{TRAIN_RESULT}.json").read_text())["rows"]
    start = held_out_start(train_rows, build)
    rows = regenerated(keep)
    lengths = json.loads((RESULTS / "scale_regenerate.json").read_text()).get("lengths", {}).get(str(build))
    if lengths is not None and lengths["conversations"] != len(rows):
        raise ValueError(f"{keep}/regen holds {len(rows)} conversations, data build {build} has "
                         f"{lengths['conversations']}: point --keep at that build's set (bench.scale unpack-data)")
    if len(rows) <= start:
        raise ValueError(f"{keep}/regen holds {len(rows)} conversations, all of them used by training (the first "
                         f"{start} of build {build})")
    return rows[start:], start


def _is_history(row: dict) -> bool:
    """A whole conversation that can stand before another user turn: user and assistant turns only, from a user
    turn to an answer."""
    msgs = row["messages"]
    return (bool(msgs) and all(m["role"] in HISTORY_ROLES for m in msgs) and msgs[0]["role"] == "user"
            and msgs[-1]["role"] == "assistant")


@dataclass(kw_only=True)
class ContextPrompts:
    """The prompts of one history length: per final question, its prompt and its history."""

    context_tokens: int             # L: each history adds >= L tokens to its question's prompt (0: none)
    prompts: list[list[int]]        # token ids: history + final user turn + generation prompt
    history_tokens: list[int]       # tokens each history adds to its prompt (>= L)
    history_ids: list[list[str]]    # ids of each history's conversations, oldest first

    def record(self) -> dict:
        """What the result file keeps of the set (not the token ids)."""
        lens = [len(p) for p in self.prompts]
        return {"context_tokens": self.context_tokens, "num_prompts": len(self.prompts),
                "prompt_tokens_mean": statistics.fmean(lens), "prompt_tokens_max": max(lens),
                "history_tokens_mean": statistics.fmean(self.history_tokens),
                "history_tokens_min": min(self.history_tokens),
                "history_conversations_mean": statistics.fmean(len(h) for h in self.history_ids),
                "history_ids": self.history_ids}


def history_prompts(questions: Sequence[Sequence[dict]], pool: Sequence[dict], tokenizer, lengths: Sequence[int], *,
                    max_conversation_tokens: int) -> list[ContextPrompts]:
    """Per history length L of ``lengths``, every question of ``questions`` after a history of >= L tokens.

    Args:
        questions: conversations ending in the final user turn (a trailing reference answer is dropped),
            e.g. ``eval_conversations(...)["messages"]``.
        pool: held-out conversations (``{"id", "messages"}``) in the order they are drawn; each question takes
            the next ones not taken before (``_is_history`` rows only), so no two histories share one.
        tokenizer: the target's (its chat template): prompts are ``prompt_token_ids`` of history + question.
        lengths: L per set, tokens (>= 0).
        max_conversation_tokens: a conversation that alone adds more tokens than this is skipped.

    Returns:
        One :class:`ContextPrompts` per L, in the order of ``lengths``; a question's history at L is the nearest
        conversations of its history at any larger L (L = 0: the bare question).

    Raises:
        ValueError: a negative L, or the pool runs out of conversations.
    """
    if any(L < 0 for L in lengths):
        raise ValueError(f"--lengths {list(lengths)}: history lengths are tokens >= 0")
    bare = prompt_token_ids(questions, tokenizer)
    draw: Iterator[dict] = (r for r in pool if _is_history(r))

    def prompt(near: Sequence[dict], question: Sequence[dict]) -> list[int]:  # near: nearest conversation first
        return prompt_token_ids([[m for c in reversed(near) for m in c["messages"]] + list(question)], tokenizer)[0]

    streams = []  # per question: its conversations (nearest first), tokens the first m of them add (m = 0, 1, ...)
    for question, b in zip(questions, bare, strict=True):
        near: list[dict] = []
        added = [0]
        while added[-1] < max(lengths, default=0):
            c = next(draw, None)
            if c is None:
                raise ValueError(f"the held-out pool ({len(pool)} conversations) ran out at question "
                                 f"{len(streams) + 1} of {len(questions)}: use fewer --num-prompts, shorter "
                                 "--lengths or a larger --max-conversation-tokens")
            if len(prompt([c], question)) - len(b) > max_conversation_tokens:
                continue
            near.append(c)
            added.append(len(prompt(near, question)) - len(b))
        streams.append((near, added))
    out = []
    for L in lengths:
        ms = [next(m for m, t in enumerate(added) if t >= L) for _, added in streams]
        prompts = [prompt(near[:m], q) for (near, _), m, q in zip(streams, ms, questions, strict=True)]
        out.append(ContextPrompts(context_tokens=L, prompts=prompts,
                                  history_tokens=[added[m] for (_, added), m in zip(streams, ms, strict=True)],
                                  history_ids=[[str(c["id"]) for c in reversed(near[:m])]
                                               for (near, _), m in zip(streams, ms, strict=True)]))
    return out


def trained_facts(head_dir: str) -> dict:
    """What a head's files say of its training data: ``train_max_length_tokens`` (``data.max_length_tokens`` of its
    ``recipe.yaml``; None without one) and ``trained_conversations`` (``config.json``'s ``peagle.conversations``)."""
    from peagle_core.contract import CONFIG_FILE
    from pipelines.recipe import load_recipe

    d = Path(head_dir)
    cut = load_recipe(d / HEAD_RECIPE).data.max_length_tokens if (d / HEAD_RECIPE).exists() else None
    cfg = json.loads((d / CONFIG_FILE).read_text())
    return {"train_max_length_tokens": cut, "trained_conversations": (cfg.get("peagle") or {}).get("conversations")}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head", action="append", default=[], metavar="TAG[#RUN]=DIR", help="as bench.eval_gpu_heads")
    ap.add_argument("--keep", required=True, help="the dir whose regen/ holds the data build's chunks "
                    "(bench.scale --keep)")
    ap.add_argument("--build", type=int, default=3, help="the data build under --keep (scale_train.json data_build)")
    ap.add_argument("--lengths", default="0,1024,2048,4096,7168", help="history lengths L, tokens")
    ap.add_argument("--questions", default="humaneval", help="eval source kind of the final questions")
    ap.add_argument("--k", type=int, default=5, help="num_speculative_tokens of every head")
    ap.add_argument("--num-prompts", type=int, default=4, help="final questions per L")
    ap.add_argument("--max-tokens", type=int, default=96, help="new tokens per prompt")
    ap.add_argument("--max-conversation-tokens", type=int, default=1024,
                    help="skip history conversations that alone add more tokens")
    ap.add_argument("--max-model-len", type=int, default=None, help="the engine's context, tokens (default: the "
                    "target's max_position_embeddings)")
    ap.add_argument("--none", action="store_true", help="also no speculation per L (tokens/s, speed-up)")
    ap.add_argument("--engine", choices=sorted(ENGINES), default="cpu", help="as bench.eval_gpu_heads")
    ap.add_argument("--name", default="long_context", help="result file bench/results/<name>.json")
    ap.add_argument("--results-dir", default=str(RESULTS), help="where <name>.json is read and written")
    ap.add_argument("--out", default="outputs/long-context", help="eval tables and plots per (set, head)")
    ap.add_argument("--new-session", action="store_true", help="as bench.eval_gpu_heads")
    ap.set_defaults(step_costs=False, per_session=False)  # read by bench.eval_gpu_heads (run_set, Eval.open)
    return ap


def main() -> None:
    from transformers import AutoConfig, AutoTokenizer

    from pipelines.assets import ensure_target
    from pipelines.evaluate.measure import CPU_ENGINE_KWARGS
    from pipelines.evaluate.prompts import eval_conversations
    from pipelines.recipe import SourceConfig, load_recipe

    args = _parser().parse_args()
    if not args.head:
        raise SystemExit("give at least one --head TAG[#RUN]=DIR")
    lengths = [int(x) for x in args.lengths.split(",")]
    ev = Eval.open(args)  # checks every head's method before any engine starts
    ev.baseline = args.none
    ev.head_facts = {h: trained_facts(d) for h, d in ev.heads.items()}
    target = ensure_target(load_recipe(RECIPE).target.model, ENGINES[args.engine][0]).path
    tok = AutoTokenizer.from_pretrained(target)
    questions = list(eval_conversations(SourceConfig(kind=args.questions), num_prompts=args.num_prompts,
                                        seed=0)["messages"])
    pool, start = held_out_pool(keep_dir(args.keep), args.build)
    sets = history_prompts(questions, pool, tok, lengths, max_conversation_tokens=args.max_conversation_tokens)
    max_model_len = args.max_model_len or AutoConfig.from_pretrained(target).max_position_embeddings
    longest = max(len(p) for s in sets for p in s.prompts)
    if longest + args.max_tokens > max_model_len:
        raise SystemExit(f"a prompt of {longest} tokens + --max-tokens {args.max_tokens} > max_model_len "
                         f"{max_model_len}: lower --lengths or --max-conversation-tokens")
    engine_kwargs = dict(ENGINES[args.engine][1] or CPU_ENGINE_KWARGS) | {"max_model_len": max_model_len}
    command = "python -m bench.long_context " + shlex.join(sys.argv[1:])
    ev.notes |= {"benchmark": "long_context", "questions": args.questions, "K": args.k,
                 "commands": list(dict.fromkeys([*ev.notes.get("commands", []), command])),
                 "engine_kwargs": engine_kwargs,
                 "held_out": {"build": args.build, "first": start, "conversations": len(pool),
                              "max_conversation_tokens": args.max_conversation_tokens}}
    ev.notes.setdefault("sets", {})
    for s in sets:
        name = set_name(args.questions, s.context_tokens)
        if ev.notes["sets"].get(name, s.record()) != s.record() and any(r["eval_set"] == name for r in ev.rows):
            raise SystemExit(f"{ev.path}: its rows of {name} were measured on other prompts (another --num-prompts, "
                             "--keep or --max-conversation-tokens): use another --name")
        ev.notes["sets"][name] = s.record()
        print(json.dumps({"eval_set": name} | {k: v for k, v in s.record().items() if k != "history_ids"}), flush=True)
        run_set(ev, target, name, [1], s.prompts, [args.k], {}, source_kind=args.questions,
                engine_kwargs=engine_kwargs)
    ev.save(args.num_prompts)


if __name__ == "__main__":
    main()
