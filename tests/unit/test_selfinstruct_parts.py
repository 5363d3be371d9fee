"""Self-instruct prompts in ranges and parts, with fake engines: the same kept prompts for one engine or three
(ranges coming back in any order), a run stopped part-way that resumes from its parts and completes only the
missing request indices, the writer's wiring (parts directory, engine factory, counts), the parts directory's key,
and the engine pool refused before it starts when the cluster cannot hold it."""

from __future__ import annotations

import json
import random
from collections import Counter
from types import SimpleNamespace

import pytest

from pipelines.data import parts
from pipelines.data import selfinstruct as si
from pipelines.data.engine_pool import check_pool_fits
from pipelines.recipe import (
    DataConfig,
    RegenerateConfig,
    SelfInstructConfig,
    SourceConfig,
    TargetConfig,
    recipe_from_dict,
)
from tests.unit.test_selfinstruct import FakeEngine

pytestmark = pytest.mark.unit

# 40 requests in ranges of 8: five ranges; dedup_threshold set, so duplicates across ranges are dropped (the
# FakeEngine's prompts repeat every 10 seeds)
CFG = SelfInstructConfig(num_prompts=40, seed=3, min_chars=10, max_chars=200, dedup_threshold=0.7)
BATCH = 8


class Pool:
    """``num_engines`` fake engines standing in for the actor pool: range j goes to engine j mod n, the ranges come
    back in a shuffled order (as ``ActorPool.map_unordered`` gives them). ``seen``: the request indices asked for."""

    def __init__(self, tokenizer, num_engines: int, order_seed: int = 0, stop_after: int | None = None):
        self.engines = [FakeEngine(tokenizer) for _ in range(num_engines)]
        self.order_seed, self.stop_after, self.seen = order_seed, stop_after, []

    def __call__(self, cfg, pq):
        def run(ranges):
            done = [(a, si.complete_range(self.engines[j % len(self.engines)], cfg, pq, a, b), 0.5)
                    for j, (a, b) in enumerate(ranges)]
            random.Random(self.order_seed).shuffle(done)
            for n, (a, out, s) in enumerate(done):
                if n == self.stop_after:
                    raise KeyboardInterrupt("machine lost")
                self.seen += range(a, a + len(out))
                yield a, out, s
        return run


def write(tokenizer, pool: Pool, parts_dir=None, cfg=CFG, stats=None):
    pq = si.pre_query(tokenizer, cfg.system_prompt)
    return si.write_prompts(pool(cfg, pq), cfg, pq, batch_size=BATCH, parts_dir=parts_dir, stats=stats)


def test_missing_ranges_are_runs_cut_at_batch_multiples():
    assert si.missing_ranges(10, set(), 4) == [(0, 4), (4, 8), (8, 10)]
    assert si.missing_ranges(10, {1, 2, 5, 8, 9}, 4) == [(0, 1), (3, 4), (4, 5), (6, 8)]
    assert si.missing_ranges(3, {0, 1, 2}, 2) == []


def test_one_engine_or_three_give_the_same_kept_prompts(tiny_chat_tokenizer):
    one_stats, three_stats = Counter(), Counter()
    one = si.generate_prompts(FakeEngine(tiny_chat_tokenizer), CFG, batch_size=BATCH, stats=one_stats)
    three_pool = Pool(tiny_chat_tokenizer, 3, order_seed=1)
    three = write(tiny_chat_tokenizer, three_pool, stats=three_stats)
    assert three == one and 3 <= len(one) < CFG.num_prompts  # some dropped as duplicates of earlier ranges' prompts
    pq = si.pre_query(tiny_chat_tokenizer)  # the filters over all 40 completions of one call
    gens = si.complete_range(FakeEngine(tiny_chat_tokenizer), CFG, pq, 0, CFG.num_prompts)
    assert one == si.pack_turns(si.filter_prompts(gens, CFG, pq.stop_text), CFG, None)
    assert all(e.calls for e in three_pool.engines) and sorted(three_pool.seen) == list(range(40))
    assert three_pool.seen != sorted(three_pool.seen)  # the ranges did come back out of order
    assert {k: three_stats[k] for k in si.COUNT_KEYS} == {k: one_stats[k] for k in si.COUNT_KEYS}
    assert three_stats["generate_s"] == 5 * 0.5 and three_stats["resumed_prompts"] == 0


def test_a_run_stopped_part_way_resumes_and_completes_only_the_missing_requests(tiny_chat_tokenizer, tmp_path):
    whole = write(tiny_chat_tokenizer, Pool(tiny_chat_tokenizer, 1), parts_dir=tmp_path / "whole")
    assert len(list((tmp_path / "whole").glob(parts.PART_GLOB))) == 5
    d = tmp_path / "parts"
    stopped = Pool(tiny_chat_tokenizer, 3, order_seed=2, stop_after=2)
    with pytest.raises(KeyboardInterrupt):
        write(tiny_chat_tokenizer, stopped, parts_dir=d)
    kept = set(stopped.seen)
    assert len(kept) == 2 * BATCH and len(list(d.glob(parts.PART_GLOB))) == 2  # the two ranges back before it stopped
    stats = Counter()
    again = Pool(tiny_chat_tokenizer, 2, order_seed=3)
    assert write(tiny_chat_tokenizer, again, parts_dir=d, stats=stats) == whole
    assert sorted(again.seen) == sorted(set(range(40)) - kept) and stats["resumed_prompts"] == len(kept)
    # a hole inside a range (a part lost, another from a run with ranges of 4) and parts past num_prompts
    (d / "part-0000000008-0000000016.json").unlink()
    (d / "part-0000000000-0000000008.json").unlink()
    first = parts.read_range_parts(tmp_path / "whole", 8)
    parts.write_range_part(d, 4, [first[i] for i in range(4, 8)])
    later = Pool(tiny_chat_tokenizer, 1)
    assert write(tiny_chat_tokenizer, later, parts_dir=d, cfg=CFG.model_copy(update={"num_prompts": 30})) == [
        r for r in whole if int(r["id"].split("/")[-1]) < 30]
    assert later.seen == [0, 1, 2, 3, *range(8, 16)]


def test_the_writer_keeps_parts_where_it_is_told_and_starts_no_engine_when_they_hold_all(
        tiny_chat_tokenizer, tmp_path, monkeypatch):
    monkeypatch.setattr(si, "engine_setup", lambda *a, **k: (tmp_path, {"dtype": "float32"}))
    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", lambda path: tiny_chat_tokenizer)
    made = []

    def make(backend, model_path, **kwargs):
        made.append((backend, model_path, kwargs))
        return FakeEngine(tiny_chat_tokenizer)

    regen = RegenerateConfig(backend="transformers", batch_size=BATCH, num_workers=3)
    source = SourceConfig(kind="self_instruct", self_instruct=CFG)
    writer = si.SelfInstructWriter(TargetConfig(), regen, DataConfig(), use_ray=False, make=make,
                                   parts_dir=lambda cfg: tmp_path / f"p{cfg.seed}")
    rows = writer(source)
    assert made == [("transformers", tmp_path, {"dtype": "float32"})] and writer.parts_dirs == [tmp_path / "p3"]
    assert rows == si.generate_prompts(FakeEngine(tiny_chat_tokenizer), CFG, batch_size=BATCH)
    assert len(list((tmp_path / "p3").glob(parts.PART_GLOB))) == 5 and writer.stats[0]["num_engines"] == 1
    assert writer(source) == rows and len(made) == 1  # all from the parts: no engine started
    assert writer.stats[1]["resumed_prompts"] == 40 and "num_engines" not in writer.stats[1]
    with pytest.raises(ValueError, match="writes self_instruct sources"):
        writer(SourceConfig(kind="sharegpt"))


def test_parts_key_changes_with_the_completions_not_with_filters_or_engines(tmp_path):
    from pipelines.stages.regenerate import RegenerateStage

    def parts_dir(**changes):
        base = {"name": "r", "data": {"sources": [{"kind": "self_instruct"}]}}
        for k, v in changes.items():
            section, _, field = k.partition("__")
            base.setdefault(section, {})[field] = v
        recipe = recipe_from_dict(base)
        stage = RegenerateStage(SimpleNamespace(recipe=recipe, stage_dir=lambda name: tmp_path / name))
        return stage.self_instruct_parts(recipe.data.sources[0].self_instruct)

    d = parts_dir()
    assert d.parent == tmp_path / "regenerate" and parts.is_parts_dir(d.name)
    assert d.name.startswith(parts.SELF_INSTRUCT_PARTS)
    same = [parts_dir(regenerate__num_workers=4, regenerate__engines_per_gpu=2, regenerate__max_turns=3,
                      regenerate__temperature=0.7)]
    assert all(x == d for x in same)
    cfg = SelfInstructConfig(num_prompts=5, min_chars=1, dedup_threshold=None, turns=2)
    stage = RegenerateStage(SimpleNamespace(recipe=recipe_from_dict({"name": "r", "data": {"sources": [
        {"kind": "self_instruct"}]}}), stage_dir=lambda name: tmp_path / name))
    assert stage.self_instruct_parts(cfg) == d  # filters and counts: same completions
    assert stage.self_instruct_parts(SelfInstructConfig(seed=1)) != d
    assert parts_dir(data__max_length_tokens=1024) != d and parts_dir(regenerate__backend="transformers") != d


def test_a_pool_the_cluster_cannot_hold_is_refused_before_it_starts():
    four = RegenerateConfig(num_workers=4)
    check_pool_fits(four, 4, (4, 1.0), {"GPU": 4, "CPU": 64})
    with pytest.raises(ValueError, match="4 engine actors need 4 GPUs; the Ray cluster has 1: lower "
                                         "regenerate.num_workers to 1"):
        check_pool_fits(four, 4, (4, 1.0), {"GPU": 1, "CPU": 64})
    shared = RegenerateConfig(num_workers=4, engines_per_gpu=2, vllm_runner="actor")
    check_pool_fits(shared, 4, (2, 0.5), {"GPU": 2, "CPU": 16})
    with pytest.raises(ValueError, match="need 2 GPUs; the Ray cluster has 1: lower regenerate.num_workers to 2"):
        check_pool_fits(shared, 4, (2, 0.5), {"GPU": 1, "CPU": 16})
    with pytest.raises(ValueError, match="3 engine actors need 6 CPUs \\(2 each\\); the Ray cluster has 4 and no GPU"):
        check_pool_fits(RegenerateConfig(num_workers=3), 3, (2, 0.0), {"CPU": 4})


def test_range_parts_skip_an_unreadable_part(tmp_path):
    parts.write_range_part(tmp_path, 0, [{"text": "a", "num_tokens": 1, "finish_reason": "stop"}, None])
    parts.write_range_part(tmp_path, 2, [None])
    assert parts.read_range_parts(tmp_path, 3) == {0: {"text": "a", "num_tokens": 1, "finish_reason": "stop"},
                                                   1: None, 2: None}
    assert parts.read_range_parts(tmp_path, 1) == {0: {"text": "a", "num_tokens": 1, "finish_reason": "stop"}}
    (tmp_path / "part-0000000002-0000000003.json").write_text("{cut")
    assert set(parts.read_range_parts(tmp_path, 3)) == {0, 1}
    assert json.loads((tmp_path / "part-0000000000-0000000002.json").read_text())["start"] == 0
