"""``bench.harness.OnlineRun``'s epochs (the online capture of the scaling runs): the same samples in the same order
as capturing the permuted conversations whole, the rows tokenization drops left out, and a resume that enters
the epoch at its data position runs the target only from that position's chunk on (before, a resume at step 700
of a 99k-conversation run captured ~28k conversations only to skip them: ~3 minutes of each call on an H100)."""

from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from bench.harness import OnlineRun, tokenize_in_parallel
from pipelines import capture
from pipelines.recipe import CaptureConfig

from .test_capture import LAYER_IDS, convo, many_convos, model, tok  # noqa: F401 (fixtures)

pytestmark = pytest.mark.unit

MAX_LEN, CHUNK = 17, 4


def online_run(target, tokenizer, rows) -> OnlineRun:
    """An OnlineRun of ``rows`` with the capture settings the scaling recipe's sections give (duck-typed)."""
    samples = capture.tokenize_rows(tokenizer, rows, max_length_tokens=MAX_LEN)
    kept = {s["sample_id"] for s in samples}
    recipe = SimpleNamespace(capture=CaptureConfig(batch_size=3, dtype="float32"),
                             data=SimpleNamespace(max_length_tokens=MAX_LEN))
    plan = SimpleNamespace(drafter=SimpleNamespace(aux_layer_ids=LAYER_IDS))
    return OnlineRun(recipe=recipe, plan=plan, drafter=None, lm_head=torch.zeros(1), objective=None, model=target,
                     tokenizer=tokenizer, samples=samples, sample_rows=[i for i, r in enumerate(rows) if r["id"] in kept],
                     num_rows=len(rows), chunk=CHUNK)


def test_epoch_is_the_permuted_capture_and_a_resume_captures_from_its_chunk(model, tok):  # noqa: F811
    rows = many_convos(13) + [convo("empty", "hi", " ")]  # the last row has no assistant token: dropped
    run = online_run(model, tok, rows)
    assert len(run.samples) == 13 and run.sample_rows == list(range(13))
    epoch = run.samples_for_epoch(1)
    perm = torch.randperm(len(rows), generator=torch.Generator().manual_seed(1)).tolist()
    want = capture.capture_batch(model, tok, [rows[i] for i in perm], run.recipe.capture, LAYER_IDS,
                                 max_length_tokens=MAX_LEN, validate=False)
    got = list(epoch)
    assert len(epoch) == len(got) == len(want) == 13
    for g, w in zip(got, want, strict=True):
        assert g["sample_id"] == w["sample_id"]
        for key in ("input_ids", "loss_mask", "aux", "final_hidden"):
            torch.testing.assert_close(g[key], w[key], rtol=1e-5, atol=1e-5)
    assert run.samples_for_epoch(1).order == epoch.order and run.samples_for_epoch(2).order != epoch.order

    captured = Counter()
    hook = model.model.embed_tokens.register_forward_hook(  # the target forward: rows [B, T] it embeds
        lambda m, args, out: captured.update(rows=int(args[0].shape[0])))
    try:
        resumed = run.samples_for_epoch(1)
        skip = 2 * CHUNK + 1  # the trainer's Trainer._remaining reads a sequence from the saved position on
        tail = [resumed[i] for i in range(skip, len(resumed))]
    finally:
        hook.remove()
    assert [s["sample_id"] for s in tail] == [s["sample_id"] for s in got[skip:]]
    assert captured["rows"] == len(rows) - 1 - 2 * CHUNK  # the samples of chunks 2.. only, each captured once
    with pytest.raises(IndexError):
        resumed[len(resumed)]


def test_tokenizing_in_worker_processes_gives_the_one_process_list(tmp_path, tok):  # noqa: F811
    rows = many_convos(23)
    rows.insert(7, convo("empty", "hi", " "))  # dropped in its slice, as in one call
    tok.save_pretrained(tmp_path / "tok")
    want = capture.tokenize_rows(tok, rows, max_length_tokens=MAX_LEN)
    got = tokenize_in_parallel(str(tmp_path / "tok"), rows, max_length_tokens=MAX_LEN, on_too_long="truncate",
                               workers=2, min_rows=0)
    assert [s["sample_id"] for s in got] == [s["sample_id"] for s in want] and len(got) == 23
    for g, w in zip(got, want, strict=True):
        assert (g["input_ids"] == w["input_ids"]).all() and (g["loss_mask"] == w["loss_mask"]).all()
