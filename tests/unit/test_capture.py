"""pipelines.capture without Ray: loss masks, length handling, hidden states, resume after a crash."""

import json
import sys
from collections import Counter

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from peagle_core import shards
from peagle_core.samples import HIDDEN_DTYPES, SAMPLE_KEYS, dtype_name, validate_sample
from peagle_core.vocab import TOKEN_COUNTS_NAME, load_token_counts
from pipelines import capture
from pipelines.capture import forward as capture_forward
from pipelines.capture import materialize
from pipelines.capture import tokenize as capture_tokenize
from pipelines.capture.actors import CaptureShardActor
from pipelines.capture.rows import ragged_from_arrow
from pipelines.recipe import CaptureConfig, DataConfig, TargetConfig
from tests.unit.conftest import tiny_target_config

pytestmark = pytest.mark.unit

WORDS = [
    "system", "user", "assistant", "hi", "hello", "how", "are", "you", "fine", "thanks", "bye", "what", "is", "two",
    "plus", "three", "five", "the", "a", "an", "question", "answer", "yes", "no", "ok", "good", "bad", "one",
    "four", "six", "seven", "eight", "nine", "ten",
]
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Same rendering, with {% generation %} around what the assistant generates.
CHATML_GEN = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}{{'<|im_start|>assistant\n'}}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}{% else %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LAYER_IDS = (1, 2, 4)


def tiny_tokenizer(template: str = CHATML) -> PreTrainedTokenizerFast:
    vocab = {"<unk>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    for w in WORDS + ["?", "!", ".", ","]:
        vocab.setdefault(w, len(vocab))
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<|im_start|>",
                                  eos_token="<|im_end|>", pad_token="<|im_end|>")
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = template
    return tok


def convo(cid: str, *turns: str) -> dict:
    roles = ["user", "assistant"]
    return {"id": cid, "messages": [{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)]}


CONVOS = [
    convo("c0", "hi how are you ?", "fine thanks !", "what is two plus three ?", "five ."),
    convo("c1", "hello", "hi"),
    convo("c2", "question", "yes no ok good bad one four six seven eight nine ten the a an", "bye"),
    convo("c3", "one two", "three four five six"),
    convo("c4", "what", "is"),
]


@pytest.fixture
def tok():
    return tiny_tokenizer()


@pytest.fixture
def model():
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_target_config()).eval()


def decode_masked(tok, ids, mask):
    return tok.convert_ids_to_tokens([i for i, m in zip(ids, mask) if m])


def test_loss_mask_covers_assistant_content_and_end_of_turn(tok):
    ids, mask = capture.tokenize_conversation(tok, CONVOS[0]["messages"])
    assert decode_masked(tok, ids, mask) == ["fine", "thanks", "!", "<|im_end|>", "five", ".", "<|im_end|>"]
    assert ids == tok.apply_chat_template(CONVOS[0]["messages"], tokenize=True, return_dict=True)["input_ids"]


def test_prefix_diff_matches_generation_tags(tok):
    gen = tiny_tokenizer(CHATML_GEN)
    for c in CONVOS:
        assert capture.tokenize_conversation(tok, c["messages"]) == capture.tokenize_conversation(gen, c["messages"])


def test_trailing_user_turn_is_cut(tok):
    ids, mask = capture.tokenize_conversation(tok, CONVOS[2]["messages"])
    assert tok.convert_ids_to_tokens(ids)[-1] == "<|im_end|>" and mask[-1] == 1


def test_drops_and_truncation_are_counted(tok):
    rows = [
        convo("empty", "hi", "  "),
        convo("noasst", "hi"),
        convo("long", "hi " * 30, "ok"),
        convo("fine", "hi", "ok"),
    ]
    stats = Counter()
    out = capture.prepare_samples(tok, rows, max_length_tokens=20, on_too_long="truncate", stats=stats)
    assert [s[0] for s in out] == ["fine"]
    assert stats["dropped_empty_assistant_turn"] == 1 and stats["dropped_no_assistant_turn"] == 1
    assert stats["dropped_no_loss_tokens_after_truncation"] == 1 and stats["truncated"] == 1

    stats = Counter()
    rows[2] = convo("long", "hi", "ok " * 30)
    out = capture.prepare_samples(tok, rows, max_length_tokens=20, on_too_long="truncate", stats=stats)
    assert [(s[0], len(s[1])) for s in out] == [("long", 20), ("fine", 8)] and stats["truncated"] == 1
    stats = Counter()
    out = capture.prepare_samples(tok, rows, max_length_tokens=20, on_too_long="drop", stats=stats)
    assert [s[0] for s in out] == ["fine"] and stats["dropped_too_long"] == 1 and stats["truncated"] == 0
    with pytest.raises(ValueError, match="capture.on_too_long='cut'"):
        capture.prepare_samples(tok, rows, max_length_tokens=20, on_too_long="cut")


def test_template_errors():
    tok = tiny_tokenizer()
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat_template"):
        capture.tokenize_conversation(tok, CONVOS[1]["messages"])
    # a template that drops earlier assistant turns: prefixes are not prefixes of the full render
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}{{ '<|im_start|>' + m['role'] + "
        "'\n' + m['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    with pytest.raises(ValueError, match="not prefix-stable"):
        capture.tokenize_conversation(tok, CONVOS[0]["messages"])


def test_capture_batch_equals_direct_forward(model, tok):
    cfg = CaptureConfig(batch_size=2, dtype="float32")
    stats = Counter()
    out = capture.capture_batch(model, tok, CONVOS, cfg, LAYER_IDS, max_length_tokens=64, stats=stats)
    assert [s["sample_id"] for s in out] == [c["id"] for c in CONVOS]  # input order, whatever the grouping
    assert stats["num_samples"] == 5 and stats["num_tokens"] == sum(len(s["input_ids"]) for s in out)
    for s in out:
        ids = s["input_ids"].long()[None]
        with torch.no_grad():
            hs = model(ids, output_hidden_states=True).hidden_states
        want_aux = torch.cat([hs[i] for i in LAYER_IDS], -1)[0]
        torch.testing.assert_close(s["aux"], want_aux, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(s["final_hidden"], hs[-1][0], rtol=1e-5, atol=1e-5)  # HF last = after norm
        logits = model.lm_head(s["final_hidden"])
        torch.testing.assert_close(logits, model(ids).logits[0], rtol=1e-4, atol=1e-4)
        validate_sample(s, hidden_size=36, dtype="float32")


def test_capture_batch_dtype_and_nan(model, tok):
    out = capture.capture_batch(model, tok, CONVOS[:2], CaptureConfig(dtype="bfloat16"), LAYER_IDS)
    assert out[0]["aux"].dtype == torch.bfloat16 and out[0]["aux"].shape[1] == 3 * 36
    with torch.no_grad():
        model.model.layers[3].mlp.down_proj.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="sample 'c0': final_hidden holds .* NaN/Inf"):
        capture.capture_batch(model, tok, CONVOS[:1], CaptureConfig(dtype="float32"), (1, 2, 3))


def test_length_batches():
    assert capture.length_batches([3, 9, 1, 9, 4], 2) == [[1, 3], [4, 0], [2]]


# ------------------------------------------------------------------------------ two stages: tokenize, model step


def previous_capture_batch(model, tokenizer, rows, cfg, layer_ids, *, max_length_tokens=None, stats=None):
    """capture_batch as it was before the tokenize / model-step split (per-sample padding loops,
    synchronous ``.to(dtype).cpu()``, one clone per sample): the CPU reference."""
    from peagle_core.target import target_forward

    stats = stats if stats is not None else Counter()
    dtype = HIDDEN_DTYPES[dtype_name(cfg.dtype)]
    prepared = capture.prepare_samples(tokenizer, rows, max_length_tokens=max_length_tokens,
                                       on_too_long=cfg.on_too_long, stats=stats)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    results = [None] * len(prepared)
    for batch in capture.length_batches([len(p[1]) for p in prepared], cfg.batch_size):
        t_max = len(prepared[batch[0]][1])
        ids = torch.full((len(batch), t_max), pad_id, dtype=torch.long)
        attn = torch.zeros((len(batch), t_max), dtype=torch.long)
        for b, i in enumerate(batch):
            n = len(prepared[i][1])
            ids[b, :n] = torch.tensor(prepared[i][1])
            attn[b, :n] = 1
        with torch.inference_mode():
            out = target_forward(model, ids, tuple(layer_ids), attention_mask=attn, return_logits=False)
        aux, fin = out.aux.to(dtype).cpu(), out.final_hidden.to(dtype).cpu()
        for b, i in enumerate(batch):
            sid, tok, mask = prepared[i]
            n = len(tok)
            results[i] = {"sample_id": sid, "input_ids": torch.tensor(tok, dtype=torch.int32),
                          "loss_mask": torch.tensor(mask, dtype=torch.uint8), "aux": aux[b, :n].clone(),
                          "final_hidden": fin[b, :n].clone()}
            stats["num_samples"] += 1
            stats["num_tokens"] += n
            stats["num_loss_tokens"] += int(sum(mask))
    return [r for r in results if r is not None]


def assert_same_samples(got, want):
    assert [s["sample_id"] for s in got] == [s["sample_id"] for s in want]
    for g, w in zip(got, want):
        for key in SAMPLE_KEYS:
            assert g[key].dtype == w[key].dtype and g[key].shape == w[key].shape, (g["sample_id"], key)
            assert torch.equal(g[key], w[key]), (g["sample_id"], key)  # bit for bit


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("batch_size", [1, 3, 7])
def test_capture_is_bit_identical_to_previous_path(model, tok, dtype, batch_size):
    rows = many_convos(11) + [convo("long", "hi " * 9, "ok " * 12), convo("empty", "hi", " ")]
    cfg = CaptureConfig(batch_size=batch_size, dtype=dtype)
    want_stats, got_stats = Counter(), Counter()
    want = previous_capture_batch(model, tok, rows, cfg, LAYER_IDS, max_length_tokens=17, stats=want_stats)
    got = capture.capture_batch(model, tok, rows, cfg, LAYER_IDS, max_length_tokens=17, stats=got_stats)
    assert_same_samples(got, want)
    assert got_stats == want_stats and got_stats["truncated"] >= 1 and got_stats["dropped_empty_assistant_turn"] == 1
    # the two halves on their own give the same, and the samples are plain (autograd-usable) contiguous tensors
    tokenized = capture.tokenize_rows(tok, rows, max_length_tokens=17)
    split = capture.capture_tokenized(model, tokenized, cfg, LAYER_IDS, pad_token_id=tok.pad_token_id,
                                      max_length_tokens=17)
    assert_same_samples(split, want)
    for s in split:
        assert not s["aux"].is_inference() and s["aux"].is_contiguous() and s["final_hidden"].is_contiguous()
        validate_sample(s, hidden_size=36, dtype=dtype, max_length=17)


def test_tokenized_rows_are_checked_before_the_forward(model, tok, monkeypatch):
    tokenized = capture.tokenize_rows(tok, CONVOS[:3], max_length_tokens=None)
    monkeypatch.setattr(capture_forward, "target_forward", lambda *a, **k: pytest.fail("forward ran on bad input"))
    bad = [dict(r) for r in tokenized]
    bad[1]["loss_mask"] = np.zeros_like(bad[1]["loss_mask"])
    with pytest.raises(ValueError, match="sample 'c1': loss_mask is all zero"):
        capture.capture_tokenized(model, bad, CaptureConfig(), LAYER_IDS)
    with pytest.raises(ValueError, match=r"sample 'c0': \d+ tokens > max_length_tokens=5"):
        capture.capture_tokenized(model, tokenized, CaptureConfig(), LAYER_IDS, max_length_tokens=5)
    bad = [dict(r) for r in tokenized]
    bad[2]["loss_mask"] = bad[2]["loss_mask"][:-1]
    with pytest.raises(ValueError, match="sample 'c2': loss_mask shape"):
        capture.capture_tokenized(model, bad, CaptureConfig(), LAYER_IDS)
    assert capture.capture_tokenized(model, [], CaptureConfig(), LAYER_IDS) == []


def test_tokenize_stages_round_trip_through_arrow(tok, target_dir):
    import pyarrow as pa

    capture_tokenize._cached_tokenizer.cache_clear()
    rows = many_convos(6) + [convo("noasst", "hi")]
    kw = {"tokenizer_path": str(target_dir), "max_length_tokens": 17, "on_too_long": "truncate"}
    want = capture.tokenize_rows(tok, rows, max_length_tokens=17)
    table = capture.tokenize_conversations(pa.Table.from_pylist(rows), **kw)
    assert table.schema.field("input_ids").type == pa.list_(pa.int32())
    got = capture.tokenized_from_batch(table)
    assert [r["sample_id"] for r in got] == [r["sample_id"] for r in want] == [r["id"] for r in rows[:6]]
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g["input_ids"], w["input_ids"])
        assert g["loss_mask"].dtype == np.uint8 and np.array_equal(g["loss_mask"], w["loss_mask"])
    numpy_batch = {k: np.array(table.column(k).to_pylist(), dtype=object) for k in table.column_names}
    assert [list(r["input_ids"]) for r in capture.tokenized_from_batch(numpy_batch)] == [
        list(r["input_ids"]) for r in want]
    assert capture.tokenized_from_batch(capture.tokenize_conversations(pa.Table.from_pylist(rows[-1:]), **kw)) == []

    rows = capture.conversation_rows(rows)  # as run_capture makes shard tasks: with sample_id
    tasks = pa.table({"shard_index": [3, 4], "conversations": [json.dumps(rows[:4]), json.dumps(rows[4:])]})
    shard_rows = capture.tokenize_shard_tasks(tasks, **kw)
    assert shard_rows.column("shard_index").to_pylist() == [3, 4]
    assert json.loads(shard_rows.column("conversation_ids")[1].as_py()) == [r["id"] for r in rows[4:]]
    assert json.loads(shard_rows.column("tokenize_stats")[1].as_py())["dropped_no_assistant_turn"] == 1
    assert shard_rows.column("sample_id")[1].as_py() == [r["id"] for r in rows[4:6]]
    second = ragged_from_arrow(shard_rows.column("input_ids")[1].values)
    assert [list(a) for a in second] == [list(w["input_ids"]) for w in want[4:]]


# ------------------------------------------------------------------------------ materialized, in-process


@pytest.fixture
def target_dir(tmp_path, model):
    d = tmp_path / "tiny-target"
    model.save_pretrained(d)
    tiny_tokenizer().save_pretrained(d)
    return d


def cfgs(target_dir, **capture_kw):
    return (TargetConfig(model=str(target_dir), aux_layer_ids=LAYER_IDS),
            CaptureConfig(dtype="float16", batch_size=2, shard_size_samples=2, **capture_kw),
            DataConfig(max_length_tokens=64))


def many_convos(n: int) -> list[dict]:
    return [dict(c, id=f"{c['id']}-{i}") for i in range(n // len(CONVOS) + 1) for c in CONVOS][:n]


class CrashBeforeThirdShard(CaptureShardActor):
    """Test-only shard actor: writes two shards, then leaves a partial temp file behind and raises, as a
    process killed while writing its third shard would. Swapped in for ``CaptureShardActor`` with
    monkeypatch; defined at module level so Ray workers import it by name (tests/integration too)."""

    num_shards_before_crash = 2

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.num_written = 0

    def write_shard(self, batch, r):
        name = shards.shard_name(int(batch.column("shard_index")[r].as_py()))
        if self.num_written >= self.num_shards_before_crash:
            (self.out_dir / f".{name}.crash.tmp").write_bytes(b"partial shard")
            raise RuntimeError(f"injected crash before writing {name}")
        written = super().write_shard(batch, r)
        self.num_written += 1
        return written


def test_run_capture_local_and_resume_after_crash(tmp_path, target_dir, monkeypatch):
    rows = many_convos(7) + [convo("empty", "hi", "")]  # 8 conversations -> 4 shards, one drop
    t, c, d = cfgs(target_dir)
    ref = capture.run_capture(rows, t, c, d, tmp_path / "ref", use_ray=False)
    assert (ref.num_samples, ref.num_shards, ref.dropped["empty_assistant_turn"]) == (7, 4, 1)
    ref_manifest = shards.load_manifest(tmp_path / "ref").to_pylist()
    meta = shards.load_capture_meta(tmp_path / "ref")
    assert meta["aux_layer_ids"] == list(LAYER_IDS) and meta["hidden_size"] == 36 and meta["dtype"] == "float16"
    assert meta["bytes_per_token"] == 4 + 1 + 4 * 36 * 2
    lengths = [r["length"] for r in ref_manifest]
    assert meta["length_distribution"]["max"] == max(lengths)
    assert meta["length_distribution"]["share_over"]["1024"] == 0.0  # max_length_tokens=64
    prof = meta["profile"]  # one in-process actor: its start once, then 4 shards' forward and write
    assert prof["num_actors"] == 1 and prof["forward_s"] > 0 and prof["write_s"] > 0 and prof["actor_start_s"] > 0
    # The model's time line: its start, then idle (wait) and forward, one after another, inside the run. A shard's
    # write happens while the model is idle, so wait_s holds it too here (one shard at a time): forward + write +
    # wait exceeded run_s on a loaded disk (a fresh clone's unit tests after the integration suite, 2026-12-07).
    model = prof["actor_start_s"] + prof["wait_s"] + prof["forward_s"]
    assert model <= prof["run_s"] + 0.01 and prof["write_s"] <= prof["run_s"]
    assert prof["steady_tokens_per_s"] == pytest.approx(ref.num_tokens / (prof["run_s"] - prof["actor_start_s"]))

    out = tmp_path / "crashed"
    with monkeypatch.context() as m:
        m.setattr(materialize, "CaptureShardActor", CrashBeforeThirdShard)
        with pytest.raises(RuntimeError, match="injected crash before writing shard-00002"):
            capture.run_capture(rows, t, c, d, out, use_ray=False)
    assert sorted(p.name for p in out.iterdir()) == [".shard-00002.safetensors.crash.tmp",
                                                     "shard-00000.safetensors", "shard-00001.safetensors"]
    before = (out / "shard-00000.safetensors").stat().st_mtime_ns
    # also corrupt a finished shard: resume must rewrite it, not trust it
    raw = bytearray((out / "shard-00001.safetensors").read_bytes())
    raw[-3] ^= 0xFF
    (out / "shard-00001.safetensors").write_bytes(bytes(raw))
    seen: list[int] = []
    res = capture.run_capture(rows, t, c, d, out, use_ray=False, progress=seen.append)
    assert res.num_shards_reused == 1
    assert seen[0] == 2 and sum(seen) == len(rows)  # the kept shard counts first, then each written one
    assert (out / "shard-00000.safetensors").stat().st_mtime_ns == before  # kept, not recomputed
    assert shards.load_manifest(out).to_pylist() == ref_manifest  # nothing lost, nothing duplicated
    assert not list(out.glob(".*tmp"))
    again = capture.run_capture(rows, t, c, d, out, use_ray=False)
    assert again.num_shards_reused == 4 and shards.load_manifest(out).to_pylist() == ref_manifest
    kept = (out / "shard-00000.safetensors").stat().st_mtime_ns
    forced = capture.run_capture(rows, t, c, d, out, use_ray=False, reuse_shards=False)  # the stage's --force
    assert forced.num_shards_reused == 0 and (out / "shard-00000.safetensors").stat().st_mtime_ns != kept
    assert shards.load_manifest(out).to_pylist() == ref_manifest
    got = list(shards.iter_samples(out))
    assert [s["sample_id"] for s in got] == [r["sample_id"] for r in ref_manifest]
    counts = load_token_counts(out / TOKEN_COUNTS_NAME)
    assert int(counts.sum()) == sum(int(s["loss_mask"].sum()) for s in got)
    tokenized = capture.tokenize_rows(tiny_tokenizer(), capture.conversation_rows(rows), max_length_tokens=64)
    assert torch.equal(counts, capture.count_assistant_tokens(tokenized, 99))


def test_run_capture_refuses_other_settings(tmp_path, target_dir):
    t, c, d = cfgs(target_dir)
    capture.run_capture(many_convos(3), t, c, d, tmp_path / "cap", use_ray=False)
    manifest = (tmp_path / "cap" / shards.MANIFEST_NAME).read_bytes()
    t2 = TargetConfig(model=str(target_dir), aux_layer_ids=(1, 2, 3))
    with pytest.raises(ValueError, match="captured with other settings.*aux_layer_ids"):
        capture.run_capture(many_convos(3), t2, c, d, tmp_path / "cap", use_ray=False)
    assert (tmp_path / "cap" / shards.MANIFEST_NAME).read_bytes() == manifest  # nothing lost


def test_vllm_backend_without_vllm_fails_before_compute(tmp_path, target_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` fails, as where it is absent
    t, c, d = cfgs(target_dir, backend="vllm")
    with pytest.raises(ValueError, match="capture.backend=vllm but vllm is not installed"):
        capture.run_capture(many_convos(2), t, c, d, tmp_path / "x", use_ray=False)
    assert not (tmp_path / "x").exists()


def test_samples_to_columns_ragged(model, tok):
    out = capture.capture_batch(model, tok, CONVOS[:3], CaptureConfig(dtype="bfloat16"), LAYER_IDS)
    cols = capture.samples_to_columns(out)
    assert list(cols["sample_id"]) == ["c0", "c1", "c2"]
    assert [a.shape for a in cols["aux"]] == [(len(s["input_ids"]), 108) for s in out]
    assert cols["aux"][0].dtype.name == "float32"  # bf16 carried exactly as float32
    assert json.dumps(list(cols["sample_id"]))


def test_a_shard_is_written_while_the_next_is_captured(tmp_path, target_dir, monkeypatch):
    """Two calls at once on one shard actor (a threaded Ray actor's ``SHARDS_IN_FLIGHT``): the forwards never overlap
    (one model), and the second shard's forward runs while the first shard's file is written."""
    import time

    import pyarrow as pa

    t, c, d = cfgs(target_dir)
    rows = many_convos(4)  # two shards of two
    spans: dict[str, list[tuple[float, float]]] = {"forward": [], "write": []}

    def timed(kind, fn, pause_s):
        def wrapped(*args, **kwargs):
            t0 = time.monotonic()
            time.sleep(pause_s)  # long enough that the two shards' phases could not line up by chance
            out = fn(*args, **kwargs)
            spans[kind].append((t0, time.monotonic()))
            return out
        return wrapped

    def two_at_once(tasks, pending, actor_args, actor_kwargs, tokenize_kwargs):
        """``_capture_in_process`` with two shard tasks in flight on one actor, as its threaded Ray actor runs."""
        from concurrent.futures import ThreadPoolExecutor

        worker = CaptureShardActor(*actor_args, **actor_kwargs)
        monkeypatch.setattr(worker, "capture", timed("forward", worker.capture, 0.3))
        batches = [capture_tokenize.tokenize_shard_tasks(
            pa.table({"shard_index": [k], "conversations": [json.dumps(tasks[k])]}), **tokenize_kwargs) for k in pending]
        with ThreadPoolExecutor(CaptureShardActor.SHARDS_IN_FLIGHT) as pool:
            for res in pool.map(worker, batches):
                yield {key: v[0] for key, v in res.items()}

    capture.run_capture(rows, t, c, d, tmp_path / "one-at-a-time", use_ray=False)
    monkeypatch.setattr(materialize, "_capture_in_process", two_at_once)
    monkeypatch.setattr(shards, "write_shard", timed("write", shards.write_shard, 1.0))
    capture.run_capture(rows, t, c, d, tmp_path / "two-at-once", use_ray=False)
    (f0, f1), (w0, _) = sorted(spans["forward"]), sorted(spans["write"])
    assert f0[1] <= f1[0]  # one forward at a time
    assert f1[0] < w0[1]  # the second forward began before the first shard was on disk
    assert (shards.load_manifest(tmp_path / "two-at-once").to_pylist()
            == shards.load_manifest(tmp_path / "one-at-a-time").to_pylist())


def test_ray_gpu_actors_overlap_writes_and_match_the_in_process_capture(tmp_path, target_dir):
    """Through Ray Data with a GPU declared (the threaded actor pool of GPU machines; the model runs on CPU here): the
    same manifest as the in-process capture, and no deadlock between the tokenize tasks and the actor."""
    import ray

    t, c, d = cfgs(target_dir)
    rows = many_convos(8)
    want = capture.run_capture(rows, t, c, d, tmp_path / "in-process", use_ray=False)
    ray.init(address="local", num_cpus=2, num_gpus=1, include_dashboard=False, log_to_driver=False)
    try:
        got = capture.run_capture(rows, t, c, d, tmp_path / "ray", num_cpus_per_worker=1, num_gpus_per_worker=1)
    finally:
        ray.shutdown()
    assert got.num_shards == want.num_shards == 4
    assert shards.load_manifest(tmp_path / "ray").to_pylist() == shards.load_manifest(tmp_path / "in-process").to_pylist()
    assert got.meta["profile"]["num_actors"] == 1


def test_length_distribution_counts_samples_longer_than_each_threshold():
    from pipelines.data.lengths import length_distribution

    got = length_distribution([100] * 90 + [3000] * 5 + [5000] * 5)
    assert got["max"] == 5000 and got["p50"] == 100
    assert got["share_over"] == {"1024": 0.1, "2048": 0.1, "4096": 0.05}
    assert length_distribution([]) == {}
    assert length_distribution([1, 2], sampled_from=10)["of"] == 10


def test_conversation_lengths_tokenize_a_seeded_sample():
    from pipelines.data.lengths import conversation_lengths

    tok, rows = tiny_tokenizer(), many_convos(30)
    every = conversation_lengths(rows, tok, sample=100)
    assert every == [len(tok(tok.apply_chat_template(r["messages"], tokenize=False), add_special_tokens=False)
                         ["input_ids"]) for r in rows]
    assert min(every) > 5  # tokens, not the keys of an encoding
    some = conversation_lengths(rows, tok, sample=10, seed=1)
    assert len(some) == 10 and some == conversation_lengths(rows, tok, sample=10, seed=1) and set(some) <= set(every)
