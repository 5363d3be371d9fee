"""Self-instruct prompts with a fake engine: pre-query string, filters, exact/near dedup, determinism,
and the self_instruct source in load_prompt_dataset (error without a writer, weighted mix with one)."""

from __future__ import annotations

import json
import zlib
from collections import Counter

import pytest

from pipelines.data import selfinstruct as si
from pipelines.data.engines import Generation
from pipelines.data.prompt_dataset import load_prompt_dataset
from pipelines.data.prompts import load_conversations, source_file
from pipelines.recipe import DataConfig, SelfInstructConfig, SourceConfig, recipe_from_dict

pytestmark = pytest.mark.unit

POOL = [
    "How do I reverse a list in Python without using slicing?",
    "Write a haiku about the first snow of winter in the mountains.",
    "Explain the difference between TCP and UDP for a beginner.",
    "What are three good habits for writing maintainable code?",
    "Summarize the causes of the French Revolution in two paragraphs.",
    "Can you suggest a weekly meal plan for a vegetarian athlete?",
    "hi",  # too short
    "x" * 300,  # too long
    "  How do I reverse a list   in Python without using slicing?  ",  # exact duplicate (whitespace)
    "How do I reverse a list in Python without using slicing? Thanks",  # near duplicate of POOL[0]
]


class FakeEngine:
    """Completes the pre-query with a POOL entry picked by the request seed; records what it saw."""

    name = "fake"

    def __init__(self, tokenizer, unfinished_every: int = 0):
        self.tokenizer, self.calls, self.unfinished_every = tokenizer, [], unfinished_every

    def complete(self, prompts, params, seeds):
        self.calls.append((list(prompts), params, list(seeds)))
        out = []
        for s in seeds:
            if self.unfinished_every and s % self.unfinished_every == 0:
                out.append(Generation("a prompt that never ends " * 3, params.max_tokens, "length"))
            else:
                out.append(Generation(" " + POOL[s % len(POOL)] + " ", 12, "stop"))
        return out


def test_pre_query_is_the_template_up_to_the_user_turn(tiny_chat_tokenizer):
    pq = si.pre_query(tiny_chat_tokenizer)
    assert pq.text == "<|im_start|>user\n" and pq.stop_token_ids == (2,) and pq.stop_text == "<|im_end|>"
    pq = si.pre_query(tiny_chat_tokenizer, "S")
    assert pq.text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\n" and pq.system == "S"


def test_pre_query_needs_a_template_that_keeps_the_user_message(tiny_chat_tokenizer):
    tok = tiny_chat_tokenizer.__class__(tokenizer_object=tiny_chat_tokenizer.backend_tokenizer)
    with pytest.raises(ValueError, match="chat template"):
        si.pre_query(tok)
    tok.chat_template = "{% for m in messages %}<|im_start|>{{ m['role'] }}{% endfor %}"
    with pytest.raises(ValueError, match="dropped the user message"):
        si.pre_query(tok)


def test_filters_and_dedup_count_every_drop():
    gens = [Generation(t, 5, "stop") for t in POOL] + [None, Generation("cut off mid", 64, "length"),
                                                        Generation("   ", 1, "stop"),
                                                        Generation("Tell me a joke<|im_end|>junk", 9, "length")]
    stats = Counter()
    kept = si.filter_prompts(gens, SelfInstructConfig(min_chars=10, max_chars=200), "<|im_end|>", stats)
    assert [i for i, _ in kept] == [0, 1, 2, 3, 4, 5, 13]
    assert kept[-1][1] == "Tell me a joke"  # cut at the end-of-turn text, counted as finished
    assert {k: stats[k] for k in si.COUNT_KEYS} == {
        "generated": 14, "context_full": 1, "unfinished": 1, "empty": 1, "too_short": 1, "too_long": 1,
        "exact_duplicates": 1, "near_duplicates": 1, "kept": 7}


def test_duplicate_removal_reports_progress_for_every_prompt(capsys):
    """The duplicate pass over a large recipe's prompts takes minutes: its progress line counts each prompt."""
    gens = [Generation(t, 5, "stop") for t in POOL]
    seen = []
    assert si.deduplicate([g.text for g in gens], 0.7, advance=seen.append) == si.deduplicate([g.text for g in gens],
                                                                                              0.7)
    assert seen == [1] * len(POOL)
    si.filter_prompts(gens, SelfInstructConfig(seed=3, min_chars=1), "")
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("[self_instruct duplicates (seed 3)]")]
    assert lines and lines[-1].split("]")[1].split()[0] == f"{len(POOL)}/{len(POOL)}"


def test_near_dedup_threshold_and_exact_only():
    a = "please write a short story about a robot who learns to paint with watercolors in paris"
    b = a + " today"
    c = "what is the capital city of australia and why was it chosen over sydney and melbourne"
    stats = Counter()
    assert si.deduplicate([a, b, c, a.upper()], 0.7, stats) == [0, 2]  # lower-cased shingles: a.upper() is near
    assert stats == {"near_duplicates": 2}
    stats = Counter()
    assert si.deduplicate([a, b, " ".join(a.split()) + "  ", c], None, stats) == [0, 1, 3]
    assert stats == {"exact_duplicates": 1}
    assert si.deduplicate([a, b], 0.98) == [0, 1]  # 15 of 16 shared 3-grams: similar, not near at 0.98
    with pytest.raises(ValueError, match="less than or equal to 0.98"):
        SelfInstructConfig(dedup_threshold=0.99)


def test_generate_prompts_rows_counts_and_batches(tiny_chat_tokenizer):
    eng = FakeEngine(tiny_chat_tokenizer, unfinished_every=7)
    cfg = SelfInstructConfig(num_prompts=40, seed=5, temperature=0.9, top_p=0.95, max_tokens=64, min_chars=10,
                             max_chars=200, system_prompt="S")
    stats = Counter()
    rows = si.generate_prompts(eng, cfg, batch_size=16, stats=stats)
    assert [len(c[0]) for c in eng.calls] == [16, 16, 8]
    prompts, params, _ = eng.calls[0]
    assert set(prompts) == {"<|im_start|>system\nS<|im_end|>\n<|im_start|>user\n"}
    assert (params.temperature, params.top_p, params.max_tokens, params.stop_token_ids) == (0.9, 0.95, 64, (2,))
    seeds = [s for c in eng.calls for s in c[2]]
    assert seeds == [zlib.crc32(f"5|self_instruct|{i}".encode()) & 0x7FFFFFFF for i in range(40)]
    texts = [r["messages"][-1]["content"] for r in rows]
    assert len(texts) == len({" ".join(t.split()) for t in texts}) == stats["kept"] <= 6
    assert stats["generated"] == 40 and sum(stats[k] for k in si.COUNT_KEYS[1:]) == 40
    assert all(r["messages"][0] == {"role": "system", "content": "S"} and r["source"] == "self_instruct"
               for r in rows)
    assert all(r["id"].startswith("self_instruct/5/") for r in rows)


def test_same_seed_same_prompts_other_seed_other_prompts(tiny_chat_tokenizer):
    def run(seed):
        return si.generate_prompts(FakeEngine(tiny_chat_tokenizer), SelfInstructConfig(num_prompts=12, seed=seed,
                                   dedup_threshold=None), batch_size=5)
    assert run(1) == run(1)
    assert [r["id"] for r in run(1)] != [r["id"] for r in run(2)]


def test_self_instruct_source_needs_an_engine(tmp_peagle_home):
    data = DataConfig(sources=[SourceConfig(kind="self_instruct")])
    assert data.sources[0].self_instruct == SelfInstructConfig()
    with pytest.raises(ValueError, match="SelfInstructWriter"):
        load_prompt_dataset(data)
    with pytest.raises(ValueError, match="need an engine"):
        load_conversations(data.sources[0])
    with pytest.raises(ValueError, match="no file"):
        source_file(data.sources[0])


def test_self_instruct_config_validation():
    with pytest.raises(ValueError, match="min_chars"):
        SelfInstructConfig(min_chars=50, max_chars=10)
    with pytest.raises(ValueError, match="greater than 0"):
        SelfInstructConfig(temperature=0.0)
    with pytest.raises(ValueError, match="belong to kind self_instruct"):
        SourceConfig(kind="sharegpt", self_instruct=SelfInstructConfig())
    with pytest.raises(ValueError, match="is written by the target"):
        SourceConfig(kind="self_instruct", path="x.jsonl")
    base = {"name": "r", "data": {"sources": [{"kind": "self_instruct"}]}}
    with pytest.raises(ValueError, match="regenerate.enabled is false"):
        recipe_from_dict({**base, "regenerate": {"enabled": False}})
    with pytest.raises(ValueError, match="evaluate on fixed sets"):
        recipe_from_dict({"name": "r", "evaluation": {"sources": [{"kind": "self_instruct"}]}})
    r = recipe_from_dict({"name": "r", "data": {"sources": [{"kind": "self_instruct", "self_instruct": {
        "num_prompts": 64, "seed": 3}}]}})
    assert r.data.sources[0].self_instruct.num_prompts == 64


def test_writer_rows_mix_with_file_sources_by_weight(tmp_path, tmp_peagle_home, tiny_chat_tokenizer):
    f = tmp_path / "chats.jsonl"
    f.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"q{i}"}], "id": f"f{i}"}) + "\n"
                         for i in range(30)))
    calls = []

    def writer(src):
        calls.append(src)
        return si.generate_prompts(FakeEngine(tiny_chat_tokenizer), src.self_instruct, batch_size=8)

    data = DataConfig(sources=[SourceConfig(kind="openai_jsonl", path=str(f), weight=2.0),
                               SourceConfig(kind="self_instruct", weight=1.0,
                                            self_instruct=SelfInstructConfig(num_prompts=30, min_chars=10))],
                      num_samples=9, seed=4)
    ds = load_prompt_dataset(data, write_prompts=writer)
    assert len(calls) == 1 and len(ds) == 9
    assert Counter(ds["source"]) == {"openai_jsonl:chats.jsonl": 6, "self_instruct": 3}
    assert ds["id"] == load_prompt_dataset(data, write_prompts=writer)["id"]


def test_assets_lists_the_scale_recipe_self_instruct_source_without_a_file(monkeypatch, tmp_peagle_home):
    # `peagle assets` (prompts on) on the scale recipe: the self_instruct source has no file to load
    from pipelines.cli.recipes import _sources
    from pipelines.data import prompts
    from pipelines.recipe import load_recipe
    from tests.conftest import CONFIGS

    loaded = []
    monkeypatch.setattr(prompts, "load_conversations", lambda s, *a, **k: loaded.append(s.kind) or [{}] * 3)
    rows = _sources(load_recipe(CONFIGS / "smollm2-135m-scale.yaml"), tmp_peagle_home, as_json=True)
    assert [(r["section"], r["kind"]) for r in rows] == [
        ("data", "sharegpt"), ("data", "self_instruct"), ("evaluation", "humaneval"), ("evaluation", "mtbench")]
    assert loaded == ["sharegpt", "humaneval", "mtbench"]
    si_row = rows[1]
    assert si_row["path"] is None and si_row["num_conversations"] is None and si_row["num_prompts"] == 30000
    assert rows[0]["num_conversations"] == 3 and rows[0]["path"].endswith(".json")


def test_turns_pack_kept_prompts_into_conversations_the_regenerate_stage_answers(tiny_chat_tokenizer):
    """``turns: 3``: consecutive kept prompts make conversations of 3 user turns (the last shorter), rows of the
    prompt schema whose placeholder answers the regenerate stage replaces turn by turn on the growing history."""
    from pipelines.data import regenerate
    from pipelines.data.rows import normalize_row
    from pipelines.recipe import RegenerateConfig
    from tests.unit.test_capture_regenerate import EchoEngine

    one = si.generate_prompts(FakeEngine(tiny_chat_tokenizer), SelfInstructConfig(num_prompts=12, seed=1,
                              dedup_threshold=None), batch_size=5)
    packed = si.generate_prompts(FakeEngine(tiny_chat_tokenizer), SelfInstructConfig(
        num_prompts=12, seed=1, dedup_threshold=None, turns=3, system_prompt="S"), batch_size=5)
    users = [[m["content"] for m in r["messages"] if m["role"] == "user"] for r in packed]
    assert [u for us in users for u in us] == [r["messages"][-1]["content"] for r in one]  # same prompts, in order
    assert [len(u) for u in users] == [3] * (len(one) // 3) + ([len(one) % 3] if len(one) % 3 else [])
    assert packed[0]["id"] == one[0]["id"] + "+3" and packed[0]["messages"][0] == {"role": "system", "content": "S"}
    assert all(normalize_row(r, i, "openai_jsonl") for i, r in enumerate(packed))  # alternating roles, no empty turn
    out = regenerate.regenerate_conversations(packed[:1], EchoEngine(), RegenerateConfig(max_turns=3))
    answers = [m["content"] for m in out[0]["messages"] if m["role"] == "assistant"]
    assert answers == [f"re:{u}/{n}" for n, u in enumerate(users[0])]  # each turn after the answers before it
    assert si.ANSWER_PLACEHOLDER not in str(out[0]["messages"])
    assert SelfInstructConfig(turns=3).turns == 3
    with pytest.raises(ValueError):
        SelfInstructConfig(turns=0)
