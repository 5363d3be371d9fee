"""Prompt normalization on hand-written rows; loading user files through datasets; sampling/split; weighted
mixing; MT-Bench eval prompts."""

from __future__ import annotations

import json
import logging
from collections import Counter

import pytest

from pipelines.data.jsonl import json_array_to_jsonl
from pipelines.data.prompt_dataset import load_prompt_dataset, weighted_quotas
from pipelines.data.prompts import flat, load_conversations, sample, train_eval_split
from pipelines.data.rows import BadRow, normalize_row
from pipelines.recipe import DataConfig, SourceConfig

pytestmark = pytest.mark.unit


def sg(*turns, id="c1"):
    return {"id": id, "conversations": [{"from": f, "value": v} for f, v in turns]}


def oa(*turns, **extra):
    return {"messages": [{"role": r, "content": c} for r, c in turns], **extra}


def test_sharegpt_roles_are_mapped():
    out = normalize_row(sg(("system", "be brief"), ("human", "hi"), ("gpt", "hello"), ("human", "more")), 3, "sharegpt")
    assert out == {
        "id": "c1",
        "source": "sharegpt",
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "more"},
        ],
    }
    assert normalize_row(sg(("user", "a"), ("chatgpt", "b")), 0, "sharegpt")["messages"][1]["role"] == "assistant"


def test_openai_row_from_json_string_and_default_id():
    line = json.dumps(oa(("user", "q"), ("assistant", "a")))
    out = normalize_row(line, 7, "openai_jsonl:f.jsonl")
    assert out["id"] == "openai_jsonl:f.jsonl-7"
    assert [m["role"] for m in out["messages"]] == ["user", "assistant"]
    assert normalize_row(oa(("user", "q"), id=5), 0, "openai_jsonl")["id"] == "5"


def test_humaneval_prompt_becomes_user_turn():
    out = normalize_row({"task_id": "HumanEval/0", "prompt": "def f():\n", "canonical_solution": "x"}, 0, "humaneval")
    assert out == {"id": "HumanEval/0", "source": "humaneval", "messages": [{"role": "user", "content": "def f():\n"}]}


@pytest.mark.parametrize(
    "row,source,reason",
    [
        ({"id": "x", "conversations": [{"value": "hi"}]}, "sharegpt", "missing role"),
        (oa(("user", "q"), ("assistant", "   ")), "openai_jsonl", "empty turn"),
        ({"messages": [{"role": "user", "content": ["a", "b"]}]}, "openai_jsonl", "non-string content"),
        ({"messages": [{"role": "user", "content": None}]}, "openai_jsonl", "non-string content"),
        (oa(("assistant", "a"), ("user", "q")), "openai_jsonl", "wrong role order"),
        (oa(("user", "a"), ("user", "q")), "openai_jsonl", "wrong role order"),
        (oa(("user", "a"), ("system", "s")), "openai_jsonl", "wrong role order"),
        (oa(("system", "s")), "openai_jsonl", "no turns"),
        ({"messages": []}, "openai_jsonl", "no turns"),
        (oa(("narrator", "x")), "openai_jsonl", "unknown role"),
        ({"conversation": []}, "sharegpt", "missing conversations"),
        ({"turns": []}, "openai_jsonl", "missing messages"),
        ("{not json", "openai_jsonl", "not JSON"),
        ("[1, 2]", "openai_jsonl", "not an object"),
        ({"task_id": "HumanEval/1", "prompt": ""}, "humaneval", "empty turn"),
    ],
)
def test_bad_rows_raise_with_index(row, source, reason):
    with pytest.raises(BadRow) as e:
        normalize_row(row, 41, source)
    assert e.value.reason == reason
    assert "row 41" in str(e.value)


def _write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


ROWS = [
    oa(("user", "q0"), ("assistant", "a0")),  # 0 good
    oa(("assistant", "a"), ("user", "q")),  # 1 wrong order
    oa(("system", "s"), ("user", "q2")),  # 2 good
    "",  # 3 blank line: not a row
    {"messages": [{"role": "user", "content": 3}]},  # 4 non-string content
    oa(("user", "q5")),  # 5 good
]


def test_load_openai_jsonl_skip_counts_and_logs(tmp_path, tmp_peagle_home, caplog):
    f = _write_jsonl(tmp_path / "chats.jsonl", ROWS)
    with caplog.at_level(logging.WARNING, logger="pipelines.data.prompts"):
        ds = load_conversations(SourceConfig(kind="openai_jsonl", path=str(f)), "skip", tmp_peagle_home)
    assert ds.column_names == ["id", "messages", "source"]
    assert ds["id"] == ["openai_jsonl:chats.jsonl-0", "openai_jsonl:chats.jsonl-2", "openai_jsonl:chats.jsonl-5"]
    assert ds[1]["messages"] == [{"role": "system", "content": "s"}, {"role": "user", "content": "q2"}]
    text = caplog.text
    assert "skipped 2 malformed row(s)" in text and "row 1:" in text and "row 4:" in text
    assert "wrong role order: 1" in text and "non-string content: 1" in text


def test_load_openai_jsonl_fail_raises_with_index(tmp_path, tmp_peagle_home):
    f = _write_jsonl(tmp_path / "chats.jsonl", ROWS)
    with pytest.raises(ValueError, match=r"2 malformed row\(s\)[\s\S]*row 1: wrong role order[\s\S]*row 4:"):
        load_conversations(SourceConfig(kind="openai_jsonl", path=str(f)), "fail", tmp_peagle_home)


def test_load_sharegpt_json_array_and_truncated_file(tmp_path, tmp_peagle_home, caplog):
    rows = [sg(("human", "h0"), ("gpt", "g0"), id="a"), sg(("gpt", "g"), id="b"), sg(("human", "h2"), id="c")]
    full = tmp_path / "sg.json"
    full.write_text(json.dumps(rows, indent=1))
    ds = load_conversations(SourceConfig(kind="sharegpt_file", path=str(full)), "skip", tmp_peagle_home)
    assert ds["id"] == ["a", "c"]
    cut = tmp_path / "cut.json"
    cut.write_text(full.read_text()[:-30])
    with caplog.at_level(logging.WARNING, logger="pipelines.data.jsonl"):
        ds = load_conversations(SourceConfig(kind="sharegpt_file", path=str(cut)), "skip", tmp_peagle_home)
    assert ds["id"] == ["a"]
    assert "cut off" in caplog.text


def test_the_packaged_sharegpt_files_cut_is_information_not_a_warning(tmp_path, tmp_peagle_home, caplog,
                                                                      monkeypatch):
    from pipelines import assets

    rows = [sg(("human", "h0"), ("gpt", "g0"), id="a"), sg(("human", "h1"), ("gpt", "g1"), id="b")]
    cut = tmp_path / "ShareGPT_V3_unfiltered_cleaned_split.json"
    cut.write_text(json.dumps(rows, indent=1)[:-30])
    monkeypatch.setattr(assets, "sharegpt_path", lambda: cut)
    with caplog.at_level(logging.INFO, logger="pipelines.data.jsonl"):
        ds = load_conversations(SourceConfig(kind="sharegpt"), "skip", tmp_peagle_home)
    assert ds["id"] == ["a"]
    assert [r.levelno for r in caplog.records if "cut off" in r.getMessage()] == [logging.INFO]
    caplog.clear()
    load_conversations(SourceConfig(kind="sharegpt"), "skip", tmp_peagle_home)  # said once: the cache is reused
    assert not [r for r in caplog.records if "cut off" in r.getMessage()]


def test_json_array_to_jsonl_rejects_non_array(tmp_path):
    f = tmp_path / "x.json"
    f.write_text('{"a": 1}')
    with pytest.raises(ValueError, match="not a JSON array"):
        json_array_to_jsonl(f, tmp_path / "out.jsonl")


def test_missing_file_and_all_bad(tmp_path, tmp_peagle_home):
    with pytest.raises(ValueError, match="is not a file"):
        load_conversations(SourceConfig(kind="openai_jsonl", path=str(tmp_path / "nope.jsonl")), "skip")
    f = _write_jsonl(tmp_path / "bad.jsonl", [oa(("assistant", "a"))])
    with pytest.raises(ValueError, match="no usable conversations"):
        load_conversations(SourceConfig(kind="openai_jsonl", path=str(f)), "skip", tmp_peagle_home)


def test_sampling_and_split_are_deterministic(tmp_path, tmp_peagle_home):
    f = _write_jsonl(tmp_path / "many.jsonl", [oa(("user", f"q{i}"), id=f"r{i}") for i in range(40)])
    src = SourceConfig(kind="openai_jsonl", path=str(f), num_samples=10)
    a = load_conversations(src, "fail", tmp_peagle_home, seed=3)
    b = load_conversations(src, "fail", tmp_peagle_home, seed=3)
    c = load_conversations(src, "fail", tmp_peagle_home, seed=4)
    assert a["id"] == b["id"] and len(a) == 10 and a["id"] != c["id"]
    assert len(sample(a, 99, 0)) == 10  # more than available: all, with a warning
    tr, ev = train_eval_split(a, 0.2, seed=1)
    _tr2, ev2 = train_eval_split(a, 0.2, seed=1)
    assert (len(tr), len(ev)) == (8, 2) and ev["id"] == ev2["id"] and not set(tr["id"]) & set(ev["id"])
    tr0, ev0 = train_eval_split(a, 0.0, seed=1)
    assert len(tr0) == 10 and len(ev0) == 0
    with pytest.raises(ValueError, match="eval_fraction"):
        train_eval_split(a, 1.0, seed=1)


def test_flat_takes_the_selected_rows_as_datasets_would():
    import datasets

    ds = datasets.Dataset.from_list([oa(("system", "s"), ("user", f"q{i}"), ("assistant", "a" * i), id=f"r{i}")
                                     | {"source": "x"} for i in range(30)])
    picked = ds.shuffle(seed=5).select(range(7, 25))
    out = flat(picked)
    assert out.to_list() == picked.flatten_indices().to_list() and out.features == ds.features
    assert out._indices is None and out.format["type"] is None  # its own table, rows read as Python objects


def test_filter_regex_keeps_matching_first_user_turns(tmp_path, tmp_peagle_home):
    rows = [oa(("system", "def is here"), ("user", "write a python def"), id="code"),
            oa(("user", "a poem"), ("assistant", "def"), ("user", "python please"), id="poem"),
            oa(("user", "Python sorting?"), id="caps")]
    f = _write_jsonl(tmp_path / "mix.jsonl", rows)
    ds = load_conversations(SourceConfig(kind="openai_jsonl", path=str(f), filter_regex=r"(?i)\bpython\b"),
                            "skip", tmp_peagle_home)
    assert ds["id"] == ["code", "caps"]  # only the FIRST user turn counts, system turns never
    with pytest.raises(ValueError, match="matches no conversation"):
        load_conversations(SourceConfig(kind="openai_jsonl", path=str(f), filter_regex="rust"), "skip",
                           tmp_peagle_home)


def test_filter_regex_must_compile():
    with pytest.raises(ValueError, match="not a valid regular expression"):
        SourceConfig(kind="sharegpt", filter_regex="(unclosed")


# ---------------------------------------------------------------------------------------------- issue 14


def test_sharegpt_leading_assistant_turns_are_dropped_not_the_row():
    out = normalize_row(sg(("gpt", "tail of a split"), ("human", "next question"), ("gpt", "answer")), 0, "sharegpt")
    assert [m["content"] for m in out["messages"]] == ["next question", "answer"]
    out = normalize_row(sg(("system", "s"), ("gpt", "a"), ("bard", "b"), ("human", "q")), 0, "sharegpt_file:x.json")
    assert out["messages"] == [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]
    with pytest.raises(BadRow) as e:
        normalize_row(sg(("gpt", "a"), ("gpt", "b")), 9, "sharegpt")
    assert e.value.reason == "no user turn" and "row 9" in str(e.value)
    with pytest.raises(BadRow) as e:  # later order errors still fail, with the turn index of the row as given
        normalize_row(sg(("gpt", "a"), ("human", "q"), ("human", "q2")), 2, "sharegpt")
    assert e.value.reason == "wrong role order" and "turn 2 is 'user'" in str(e.value)


def test_load_counts_trimmed_rows_drops_duplicates_and_makes_ids_unique(tmp_path, tmp_peagle_home, caplog):
    rows = [sg(("human", "h0"), ("gpt", "g0"), id="a"),
            sg(("gpt", "cut"), ("human", "h1"), ("gpt", "g1"), id="b"),
            sg(("human", "h0"), ("gpt", "g0"), id="a-copy"),  # exact duplicate of row 0
            sg(("human", "other"), id="a")]  # repeated id, different conversation
    f = tmp_path / "sg.json"
    f.write_text(json.dumps(rows))
    with caplog.at_level(logging.INFO, logger="pipelines.data.prompts"):
        ds = load_conversations(SourceConfig(kind="sharegpt_file", path=str(f)), "fail", tmp_peagle_home)
    assert ds.column_names == ["id", "messages", "source"]
    assert ds["id"] == ["a", "b", "a~1"]
    assert ds[1]["messages"] == [{"role": "user", "content": "h1"}, {"role": "assistant", "content": "g1"}]
    text = caplog.text
    assert "kept 1 conversation(s)" in text and "dropping their 1 leading assistant turn(s)" in text
    assert "dropped 1 exact-duplicate conversation(s)" in text and "1 repeated id(s)" in text


def test_mtbench_first_turn_from_the_packaged_questions(tmp_peagle_home):
    row = {"question_id": 81, "category": "writing", "turns": ["first", "second"]}
    assert normalize_row(row, 0, "mtbench") == {"id": "mtbench/81", "source": "mtbench",
                                                 "messages": [{"role": "user", "content": "first"}]}
    with pytest.raises(BadRow, match="no 'turns' list"):
        normalize_row({"question_id": 1}, 3, "mtbench")
    ds = load_conversations(SourceConfig(kind="mtbench"), "fail", tmp_peagle_home)
    assert len(ds) == 80 and ds["id"][0] == "mtbench/81" and all(len(m) == 1 for m in ds["messages"])
    with pytest.raises(ValueError, match="`turns` is an mtbench setting"):
        SourceConfig(kind="humaneval", turns=2)


def _two_sources(tmp_path):
    a = _write_jsonl(tmp_path / "a.jsonl", [
        {"messages": [{"role": "user", "content": f"question {i}"}] + (
            [{"role": "assistant", "content": f"answer {i}"}] if i % 3 else []), "id": f"a{i}"} for i in range(40)])
    b = tmp_path / "b.json"
    b.write_text(json.dumps([sg(("human", f"hello {i}"), ("gpt", f"hi {i}"), id=f"b{i}") for i in range(20)]))
    return a, b


def test_unweighted_mix_is_unchanged(tmp_path, tmp_peagle_home):
    """No weights: concatenation + one draw, the same conversations as before weights existed (ids
    recorded with the previous load_prompt_dataset on this fixture)."""
    a, b = _two_sources(tmp_path)
    data = DataConfig(sources=[SourceConfig(kind="openai_jsonl", path=str(a)),
                               SourceConfig(kind="sharegpt_file", path=str(b), num_samples=12)],
                      num_samples=15, seed=7)
    ds = load_prompt_dataset(data, tmp_peagle_home)
    assert ds["id"] == ["a10", "b10", "a26", "a36", "b6", "a12", "a16", "a0", "a24", "a6", "a19", "a4", "a37",
                        "a22", "a27"]
    assert ds[1]["messages"] == [{"role": "user", "content": "hello 10"}, {"role": "assistant", "content": "hi 10"}]
    assert len(load_prompt_dataset(data.model_copy(update={"num_samples": None}), tmp_peagle_home)) == 52


def test_weighted_mix_shares_determinism_and_caps(tmp_path, tmp_peagle_home, caplog):
    a, b = _two_sources(tmp_path)

    def data(wa, wb, n, seed=0):
        return DataConfig(sources=[SourceConfig(kind="openai_jsonl", path=str(a), weight=wa),
                                   SourceConfig(kind="sharegpt_file", path=str(b), weight=wb)],
                          num_samples=n, seed=seed)

    def count(ds):
        return Counter(s.split(":")[0] for s in ds["source"])

    ds = load_prompt_dataset(data(1, 3, 20), tmp_peagle_home)
    assert count(ds) == {"openai_jsonl": 5, "sharegpt_file": 15}
    assert ds["id"] == load_prompt_dataset(data(1, 3, 20), tmp_peagle_home)["id"]
    assert ds["id"] != load_prompt_dataset(data(1, 3, 20, seed=1), tmp_peagle_home)["id"]
    assert count(load_prompt_dataset(data(2, 1, None), tmp_peagle_home)) == {"openai_jsonl": 40, "sharegpt_file": 20}
    with caplog.at_level(logging.WARNING, logger="pipelines.data.prompt_dataset"):
        capped = load_prompt_dataset(data(1, 1, 50), tmp_peagle_home)
    assert count(capped) == {"openai_jsonl": 25, "sharegpt_file": 20} and "fewer than its weighted share" in caplog.text


def test_weighted_quotas_largest_remainder():
    assert weighted_quotas([100, 100, 100], [1, 1, 1], 10) == [4, 3, 3]
    assert weighted_quotas([100, 100], [0.3, 0.7], 9) == [3, 6]
    assert weighted_quotas([10, 100], [1, 1], None) == [10, 10]
    with pytest.raises(ValueError, match="must be positive"):
        weighted_quotas([1], [0], 1)


def test_weights_are_validated():
    with pytest.raises(ValueError, match="greater than 0"):
        SourceConfig(kind="sharegpt", weight=0)
    with pytest.raises(ValueError, match=r"set `weight` on source\(s\) 1 \(humaneval\) too"):
        DataConfig(sources=[SourceConfig(kind="sharegpt", weight=2), SourceConfig(kind="humaneval")])


class _AnswerEngine:
    """Chat engine stub: answers 'A' (greedy, 7 tokens asked) to every prompt but 'no room' (None)."""

    name = "answer"

    def __init__(self):
        self.prompts = []

    def generate(self, prompts, cfg, seeds):
        from pipelines.data.engines import Generation

        self.prompts += prompts
        assert cfg.temperature == 0 and cfg.max_tokens_per_turn == 7
        return [None if p[-1]["content"] == "no room" else Generation("A", 1, "stop") for p in prompts]


def test_eval_prompts_mtbench_one_and_two_turns(tmp_peagle_home, tiny_chat_tokenizer):
    from pipelines.evaluate.prompts import load_eval_prompts, mtbench_two_turns

    one, two = SourceConfig(kind="mtbench"), SourceConfig(kind="mtbench", turns=2)
    assert (one.eval_set_name(), two.eval_set_name(), SourceConfig(kind="humaneval").eval_set_name()) == (
        "mtbench", "mtbench-2turn", "humaneval")
    sets = load_eval_prompts([SourceConfig(kind="humaneval"), one], tiny_chat_tokenizer, num_prompts=5, seed=1)
    assert list(sets) == ["humaneval", "mtbench"] and [len(v) for v in sets.values()] == [5, 5]
    with pytest.raises(ValueError, match="needs the target's engine"):
        load_eval_prompts([two], tiny_chat_tokenizer, num_prompts=3)
    eng = _AnswerEngine()
    sets = load_eval_prompts([two], tiny_chat_tokenizer, num_prompts=3, seed=1, engine=eng, max_tokens=7)
    assert len(sets["mtbench-2turn"]) == 6 and len(eng.prompts) == 3
    rows = [{"id": "mtbench/81", "messages": [{"role": "user", "content": "first"}], "source": "mtbench"},
            {"id": "mtbench/82", "messages": [{"role": "user", "content": "no room"}], "source": "mtbench"}]
    convs = mtbench_two_turns(rows, _AnswerEngine(), 7)  # 82: no first answer -> its first turn only
    assert [[m["role"] for m in c] for c in convs] == [["user"], ["user", "assistant", "user"], ["user"]]
    assert convs[1][1]["content"] == "A"
    assert convs[1][2]["content"].startswith("Rewrite your previous response. Start every sentence with")
