"""bench.long_context's prompts: histories of >= L tokens from the held-out tail only, the same final question at
every L, the bare question at L = 0 (a stub chat template, no target, no engine)."""

from __future__ import annotations

import pytest

from bench.long_context import held_out_start, history_prompts
from pipelines.evaluate.prompts import prompt_token_ids

pytestmark = pytest.mark.unit

SYSTEM, GEN = 0, 9  # the stub template's leading system token and generation prompt


class Tok:
    """A chat template of one token per word (its length), a role token and an end token per message, behind a
    system token (as SmolLM2's default system turn)."""

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        assert add_generation_prompt and tokenize
        ids = [SYSTEM]
        for m in messages:
            ids += [{"user": 1, "assistant": 2}[m["role"]], *(len(w) for w in m["content"].split()), 3]
        return ids + [GEN]


def conv(i: int, words: int, roles=("user", "assistant")) -> dict:
    return {"id": f"c{i}", "messages": [{"role": r, "content": " ".join(["w"] * words)} for r in roles]}


TRAINED = 10  # the largest prefix a training run of build 3 used
ROWS = [conv(i, 20 + 7 * (i % 5)) for i in range(80)]
ROWS[12] = conv(12, 400)                            # alone over max_conversation_tokens: skipped
ROWS[14] = conv(14, 20, roles=("user",))            # no answer: not a history
QUESTIONS = [[{"role": "user", "content": "def f(x): return"}],
             [{"role": "user", "content": "def g(y): pass"}, {"role": "assistant", "content": "reference answer"}]]
LENGTHS = [0, 100, 250]


def test_held_out_start_is_the_largest_prefix_of_the_build():
    rows = [{"size": 6, "data_build": 3}, {"size": TRAINED, "data_build": 3}, {"size": 50, "data_build": 2}]
    assert held_out_start(rows, 3) == TRAINED
    with pytest.raises(ValueError, match="no training run of data build 4"):
        held_out_start(rows, 4)


def test_histories_reach_L_from_the_held_out_tail_before_the_same_question():
    tok = Tok()
    pool = ROWS[held_out_start([{"size": TRAINED, "data_build": 3}], 3):]
    sets = history_prompts(QUESTIONS, pool, tok, LENGTHS, max_conversation_tokens=100)
    bare = prompt_token_ids(QUESTIONS, tok)
    assert [s.context_tokens for s in sets] == LENGTHS
    assert sets[0].prompts == bare and sets[0].history_ids == [[], []]  # L = 0: the prompt evaluation asks
    used = set()
    for s in sets[1:]:
        for p, b, added, ids in zip(s.prompts, bare, s.history_tokens, s.history_ids, strict=True):
            assert added >= s.context_tokens and len(p) - len(b) == added
            assert p[:1] == [SYSTEM] and p[-(len(b) - 1):] == b[1:]  # history, then the same final question
            assert all(int(i[1:]) >= TRAINED for i in ids) and not {"c12", "c14"} & set(ids)
            used |= set(ids)
    short, long_ = sets[1].history_ids, sets[2].history_ids
    assert all(lg[len(lg) - len(sh):] == sh for sh, lg in zip(short, long_, strict=True))  # older ones in front
    assert not set(long_[0]) & set(long_[1])  # each question its own conversations


def test_a_pool_too_small_says_so():
    with pytest.raises(ValueError, match="held-out pool .* ran out"):
        history_prompts(QUESTIONS, ROWS[70:], Tok(), [0, 1000], max_conversation_tokens=100)
    with pytest.raises(ValueError, match="tokens >= 0"):
        history_prompts(QUESTIONS, ROWS, Tok(), [-1], max_conversation_tokens=100)
