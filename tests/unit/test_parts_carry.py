"""bench.parts_carry: regeneration parts (the regenerated conversations' and the self-instruct completions') bundled on
one machine and written back on the next, within the device tool's limits (files of <= max bytes, <= max files a
call), so the regenerate stage resumes from them."""

import random
import tarfile

import pytest

from bench import parts_carry
from pipelines.data.parts import read_parts, write_part


def _parts(parts_dir, n: int) -> list[str]:
    """``n`` parts of 20 conversations each, with text that compresses about as chat does (words, not noise)."""
    rng, words = random.Random(0), ["the", "a", "function", "returns", "list", "of", "numbers", "and", "strings", "in", "python", "code"]
    ids = []
    for b in range(n):
        batch = [f"c{b}-{i}" for i in range(20)]
        rows = [{"id": c, "messages": [{"role": "assistant", "content": " ".join(rng.choices(words, k=400))}]}
                for c in batch]
        write_part(parts_dir, batch, rows, {"conversations": len(batch)})
        ids += batch
    return ids


def test_bundles_keep_to_the_limits_and_the_parts_come_back_whole(tmp_path):
    parts_dir = tmp_path / "a" / "regenerate" / "parts-0123456789ab"
    ids = _parts(parts_dir, 12)
    sent = tmp_path / "sent.txt"
    # ~6.3 KB a compressed part: 4 parts a 40 KiB bundle (tarfile pads to 10 KiB records)
    first, left = parts_carry.pack(parts_dir, tmp_path / "out1", sent=sent, max_bytes=41_000, max_files=2)
    assert len(first) == 2 and left > 0 and all(p.stat().st_size <= 41_000 for p in first)
    rest, left = parts_carry.pack(parts_dir, tmp_path / "out2", sent=sent, max_bytes=41_000, max_files=8)
    assert left == 0 and all(p.stat().st_size <= 41_000 for p in rest)
    assert parts_carry.pack(parts_dir, tmp_path / "out3", sent=sent, max_bytes=41_000) == ([], 0)  # all sent
    assert sorted(sent.read_text().split()) == sorted(f"{parts_dir.name}/{p.name}" for p in parts_dir.glob("part-*.json"))

    regen = tmp_path / "b" / "regenerate"  # the next machine's run
    assert parts_carry.unpack(first + rest, regen) == 12
    assert parts_carry.unpack(first, regen) == 0  # parts already there are kept
    got, want = read_parts(regen / parts_dir.name, ids), read_parts(parts_dir, ids)
    assert got[0] == want[0] == set(ids) and got[1] == want[1] and got[2] == want[2]


def test_a_part_larger_than_a_bundle_and_a_foreign_member_are_refused(tmp_path):
    parts_dir = tmp_path / "parts-0123456789ab"
    _parts(parts_dir, 1)
    with pytest.raises(ValueError, match="lower regenerate.batch_size"):
        parts_carry.pack(parts_dir, tmp_path / "out", max_bytes=2_000)
    bad = tmp_path / "bad.tar"
    with tarfile.open(bad, "w") as tar:
        tar.add(next(parts_dir.glob("part-*.json")), arcname="../escape.json.xz")
    with pytest.raises(ValueError, match="is not <parts dir>/part-"):
        parts_carry.unpack([bad], tmp_path / "regenerate")
    assert not (tmp_path / "escape.json").exists()


def test_self_instruct_parts_go_with_the_regenerate_parts_and_resume_on_the_next_machine(
        tmp_path, monkeypatch, tiny_chat_tokenizer, capsys):
    """Two self_instruct sources' completion parts (same part names: ranges from 0) and a regenerate parts directory,
    packed from the run's regenerate/ directory by the command line, come back whole on the next machine, where the
    prompts are written again from them alone: no engine call, the same rows."""
    from pipelines.data import parts
    from pipelines.data import selfinstruct as si
    from pipelines.recipe import SelfInstructConfig
    from tests.unit.test_selfinstruct import FakeEngine

    regen = tmp_path / "a" / "regenerate"
    cfgs = {parts.SELF_INSTRUCT_PARTS + key: SelfInstructConfig(num_prompts=24, seed=seed, min_chars=10)
            for key, seed in (("0123456789ab", 0), ("ba9876543210", 1))}
    rows = {name: si.generate_prompts(FakeEngine(tiny_chat_tokenizer), cfg, batch_size=5, parts_dir=regen / name)
            for name, cfg in cfgs.items()}
    ids = _parts(regen / f"{parts.REGENERATE_PARTS}0123456789ab", 3)
    assert [d.name for d in parts.parts_dirs(regen)] == [f"{parts.REGENERATE_PARTS}0123456789ab", *sorted(cfgs)]
    sent, out = tmp_path / "sent.txt", tmp_path / "out"
    monkeypatch.setattr("sys.argv", ["parts_carry", "pack", "--regenerate-dir", str(regen), str(out), "--sent", str(sent)])
    parts_carry.main()
    assert "0 parts left" in capsys.readouterr().out
    assert len(sent.read_text().split()) == 3 + 2 * 5  # the two sources' part-0000000000-0000000005.json both sent
    assert parts_carry.pack(parts.parts_dirs(regen), tmp_path / "out2", sent=sent) == ([], 0)

    new, sent_b = tmp_path / "b" / "regenerate", tmp_path / "sent_b.txt"
    assert parts_carry.unpack(sorted(out.glob("*.tar")), new, sent=sent_b) == 13
    assert parts_carry.unpack(sorted(out.glob("*.tar")), new, sent=sent_b) == 0  # kept parts are not rewritten
    assert sorted(sent_b.read_text().split()) == sorted(sent.read_text().split())  # each listed once
    assert parts_carry.pack(parts.parts_dirs(new), tmp_path / "out4", sent=sent_b) == ([], 0)  # nothing sent back
    assert read_parts(new / f"{parts.REGENERATE_PARTS}0123456789ab", ids)[0] == set(ids)

    class NoEngine(FakeEngine):
        def complete(self, prompts, params, seeds):
            raise AssertionError("the parts hold every completion")

    for name, cfg in cfgs.items():
        assert parts.read_range_parts(new / name, 24) == parts.read_range_parts(regen / name, 24)
        assert si.generate_prompts(NoEngine(tiny_chat_tokenizer), cfg, batch_size=5, parts_dir=new / name) == rows[name]
    with pytest.raises(ValueError, match="not a parts directory"):
        parts_carry.pack([regen], tmp_path / "out3")
