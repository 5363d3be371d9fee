"""pipelines.data.regenerate and pipelines.data.engines without Ray or vLLM: turn-by-turn conditioning, provenance,
the transformers engine."""

import os
import time
from collections import Counter
from functools import partial

import pytest
import torch
from transformers import LlamaForCausalLM

from pipelines.data import engine_pool, engines, parts, regenerate
from pipelines.recipe import RegenerateConfig
from tests.unit.conftest import tiny_target_config
from tests.unit.test_capture import tiny_tokenizer

pytestmark = pytest.mark.unit


class EchoEngine:
    """Answers 'reply to <last user> after <n> assistant turns'; records every prompt it saw."""

    name = "echo"

    def __init__(self, empty_on: str | None = None, none_on: str | None = None):
        self.prompts, self.empty_on, self.none_on = [], empty_on, none_on

    def generate(self, prompts, cfg, seeds):
        out = []
        for p in prompts:
            self.prompts.append(p)
            last = p[-1]["content"]
            n_prev = sum(m["role"] == "assistant" for m in p)
            if last == self.none_on:
                out.append(None)
            elif last == self.empty_on:
                out.append(engines.Generation("  ", 1, "stop"))
            else:
                out.append(engines.Generation(f"re:{last}/{n_prev}", 3, "stop"))
        return out


def test_turn_by_turn_conditioning_and_provenance():
    rows = [
        {"id": "a", "source": "s", "messages": [
            {"role": "system", "content": "sys"}, {"role": "user", "content": "u1"},
            {"role": "assistant", "content": "OLD"}, {"role": "user", "content": "u2"},
            {"role": "assistant", "content": "OLD2"}]},
        {"id": "b", "source": "s", "messages": [{"role": "user", "content": "only"}]},  # ends on a user turn
    ]
    eng, cfg, stats = EchoEngine(), RegenerateConfig(temperature=0.7, seed=3), Counter()
    out = regenerate.regenerate_conversations(rows, eng, cfg, stats=stats)
    assert out[0]["messages"] == [
        {"role": "system", "content": "sys"}, {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "re:u1/0"}, {"role": "user", "content": "u2"},
        {"role": "assistant", "content": "re:u2/1"}]
    # turn 2 was conditioned on the regenerated turn 1, never on the dataset's answer
    assert all("OLD" not in m["content"] for p in eng.prompts for m in p)
    assert out[1]["messages"][-1] == {"role": "assistant", "content": "re:only/0"}
    assert out[0]["source_id"] == "a" and out[0]["regen_model"] == "echo"
    assert out[0]["sampling"] == {"temperature": 0.7, "top_p": 1.0, "max_tokens_per_turn": 512, "seed": 3,
                                  "greedy": False}
    assert out[0]["num_generated_tokens"] == 6 and stats["num_generated_tokens"] == 9 and stats["num_turns"] == 3
    assert engines.request_seed(3, "a", 1) == engines.request_seed(3, "a", 1) != engines.request_seed(3, "a", 0)


def test_empty_and_context_full_stop_the_conversation():
    rows = [
        {"id": "e", "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"},
                                 {"role": "user", "content": "EMPTY"}]},
        {"id": "n", "messages": [{"role": "user", "content": "FULL"}]},
    ]
    stats = Counter()
    out = regenerate.regenerate_conversations(rows, EchoEngine(empty_on="EMPTY", none_on="FULL"), RegenerateConfig(),
                                              stats=stats)
    assert [r["id"] for r in out] == ["e"] and len(out[0]["messages"]) == 2  # stopped before the empty answer
    assert stats["empty_generations"] == 1 and stats["stopped_context_full"] == 1 and stats["dropped_no_response"] == 1
    assert stats["dropped_context_full"] == 1 and stats["dropped_empty"] == 0  # "n" at its first turn; "e" kept
    assert regenerate.drop_summary(2, 1, stats) == (
        "; 1 of 2 kept: 1 dropped (1 first prompt longer than the context), 1 cut short (1 an empty response)")


def test_progress_reports_add_up_to_the_budget_turn_by_turn():
    """After each turn: conversations finished, tokens generated, budget that will not be used; at the end the
    tokens generated are the budget less what was not used."""
    rows = [
        {"id": "a", "messages": [{"role": "user", "content": "u1"}, {"role": "assistant", "content": "-"},
                                 {"role": "user", "content": "u2"}]},  # two turns of 3 tokens
        {"id": "e", "messages": [{"role": "user", "content": "EMPTY"}, {"role": "assistant", "content": "-"},
                                 {"role": "user", "content": "never asked"}]},  # ends at turn 1: turn 2 unused
        {"id": "n", "messages": [{"role": "user", "content": "FULL"}]},  # no room: its whole budget unused
        {"id": "s", "messages": [{"role": "system", "content": "no user turn"}]},  # done before any turn
    ]
    cfg, reports, stats = RegenerateConfig(max_tokens_per_turn=10, max_turns=2), [], Counter()
    regenerate.regenerate_conversations(rows, EchoEngine(empty_on="EMPTY", none_on="FULL"), cfg, stats=stats,
                                        report=lambda **counts: reports.append(counts))
    assert regenerate.token_budget(rows, cfg) == 10 * (2 + 2 + 1 + 0)
    assert reports == [{"conversations": 1},
                       {"conversations": 2, "tokens": 3 + 1, "unused_tokens": 7 + (9 + 10) + 10},
                       {"conversations": 1, "tokens": 3, "unused_tokens": 7}]
    assert sum(r.get("conversations", 0) for r in reports) == len(rows)
    assert 50 - sum(r.get("unused_tokens", 0) for r in reports) == stats["num_generated_tokens"] == 7


def test_transformers_engine_greedy_matches_generate():
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_target_config(eos_token_id=2)).eval()
    tok = tiny_tokenizer()
    eng = engines.TransformersEngine("tiny", model=model, tokenizer=tok, max_model_len=64, name="tiny")
    prompts = [[{"role": "user", "content": "hi how are you ?"}], [{"role": "user", "content": "one"}]]
    cfg = RegenerateConfig(max_tokens_per_turn=5, temperature=0.0)
    gens = eng.generate(prompts, cfg, [0, 0])
    for p, g in zip(prompts, gens):  # batched left-padded greedy == one prompt alone
        ids = tok.apply_chat_template(p, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        ref = model.generate(**ids, max_new_tokens=5, do_sample=False, eos_token_id=[2], pad_token_id=2, top_k=None)
        new = ref[0, ids["input_ids"].shape[1]:].tolist()
        new = new[: new.index(2)] if 2 in new else new
        assert g.text == tok.decode(new, skip_special_tokens=True)
        assert g.num_tokens == min(len(new) + (g.finish_reason == "stop"), 5)
    # context full: prompt longer than max_model_len -> None
    eng.max_model_len = 4
    assert eng.generate(prompts[:1], cfg, [0]) == [None]


def test_transformers_engine_static_cache_buckets_and_caps():
    """The fast path (static cache, fixed shapes) gives the plain path's greedy text; batches respect the
    prompt and token caps; one reused cache per shape."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_target_config(eos_token_id=2)).eval()
    tok = tiny_tokenizer()
    prompts = [[{"role": "user", "content": " ".join(["hi"] * n)}] for n in (1, 7, 2, 12, 3, 5, 9)]
    cfg = RegenerateConfig(max_tokens_per_turn=4, temperature=0.0)
    plain = engines.TransformersEngine("tiny", model=model, tokenizer=tok, max_model_len=64, batch_size=1)
    static = engines.TransformersEngine("tiny", model=model, tokenizer=tok, max_model_len=64, batch_size=3,
                                        static_cache=True, max_batch_tokens=150)
    calls = []
    real = static._generate_batch
    static._generate_batch = lambda batch, p, seed: calls.append([len(b) for b in batch]) or real(batch, p, seed)
    want, got = plain.generate(prompts, cfg, [0] * 7), static.generate(prompts, cfg, [0] * 7)
    assert [g.text for g in got] == [g.text for g in want]  # float32: left padding does not change greedy text
    assert [g.num_tokens for g in got] == [g.num_tokens for g in want]
    assert sorted(n for c in calls for n in c) == sorted(len(engines._chat_ids(tok, m)) for m in prompts)
    assert all(c == sorted(c) for c in calls) and max(map(len, calls)) <= 2  # 150 // 64 (the only cache length)
    assert static.cache_lengths == (64,) and set(static._caches) == {(2, 64)}  # short batches filled up to 2
    told = []
    static.on_tokens = told.append
    got = static.generate(prompts, cfg, [0] * 7)
    assert len(told) == len(calls) // 2 and sum(told) == sum(g.num_tokens for g in got)  # once per batch
    with pytest.raises(ValueError, match="batch_size=0"):
        engines.TransformersEngine("tiny", model=model, tokenizer=tok, batch_size=0)


def test_bad_config_raises_before_engine():
    with pytest.raises(ValueError, match="regenerate.backend='sglang'"):
        engines.make_engine("sglang", "x", dtype="float32", max_model_len=8)
    with pytest.raises(ValueError, match="regenerate.enabled is false"):
        regenerate.run_regenerate([], None, RegenerateConfig(enabled=False), None)


def test_drop_summary_names_every_reason():
    # the 2026-11-25 demo: 82 conversations whose first prompt did not fit, read once (not "82 dropped, 82 stopped")
    stats = Counter(dropped_no_response=82, dropped_context_full=82, stopped_context_full=82, num_turns=222)
    assert regenerate.drop_summary(304, 222, stats) == (
        "; 222 of 304 kept: 82 dropped (82 first prompt longer than the context)")
    stats = Counter(dropped_no_response=5, dropped_context_full=2, dropped_empty=1, stopped_context_full=6,
                    empty_generations=3)
    assert regenerate.drop_summary(100, 95, stats) == (
        "; 95 of 100 kept: 5 dropped (2 first prompt longer than the context, 1 empty first response, 2 no user "
        "turn), 6 cut short (4 a later prompt no longer fits the context, 2 an empty response)")
    assert regenerate.drop_summary(10, 10, Counter(num_turns=12)) == ""


def test_vllm_step_sizes_reach_the_engine_only_when_set(monkeypatch, tmp_path):
    """regenerate.max_num_seqs / max_num_batched_tokens become vLLM engine kwargs (backend vllm); unset, vLLM's
    defaults stay (no key); the transformers backend never gets them."""
    from types import SimpleNamespace

    import pipelines.assets
    from pipelines.recipe import DataConfig, TargetConfig

    monkeypatch.setattr(pipelines.assets, "resolve_target",
                        lambda cfg: (SimpleNamespace(path=tmp_path, sha256="0" * 64), {}))
    target, data = TargetConfig(model="smollm2-135m-instruct"), DataConfig()

    def kwargs(**kw):
        return engines.engine_setup(target, RegenerateConfig(**kw), data)[1]

    assert "max_num_seqs" not in kwargs() and "max_num_batched_tokens" not in kwargs()
    got = kwargs(max_num_seqs=512, max_num_batched_tokens=32768)
    assert got["max_num_seqs"] == 512 and got["max_num_batched_tokens"] == 32768
    assert "max_num_seqs" not in kwargs(backend="transformers", max_num_seqs=512)
    # engines sharing a GPU split its memory; one engine keeps VLLMEngine's own default; a caller's value wins
    assert "gpu_memory_utilization" not in kwargs()
    assert kwargs(engines_per_gpu=2)["gpu_memory_utilization"] == engines.SHARED_GPU_MEMORY / 2
    cpu = engines.engine_setup(target, RegenerateConfig(engines_per_gpu=2), data,
                               engine_kwargs={"gpu_memory_utilization": 0.25})[1]
    assert cpu["gpu_memory_utilization"] == 0.25


def test_engines_sharing_a_gpu_split_its_share_of_cpus(monkeypatch):
    """regenerate.engines_per_gpu: each engine actor asks Ray for 1/k of a GPU and of that GPU's CPUs (at least
    one); on a cluster without GPUs the setting changes nothing."""
    import pipelines.capture.actors
    from pipelines.data.engine_pool import engine_share

    monkeypatch.setattr(pipelines.capture.actors, "actor_num_gpus", lambda requested: 1.0)
    assert engine_share(RegenerateConfig(engines_per_gpu=2), 11) == (5, 0.5)
    assert engine_share(RegenerateConfig(engines_per_gpu=3), 2) == (1, 1 / 3)
    assert engine_share(RegenerateConfig(), 11) == (11, 1.0)
    monkeypatch.setattr(pipelines.capture.actors, "actor_num_gpus", lambda requested: 0.0)
    assert engine_share(RegenerateConfig(engines_per_gpu=2), 2) == (2, 0.0)


def test_pool_batches_are_a_multiple_of_the_engines():
    """Every engine of the pool gets the same number of equal batches, none above regenerate.batch_size: 5,880
    conversations in batches of 1,024 for 4 engines left 2 engines to run the last 2 batches alone (2x H200)."""
    from pipelines.data.engine_pool import pool_batch_size, pool_batches

    assert pool_batches(5880, 1024, 4) == 8 and pool_batches(302147, 1024, 4) == 296  # the Ray Data blocks
    assert pool_batches(9, 3, 4) == 4 and pool_batches(3, 1024, 4) == 3 and pool_batches(12, 6, 1) == 2
    assert pool_batch_size(5880, 1024, 4) == 735  # 8 batches, 2 an engine
    assert pool_batch_size(5880, 1024, 2) == 980  # 6 batches, 3 an engine
    assert pool_batch_size(100, 1024, 1) == 1024 and pool_batch_size(100, 64, 1) == 64  # one engine: as set
    assert pool_batch_size(3, 1024, 4) == 1 and pool_batch_size(0, 16, 4) == 16
    for rows, size, n in ((5880, 1024, 4), (12345, 256, 3), (7, 2, 8), (1000, 1000, 1)):
        assert 1 <= pool_batch_size(rows, size, n) <= size
    assert -(-12345 // pool_batch_size(12345, 256, 3)) == 51  # 49 batches of <= 256 -> 51, 17 an engine
    from pipelines.data.engine_pool import pool_chunks

    for rows, size, n in ((5880, 1024, 4), (9, 3, 4), (12345, 256, 3), (7, 2, 8), (100, 7, 3)):
        chunks = pool_chunks(list(range(rows)), size, n)  # the engine batches, in order, sizes within one
        assert len(chunks) == pool_batches(rows, size, n) and [i for c in chunks for i in c] == list(range(rows))
        assert max(map(len, chunks)) - min(map(len, chunks)) <= 1 and max(map(len, chunks)) <= size
    assert [len(c) for c in pool_chunks(list(range(10)), 3, 2)] == [3, 3, 2, 2] and pool_chunks([], 3, 2) == []


def test_vllm_token_count_is_told_while_a_generate_call_runs(monkeypatch):
    """``VLLMEngine(on_tokens=...)``: a thread reads vLLM's ``vllm:generation_tokens`` while the call runs and
    tells the increase; an engine without statistics tells nothing and still generates."""
    pytest.importorskip("vllm")
    from vllm.v1.metrics.reader import Counter as MetricCounter

    class FakeLLM:
        def __init__(self) -> None:
            self.tokens = 0

        def get_metrics(self):
            return [MetricCounter("vllm:generation_tokens", {"engine": "0"}, self.tokens),
                    MetricCounter("vllm:prompt_tokens", {"engine": "0"}, 10**6)]

    monkeypatch.setattr(engines, "TOKENS_EVERY_S", 0.01)
    llm, told = FakeLLM(), []
    llm.tokens = 500  # an earlier call's tokens: not told again
    with engines._counting_tokens(llm, told.append):
        for _ in range(3):
            llm.tokens += 40
            deadline = time.monotonic() + 10
            while sum(told) < llm.tokens - 500 and time.monotonic() < deadline:
                time.sleep(0.005)
        llm.tokens += 2  # just before the end: told by the last read
    assert len(told) >= 3 and sum(told) == 122

    class NoStats:
        def get_metrics(self):
            raise AssertionError("Stat logging disabled")

    with engines._counting_tokens(NoStats(), told.append):
        pass
    assert sum(told) == 122


class ChainedEchoEngine(EchoEngine):
    """EchoEngine's answers through ``generate_chained``: requests finish newest first (a later conversation's turn
    1 before an earlier one's), and a conversation's next turn is queued before the other first turns finish."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.log: list[tuple[str, str]] = []

    def generate_chained(self, first, cfg, on_done):
        queue = [(key, msgs) for key, msgs, _ in first]
        while queue:
            key, msgs = queue.pop()  # newest first
            self.log.append(("done", msgs[-1]["content"]))
            nxt = on_done(key, self.generate([msgs], cfg, [0])[0])
            if nxt is not None:
                queue.append((key, nxt[0]))


def test_chained_turns_give_the_rows_stats_and_reports_of_turn_by_turn():
    rows = [
        {"id": "a", "messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "u1"},
                                 {"role": "assistant", "content": "-"}, {"role": "user", "content": "u2"}]},
        {"id": "e", "messages": [{"role": "user", "content": "EMPTY"}, {"role": "assistant", "content": "-"},
                                 {"role": "user", "content": "never asked"}]},
        {"id": "n", "messages": [{"role": "user", "content": "FULL"}]},
        {"id": "s", "messages": [{"role": "system", "content": "no user turn"}]},
        {"id": "b", "messages": [{"role": "user", "content": "v1"}, {"role": "assistant", "content": "-"},
                                 {"role": "user", "content": "v2"}]},
    ]
    cfg = RegenerateConfig(max_tokens_per_turn=10, max_turns=2, temperature=0.5)
    got = {}
    for eng in (EchoEngine(empty_on="EMPTY", none_on="FULL"), ChainedEchoEngine(empty_on="EMPTY", none_on="FULL")):
        stats, totals = Counter(), Counter()
        out = regenerate.regenerate_conversations(rows, eng, cfg, stats=stats, report=totals.update)
        stats.pop("generate_s")
        got[type(eng).__name__] = (out, stats, totals, eng)
    (out_t, stats_t, totals_t, _), (out_c, stats_c, totals_c, chained) = got["EchoEngine"], got["ChainedEchoEngine"]
    assert out_c == out_t and stats_c == stats_t and totals_c == totals_t
    assert totals_c["conversations"] == len(rows)
    assert regenerate.token_budget(rows, cfg) - totals_c["unused_tokens"] == stats_c["num_generated_tokens"]
    # b's second turn was answered before a's first: no barrier between turns
    done = [text for _, text in chained.log]
    assert done.index("v2") < done.index("u1")


def test_vllm_engine_chains_requests_through_add_request_and_step():
    """``VLLMEngine.generate_chained`` on a fake ``LLMEngine``: requests come back finished only
    (``FINAL_ONLY``), each answer's next prompt is added at once, a prompt with no room is told as None."""
    pytest.importorskip("vllm")
    from vllm.sampling_params import RequestOutputKind

    class Out:
        def __init__(self, rid, n):
            self.request_id, self.finished = rid, True
            self.outputs = [type("O", (), {"text": f"ans{n}", "token_ids": [1] * n, "finish_reason": "stop"})()]

    class FakeLLMEngine:
        def __init__(self):
            self.queue, self.added = [], []

        def add_request(self, rid, prompt, params):
            assert params.output_kind == RequestOutputKind.FINAL_ONLY and params.max_tokens == min(4, 16 - len(
                prompt["prompt_token_ids"]))
            self.added.append(len(prompt["prompt_token_ids"]))
            self.queue.append(Out(rid, len(prompt["prompt_token_ids"])))

        def has_unfinished_requests(self):
            return bool(self.queue)

        def step(self):
            out, self.queue = self.queue[:1], self.queue[1:]
            return out

    class Tok:
        def apply_chat_template(self, messages, **kw):
            return {"input_ids": [0] * sum(len(m["content"]) for m in messages)}

    eng = object.__new__(engines.VLLMEngine)
    eng.llm = type("LLM", (), {"llm_engine": FakeLLMEngine()})()
    eng.tokenizer, eng.max_model_len, eng.on_tokens = Tok(), 16, None
    seen, nexts = [], [10, 20, 5]  # the third prompt (20 tokens) no longer fits the 16-token context

    def on_done(key, g):
        seen.append((key, None if g is None else g.text))
        return None if g is None else ([{"role": "user", "content": "x" * nexts.pop(0)}], 0)

    eng.generate_chained([("k", [{"role": "user", "content": "abc"}], 0)], RegenerateConfig(max_tokens_per_turn=4),
                         on_done)
    assert seen == [("k", "ans3"), ("k", "ans10"), ("k", None)] and eng.llm.llm_engine.added == [3, 10]
    assert nexts == [5]


def test_finished_batches_are_kept_as_parts_and_read_back(tmp_path):
    """``regenerate_batch`` writes each batch's ids (dropped ones too), rows and own counts; ``read_parts`` gives
    them back for the ids asked, ignores a part naming other ids and skips one that does not parse."""
    rows = [{"id": i, "messages": [{"role": "user", "content": i}]} for i in ("a", "b", "FULL", "d")]
    cfg, totals = RegenerateConfig(max_tokens_per_turn=10), Counter()
    eng = EchoEngine(none_on="FULL")
    for batch in (rows[:2], rows[2:]):
        regenerate.regenerate_batch(batch, eng, cfg, stats=totals, report=lambda **c: None, parts_dir=tmp_path)
    files = sorted(tmp_path.glob(parts.PART_GLOB))
    assert len(files) == 2 and totals["num_generated_tokens"] == 9
    done, kept, stats = parts.read_parts(tmp_path, ["a", "b", "FULL", "d", "e"])
    assert done == {"a", "b", "FULL", "d"} and sorted(r["id"] for r in kept) == ["a", "b", "d"]
    assert stats["num_generated_tokens"] == 9 and stats["dropped_context_full"] == 1  # per part, not cumulative
    done, kept, _ = parts.read_parts(tmp_path, ["a", "b"])  # the other part names ids not asked for
    assert done == {"a", "b"} and len(kept) == 2
    files[0].write_text("{cut")
    done, _, _ = parts.read_parts(tmp_path, ["a", "b", "FULL", "d"])
    assert len(done) == 2


def test_engines_sharing_a_gpu_start_one_after_another(tmp_path, monkeypatch):
    """gpu_start_lock, with real processes and a real flock: while an engine of GPU 3 starts (here: this test holds
    the lock), another engine sharing GPU 3 waits; one on GPU 5, or an engine alone on GPU 3, does not."""
    import subprocess
    import sys

    script = tmp_path / "start.py"
    script.write_text("import sys\nfrom pathlib import Path\nfrom pipelines.data import engine_pool\n"
                      "engine_pool.GPU_START_LOCK_DIR = Path(sys.argv[1])\n"
                      "with engine_pool.gpu_start_lock(sys.argv[2] == '1'):\n    print('started')\n")
    locks = tmp_path / "locks"
    locks.mkdir()
    monkeypatch.setattr(engine_pool, "GPU_START_LOCK_DIR", locks)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")

    def start(gpu: str, shared: bool) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, str(script), str(locks), "1" if shared else "0"], text=True,
                                stdout=subprocess.PIPE, env={**os.environ, "CUDA_VISIBLE_DEVICES": gpu})

    with engine_pool.gpu_start_lock(True):
        waiting, other_gpu, alone = start("3", True), start("5", True), start("3", False)
        assert other_gpu.communicate(timeout=120)[0] == "started\n" and alone.communicate(timeout=120)[0] == "started\n"
        time.sleep(1.0)
        assert waiting.poll() is None  # still waiting for this start to end
    assert waiting.communicate(timeout=120)[0] == "started\n"
    assert sorted(p.name for p in locks.iterdir()) == ["peagle-engine-start-gpu3.lock", "peagle-engine-start-gpu5.lock"]


def test_engines_summary_names_the_engines_that_answered_and_those_that_did_not():
    """4x H200, 2026-11-28: 8 engines asked for, 4 placed; the stage says so instead of leaving it to a probe."""
    engines = [{"start_s": s, "ready_at": 1000.0 + s, "gpu": g}
               for s, g in ((96.0, "a/0"), (97.2, "a/0"), (101.0, "b/2"), (215.4, "b/2"))]
    rate = engine_pool.decode_tokens_per_s(engines, 7_173_100, answered_at=1196.0)  # 100 s after the first ready
    assert rate == 71731.0
    assert engine_pool.engines_summary(engines, rate, asked=8) == (
        "; 4 engines of 8 asked for answered (on 2 GPUs), ready 96-215 s after they were asked for; 71,731 tokens/s "
        "from the first ready to the last answer")
    assert engine_pool.engines_summary(engines, rate, asked=4).startswith("; 4 engines answered (on 2 GPUs)")
    assert engine_pool.engines_summary([], None) == ""
    assert engine_pool.decode_tokens_per_s([], 10, answered_at=5.0) is None


def test_engines_sharing_a_cuda_gpu_start_side_by_side_with_a_fixed_kv_cache(tmp_path, monkeypatch):
    """start_engine: on CUDA, engines sharing a GPU get kv_cache_memory_bytes (their share less weights and reserve)
    and take no start lock; a failed start is retried under the lock with vLLM's own sizing; without CUDA, or for an
    engine alone on its GPU, nothing changes."""
    import torch

    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"\0" * 1000)
    locks = tmp_path / "locks"
    locks.mkdir()
    monkeypatch.setattr(engine_pool, "GPU_START_LOCK_DIR", locks)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    calls = []

    def make(fail_with_kv=False, **kw):
        calls.append(kw)
        if fail_with_kv and "kv_cache_memory_bytes" in kw:
            raise RuntimeError("CUDA out of memory")
        return "engine"

    kwargs = {"gpu_memory_utilization": 0.4, "max_num_seqs": 256}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert engine_pool.start_engine(make, model, 2, kwargs) == "engine" and calls == [kwargs]
    assert [p.name for p in locks.iterdir()] == ["peagle-engine-start-gpu1.lock"]  # one after another
    (locks / "peagle-engine-start-gpu1.lock").unlink()

    gib = 2**30
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (100 * gib, 140 * gib))
    calls.clear()
    assert engine_pool.start_engine(make, model, 2, kwargs) == "engine"
    assert calls == [kwargs | {"kv_cache_memory_bytes": int(140 * gib * 0.4) - 1000 - 8 * gib}]
    assert not list(locks.iterdir())  # side by side: no lock taken
    calls.clear()
    assert engine_pool.start_engine(partial(make, fail_with_kv=True), model, 2, kwargs) == "engine"
    assert calls == [kwargs | {"kv_cache_memory_bytes": int(140 * gib * 0.4) - 1000 - 8 * gib}, kwargs]
    assert [p.name for p in locks.iterdir()] == ["peagle-engine-start-gpu1.lock"]  # the retry waited its turn
    calls.clear()
    assert engine_pool.start_engine(make, model, 1, {"max_num_seqs": 256}) == "engine"
    assert calls == [{"max_num_seqs": 256}]
    with pytest.raises(ValueError, match="lower regenerate.engines_per_gpu"):
        engine_pool.shared_kv_cache_bytes(16 * gib, 0.4, 2 * gib)


def test_conversations_go_to_the_engines_longest_chains_first():
    """``longest_chains_first``: most answered user turns first (capped at ``max_turns``), ties in input order; the
    replay of ``bench.regen_batch_replay`` runs a batch as long as its longest chain."""
    from bench.regen_batch_replay import replay

    def conv(i, turns):
        msgs = [m for t in range(turns) for m in ({"role": "user", "content": f"{i}.{t}"},
                                                   {"role": "assistant", "content": "-"})]
        return {"id": str(i), "messages": msgs}

    rows = [conv(0, 1), conv(1, 5), conv(2, 2), conv(3, 1), conv(4, 3)]
    got = regenerate.longest_chains_first(rows, RegenerateConfig(max_turns=3))
    assert [r["id"] for r in got] == ["1", "4", "2", "0", "3"]  # 5 turns counts as 3: before 4 (input order)
    assert replay([[3], [1, 1]], max_num_seqs=2) == (3, 5)  # the second chain's turns run beside the first
    assert replay([[3], [1, 1]], max_num_seqs=1) == (5, 5)
    assert replay([[4], [1], [1], [1], [1]], max_num_seqs=8) == (4, 8)  # the batch lasts its longest chain
