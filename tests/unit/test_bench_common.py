"""bench.common's resumable files: a writer that dies mid-file leaves nothing a resume would take as done."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest

from bench.common import read_jsonl_xz, write_jsonl_xz


def _write_slowly(path: str) -> None:
    def rows():
        for i in range(10_000):
            if i == 50:
                time.sleep(60)  # killed here, with part of the file written
            yield {"i": i, "text": "x" * 2000}

    write_jsonl_xz(path, rows())


def test_killed_writer_leaves_no_chunk(tmp_path):
    path = tmp_path / "chunk-0000.jsonl.xz"
    proc = mp.get_context("spawn").Process(target=_write_slowly, args=(str(path),))
    proc.start()
    deadline = time.time() + 60
    while not any(tmp_path.iterdir()) and time.time() < deadline:  # its temporary file has started
        time.sleep(0.1)
    time.sleep(1)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join()
    assert not path.exists(), "a killed writer left a truncated chunk under its final name"


def test_written_chunk_reads_back(tmp_path):
    path = tmp_path / "chunk-0001.jsonl.xz"
    assert write_jsonl_xz(path, [{"i": i} for i in range(3)]) == 3
    assert read_jsonl_xz(path) == [{"i": 0}, {"i": 1}, {"i": 2}]
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


if __name__ == "__main__":
    pytest.main([__file__])


def test_shard_flag_parses_and_refuses_bad_shards():
    """``bench.scale regenerate --shard I/N`` (several engines on one GPU): ``0 <= I < N`` or a clear error."""
    import argparse

    from bench.scale import parse_shard

    assert parse_shard("1/3") == (1, 3)
    for bad in ("3/3", "1", "-1/2", "a/b"):
        with pytest.raises(argparse.ArgumentTypeError, match="0 <= I < N"):
            parse_shard(bad)


def test_set_lengths_counts_tokens_turns_and_sources():
    """``bench.scale.set_lengths``: tokens per conversation from the chat template, the tail counts, turns, sources."""
    from bench.scale import set_lengths

    class Tok:  # one token per character of the contents, as a chat template's input_ids
        def apply_chat_template(self, messages, tokenize, return_dict):
            assert tokenize and return_dict
            return {"input_ids": list("".join(m["content"] for m in messages))}

    def conv(n_chars: int, turns: int, source: str) -> dict:
        msgs = [m for _ in range(turns) for m in ({"role": "user", "content": ""},
                                                  {"role": "assistant", "content": "x" * (n_chars // turns)})]
        return {"messages": msgs, "source": source}

    rows = [conv(100, 1, "self_instruct")] * 8 + [conv(3000, 2, "sharegpt"), conv(5000, 4, "sharegpt")]
    got = set_lengths(rows, Tok())
    assert got["conversations"] == 10 and got["tokens_total"] == 8 * 100 + 3000 + 5000
    assert got["sources"] == {"self_instruct": 8, "sharegpt": 2}
    assert (got["over_1024"], got["over_2048"], got["over_4096"]) == (2, 2, 1)
    assert got["assistant_turns"] == {"1": 8, "2": 1, "4": 1}
    assert got["tokens_percentiles"]["p50"] == 100 and got["tokens_percentiles"]["p100"] == 5000
