"""Prompt normalization on hand-written rows; loading user files through datasets; sampling/split."""

from __future__ import annotations

import json
import logging

import pytest

from pipelines.prompts import (
    BadRow,
    json_array_to_jsonl,
    load_conversations,
    normalize_row,
    sample,
    train_eval_split,
)
from pipelines.recipe import SourceConfig

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
    with caplog.at_level(logging.WARNING, logger="pipelines.prompts"):
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
    with caplog.at_level(logging.WARNING, logger="pipelines.prompts"):
        ds = load_conversations(SourceConfig(kind="sharegpt_file", path=str(cut)), "skip", tmp_peagle_home)
    assert ds["id"] == ["a"]
    assert "cut off" in caplog.text


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
