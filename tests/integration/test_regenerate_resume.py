"""A regenerate run killed mid-stage (SIGKILL of its process) keeps the batches it finished: the next run takes them
from their parts and regenerates only the rest (SmolLM2 on the transformers engine, in-process, float32)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from pipelines.data.parts import PART_GLOB
from pipelines.data.prompts import load_conversations
from pipelines.data.regenerate import run_regenerate
from pipelines.recipe import DataConfig, RegenerateConfig, SourceConfig, TargetConfig

pytestmark = pytest.mark.integration
NUM, BATCH = 12, 2
CFG = {"backend": "transformers", "batch_size": BATCH, "max_turns": 1, "max_tokens_per_turn": 40, "temperature": 0.0}
RUN = """
import json, sys
from pipelines.data.prompts import load_conversations
from pipelines.data.regenerate import run_regenerate
from pipelines.recipe import DataConfig, RegenerateConfig, SourceConfig, TargetConfig
convos = load_conversations(SourceConfig(kind="sharegpt", num_samples={num}), seed=7)
run_regenerate(convos, TargetConfig(), RegenerateConfig(**json.loads(sys.argv[1])), DataConfig(max_length_tokens=512),
               use_ray=False, parts_dir=sys.argv[2])
"""


def test_a_killed_run_resumes_from_the_batches_it_finished(tmp_path):
    parts = tmp_path / "parts"
    proc = subprocess.Popen([sys.executable, "-c", RUN.format(num=NUM), json.dumps(CFG), str(parts)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ))
    deadline = time.monotonic() + 300
    while len(list(parts.glob(PART_GLOB))) < 2:
        assert proc.poll() is None, "the run ended before it could be killed"
        assert time.monotonic() < deadline, "no two parts within 300 s"
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    before = {p.name: p.read_text() for p in parts.glob(PART_GLOB)}
    assert 2 <= len(before) < NUM // BATCH
    kept = {i for text in before.values() for i in json.loads(text)["ids"]}

    convos = load_conversations(SourceConfig(kind="sharegpt", num_samples=NUM), seed=7)
    res = run_regenerate(convos, TargetConfig(), RegenerateConfig(**CFG), DataConfig(max_length_tokens=512),
                         use_ray=False, parts_dir=parts)
    assert res.stats["resumed_conversations"] == len(kept)
    assert res.stats["num_conversations"] == NUM  # the resumed ones and this run's, each once
    got = [r["id"] for r in res.rows]
    assert got == [c["id"] for c in convos if c["id"] in set(got)]  # input order
    assert len(got) + res.stats.get("dropped_no_response", 0) == NUM
    resumed_rows = {r["id"]: r for text in before.values() for r in json.loads(text)["rows"]}
    assert all(r == resumed_rows[r["id"]] for r in res.rows if r["id"] in kept)  # taken as written, not redone
    assert all(p.read_text() == text for p in parts.glob(PART_GLOB) if (text := before.get(p.name)))
    assert len(list(parts.glob(PART_GLOB))) == NUM // BATCH
