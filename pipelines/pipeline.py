"""The main job: run the stages of one recipe, prompts → served P-EAGLE head.

::

    prompts ─► regenerate ─► capture ─► train ─► evaluate ─► register ─► serve
    (datasets)  (Ray Data     (Ray Data   (Ray     (vLLM:     (MLflow:    (Ray Serve LLM,
                 + vLLM)       actors)     Train)   AL, tok/s) version,    parallel drafting)
                                                                gate)

Each stage is the plain function of its module (``pipelines.<stage>``); this module only wires
them, records what each produced and skips work already done. Everything lives under one run
directory (default ``$PEAGLE_HOME/runs/<recipe.name>``)::

    regenerate/conversations.jsonl   capture/<key>/ (shards + manifest.parquet)   train/head/
    ray_results/ (Ray Train checkpoints)   evaluate/table.json   <stage>/stage.json   summary.json

Skipping: every stage has a *key* = sha256 of the recipe sections it reads plus its upstream
stage's key. A stage is skipped when its ``stage.json`` holds the same key and its outputs are still
there (regenerated rows, a capture manifest, an exported head that validates, an eval table, a
registered model version tagged with the key, a RUNNING Serve app of the same version);
``force`` re-runs it. Interrupted work resumes inside the stage: capture keeps verified shards,
Ray Train resumes from the latest checkpoint of the same run name (the train key).

Streaming (``capture.streaming: true``): no capture stage on disk; the trainer consumes
``pipelines.capture.capture_stream`` directly (the target forward runs again each epoch). The
summary reports the bytes written under the run directory by capture+train (checkpoints and the
head only) next to what the materialized capture would have written.

Shape legend: not applicable (orchestration only; tensors live in the stage modules).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipelines.assets import peagle_home

if TYPE_CHECKING:
    from pipelines.recipe import Recipe

log = logging.getLogger("peagle.pipeline")

STAGES = ("regenerate", "capture", "train", "evaluate", "register", "serve")
STAGE_FILE = "stage.json"
SERVE_APP_NAME = "peagle"


# ---------------------------------------------------------------------------------------------- records


@dataclass
class StageRecord:
    """What one stage did: ``status`` ran|skipped|disabled, wall ``seconds`` (this run), its key and
    outputs (paths, counts, ids: JSON-able)."""

    name: str
    status: str
    seconds: float
    key: str
    outputs: dict[str, Any] = field(default_factory=dict)


def _digest(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def _tree_bytes(path: Path) -> int:
    if not path.exists():
        return 0
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text()) if path.is_file() else None


# ---------------------------------------------------------------------------------------------- run


class PipelineRun:
    """One pipeline run over ``recipe`` in ``run_dir``.

    Args:
        recipe: the validated recipe (``pipelines.recipe.load_recipe``).
        run_dir: default ``$PEAGLE_HOME/runs/<recipe.name>``.
        force: stage names to re-run even when their outputs are current (or True = all).
        stages: the stages to run, in pipeline order (default all). A stage whose upstream output
            is missing raises ValueError naming the stage to run first.

    Raises:
        ValueError: recipe settings the pipeline cannot honour (gate K not evaluated, serve K above
            the evaluated range with no head, ...), before any compute.
    """

    def __init__(self, recipe: Recipe, *, run_dir: str | os.PathLike | None = None,
                 force: bool | Iterable[str] = False, stages: Iterable[str] = STAGES,
                 print_fn: Callable[[str], None] = print) -> None:
        self.recipe = recipe
        self.run_dir = Path(run_dir) if run_dir else peagle_home() / "runs" / recipe.name
        self.stages = [s for s in STAGES if s in set(stages)]
        unknown = set(stages) - set(STAGES)
        if unknown:
            raise ValueError(f"unknown stage(s) {sorted(unknown)}; stages are {list(STAGES)}")
        self.force = set(STAGES) if force is True else set(force or ())
        self.records: dict[str, StageRecord] = {}
        self.print = print_fn
        self._check_recipe()
        self.tracking_uri = recipe.registry.resolved_tracking_uri()
        self.model_name = recipe.registry.resolved_model_name(recipe.target)

    # ------------------------------------------------------------------------------------------ checks

    def _check_recipe(self) -> None:
        r = self.recipe
        ev, reg = r.evaluation, r.registry
        if "peagle" not in ev.methods and r.training.method == "peagle" or (
                "eagle3" not in ev.methods and r.training.method == "eagle3"):
            raise ValueError(f"evaluation.methods={ev.methods} does not measure the trained head "
                             f"(training.method={r.training.method!r}); add it")
        if reg.gate_num_speculative_tokens not in ev.num_speculative_tokens_sweep:
            raise ValueError(
                f"registry.gate_num_speculative_tokens={reg.gate_num_speculative_tokens} is not in "
                f"evaluation.num_speculative_tokens_sweep={ev.num_speculative_tokens_sweep}: the gate compares "
                "ALs measured at its K; add it to the sweep")
        if r.capture.streaming and r.capture.num_workers > 1 and r.training.num_workers > 1:
            log.warning("streaming capture with several capture and train workers: both pools share the cluster")

    # ------------------------------------------------------------------------------------------ keys

    def key(self, stage: str) -> str:
        r = self.recipe
        sections = {
            # aux layer ids do not change the regenerated text: they key the capture only
            "regenerate": (r.target.model_dump(mode="json", exclude={"aux_layer_ids"}), r.data, r.regenerate),
            "capture": (r.capture, r.resolved_aux_layer_ids()),
            "train": (r.drafter, r.training),
            "evaluate": (r.evaluation,),
            "register": (r.registry,),
            "serve": (r.serving,),
        }
        i = STAGES.index(stage)
        upstream = self.key(STAGES[i - 1]) if i > 0 else ""
        dumped = [s.model_dump(mode="json") if hasattr(s, "model_dump") else s for s in sections[stage]]
        return _digest(stage, upstream, dumped)

    def stage_dir(self, stage: str) -> Path:
        return self.run_dir / stage

    def _done(self, stage: str) -> dict | None:
        rec = _read_json(self.stage_dir(stage) / STAGE_FILE)
        if not rec or rec.get("key") != self.key(stage):
            return None
        return rec

    def _save(self, rec: StageRecord) -> None:
        _write_json(self.stage_dir(rec.name) / STAGE_FILE, asdict(rec))

    # ------------------------------------------------------------------------------------------ driver

    def run(self) -> dict[str, Any]:
        """Run the selected stages; return the summary (also written to ``run_dir/summary.json``)."""
        import ray

        if not ray.is_initialized():
            # Inside `ray job submit` RAY_ADDRESS names the cluster. Outside, start a private local one
            # (never a bare ray.init(): it would join whatever a stale ray_current_cluster file names),
            # with 2 logical CPUs per core so a stage's actors, Ray Data tasks and the Train
            # controller never wait on each other on a laptop.
            address = os.environ.get("RAY_ADDRESS", "local")
            ray.init(address=address, **({"num_cpus": 2 * (os.cpu_count() or 1)} if address == "local" else {}))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "recipe.yaml").write_text(self.recipe.dump_resolved())
        self.print(f"peagle pipeline {self.recipe.name!r}: stages {self.stages}, run dir {self.run_dir}")
        t0 = time.perf_counter()
        steps = {"regenerate": self.stage_regenerate, "capture": self.stage_capture, "train": self.stage_train,
                 "evaluate": self.stage_evaluate, "register": self.stage_register, "serve": self.stage_serve}
        for stage in self.stages:
            cached = None if stage in self.force else self._cached(stage)
            if cached is not None:
                self.records[stage] = StageRecord(stage, "skipped", 0.0, cached["key"], cached["outputs"])
                self.print(f"[{stage}] skipped: outputs current (key {cached['key'][:10]}); --force to re-run")
                continue
            if stage != "serve":
                self._free_serve_cpus()
            self.print(f"[{stage}] running")
            s0 = time.perf_counter()
            outputs = steps[stage]()
            rec = StageRecord(stage, "ran", time.perf_counter() - s0, self.key(stage), outputs)
            self._save(rec)
            self.records[stage] = rec
            self.print(f"[{stage}] done in {rec.seconds:.1f}s")
        summary = self.summary(time.perf_counter() - t0)
        _write_json(self.run_dir / "summary.json", summary)
        self.print(format_summary(summary))
        return summary

    def _cached(self, stage: str) -> dict | None:
        rec = self._done(stage)
        if rec is None:
            return None
        check = getattr(self, f"_valid_{stage}")
        try:
            return rec if check(rec["outputs"]) else None
        except Exception as e:  # noqa: BLE001 - any failure to verify means: re-run the stage
            log.warning("%s outputs no longer valid (%s); re-running", stage, e)
            return None

    def upstream(self, stage: str) -> dict[str, Any]:
        """Outputs of ``stage`` from this run or an earlier one with the same key.

        Raises:
            ValueError: ``stage`` has not run with the current recipe (names the command to run).
        """
        if stage in self.records:
            return self.records[stage].outputs
        rec = self._cached(stage)
        if rec is None:
            raise ValueError(f"stage {stage!r} has no current outputs in {self.run_dir} for this recipe; run it "
                             f"first: python -m ray_jobs.{stage} --config <recipe> (or ray_jobs.pipeline)")
        return rec["outputs"]

    # ------------------------------------------------------------------------------------------ stages

    def _conversations(self):
        """Train / held-out prompt split of the recipe's sources (deterministic)."""
        from pipelines.prompts import load_prompt_dataset, train_eval_split

        ds = load_prompt_dataset(self.recipe.data)
        return train_eval_split(ds, self.recipe.data.eval_fraction, self.recipe.data.seed)

    def stage_regenerate(self) -> dict[str, Any]:
        from pipelines.regenerate import run_regenerate

        train, heldout = self._conversations()
        out = self.stage_dir("regenerate") / "conversations.jsonl"
        _write_json(self.stage_dir("regenerate") / "heldout_ids.json", [str(i) for i in heldout["id"]])
        if not self.recipe.regenerate.enabled:
            rows = train.to_list()
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text("".join(json.dumps({k: r[k] for k in ("id", "messages", "source")}) + "\n" for r in rows))
            return {"path": str(out), "num_conversations": len(rows), "regenerated": False}
        # CPU: eager vLLM (torch.compile warm-up costs minutes on a laptop and buys little for a small target).
        engine_kwargs = {"enforce_eager": True, "gpu_memory_utilization": 0.25} if not self.recipe.training.use_gpu else {}
        res = run_regenerate(train, self.recipe.target, self.recipe.regenerate, self.recipe.data, out_path=out,
                             num_cpus_per_worker=_cpus_per_worker(self.recipe.regenerate.num_workers),
                             engine_kwargs=engine_kwargs)
        self.print(f"[regenerate] {len(res.rows)} conversations, {res.num_turns} turns, {res.num_generated_tokens} "
                   f"tokens, {res.tokens_per_s:.1f} tokens/s (engine), {res.wall_tokens_per_s:.1f} tokens/s (wall)")
        return {"path": str(out), "num_conversations": len(res.rows), "num_turns": res.num_turns,
                "num_generated_tokens": res.num_generated_tokens, "tokens_per_s": res.tokens_per_s,
                "wall_tokens_per_s": res.wall_tokens_per_s, "regenerated": True}

    def _valid_regenerate(self, out: dict) -> bool:
        p = Path(out["path"])
        return p.is_file() and sum(1 for _ in p.open()) == out["num_conversations"] > 0

    def _regenerated_rows(self) -> list[dict]:
        path = Path(self.upstream("regenerate")["path"])
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def stage_capture(self) -> dict[str, Any]:
        from peagle_core import shards

        rows = self._regenerated_rows()
        cap = self.recipe.capture
        if cap.streaming:  # nothing on disk: the train stage consumes capture_stream (the forward runs there)
            return {"streaming": True, "num_conversations": len(rows)}
        from pipelines.capture import run_capture

        # One directory per capture key: a capture made with other settings is kept, never overwritten.
        out_dir = self.stage_dir("capture") / self.key("capture")[:12]
        older = [d for d in self.stage_dir("capture").glob("*") if d.is_dir() and d != out_dir]
        if older:
            self.print(f"[capture] keeping {len(older)} older capture(s) made with other settings "
                       f"({_fmt_bytes(sum(_tree_bytes(d) for d in older))}): {', '.join(d.name for d in older)}")
        res = run_capture(rows, self.recipe.target, cap, self.recipe.data, out_dir,
                          num_cpus_per_worker=_cpus_per_worker(cap.num_workers))
        self.print(f"[capture] {res.num_samples} samples, {res.num_tokens} tokens ({res.num_loss_tokens} assistant), "
                   f"{res.num_shards} shards ({res.num_shards_reused} reused), "
                   f"{shards.format_bytes(res.bytes_per_token * res.num_tokens)} on disk, "
                   f"{res.bytes_per_token:.0f} B/token, {res.tokens_per_s:.0f} tokens/s")
        return {"streaming": False, "capture_dir": str(out_dir), "num_samples": res.num_samples,
                "num_tokens": res.num_tokens, "num_loss_tokens": res.num_loss_tokens, "num_shards": res.num_shards,
                "bytes_on_disk": _tree_bytes(out_dir), "bytes_per_token": res.bytes_per_token,
                "tokens_per_s": res.tokens_per_s, "dropped": res.dropped, "num_truncated": res.num_truncated}

    def _valid_capture(self, out: dict) -> bool:
        if out.get("streaming"):
            return True
        from peagle_core.shards import MANIFEST_NAME

        return (Path(out["capture_dir"]) / MANIFEST_NAME).is_file()

    def stage_train(self) -> dict[str, Any]:
        import ray.data

        from pipelines.capture import captured_dataset
        from pipelines.train import run_train

        r = self.recipe
        cap_out = self.upstream("capture")
        out_dir = self.stage_dir("train")
        key = self.key("train")
        kwargs: dict[str, Any] = {}
        before = _tree_bytes(self.run_dir)
        if cap_out.get("streaming"):
            from pipelines.capture import capture_stream

            rows = self._regenerated_rows()
            kwargs |= self._stream_sizes(rows)
            dataset = capture_stream(ray.data.from_items([{"id": x["id"], "messages": x["messages"]} for x in rows]),
                                     r.target, r.capture, r.data,
                                     num_cpus_per_worker=_cpus_per_worker(r.capture.num_workers))
        else:
            dataset = captured_dataset(cap_out["capture_dir"])
            kwargs["capture_dir"] = cap_out["capture_dir"]
        res = run_train(r, dataset, out_dir, run_name=f"{r.name}-{key[:10]}", storage_path=self.run_dir / "ray_results",
                        mlflow_tracking_uri=self.tracking_uri, mlflow_experiment="peagle-train",
                        export_dtype="float32" if not r.training.use_gpu else "bfloat16",
                        recipe_text=r.dump_resolved(), **kwargs)
        history = (res.return_value or {}).get("history") or []
        written = _tree_bytes(self.run_dir) - before
        last = history[-1] if history else {}
        self.print(f"[train] {res.step} steps" + (f" (resumed from {res.resumed_from_step})" if res.resumed_from_step
                                                   else "") + f", last {_fmt_metrics(last)}; head {res.head_dir}")
        return {"head_dir": str(res.head_dir), "step": res.step, "resumed_from_step": res.resumed_from_step,
                "checkpoint": res.checkpoint_path, "mlflow_run_id": res.mlflow_run_id, "history": history,
                "bytes_written_run_dir": written, "streaming": bool(cap_out.get("streaming")),
                "hidden_state_bytes_on_disk": 0 if cap_out.get("streaming") else cap_out.get("bytes_on_disk"),
                **({"stream": {k: v for k, v in kwargs.items() if k == "steps_per_epoch"}} if kwargs else {})}

    def _stream_sizes(self, rows: list[dict]) -> dict[str, Any]:
        """Streaming capture has no manifest: sample lengths (for the epoch length) and assistant-token
        counts (for a pruned draft vocab) come from tokenizing the conversations (no target forward)."""
        from transformers import AutoTokenizer

        from pipelines.capture import _conversation_rows, count_tokens, prepare_samples, resolve_target
        from pipelines.train import estimate_steps_per_epoch

        r = self.recipe
        asset, config = resolve_target(r.target)
        tok = AutoTokenizer.from_pretrained(str(asset.path))
        prepared = prepare_samples(tok, _conversation_rows(rows), max_length_tokens=r.data.max_length_tokens)
        lengths = [len(p[1]) for p in prepared]
        out: dict[str, Any] = {"scan_dataset": False,
                               "steps_per_epoch": estimate_steps_per_epoch(lengths, r.training.batch_tokens,
                                                                           r.training.num_workers)}
        if r.drafter.draft_vocab_size is not None and r.drafter.draft_vocab_size < int(config["vocab_size"]):
            out["token_counts"] = count_tokens(rows, int(config["vocab_size"]), tokenizer=tok,
                                               max_length_tokens=r.data.max_length_tokens)
        self._stream_estimate = {"num_tokens": sum(lengths)}
        return out

    def _valid_train(self, out: dict) -> bool:
        from peagle_core.contract import validate_head, verify_checksums

        head = Path(out["head_dir"])
        verify_checksums(head)
        validate_head(head, parallel_drafting=self.recipe.training.method == "peagle")
        return True

    def stage_evaluate(self) -> dict[str, Any]:
        """AL and tokens/s with real vLLM (``pipelines.evaluate.evaluate``) on the first eval source."""
        from transformers import AutoTokenizer

        from pipelines import evaluate as ev
        from pipelines.capture import resolve_target

        r = self.recipe
        head = self.upstream("train")["head_dir"]
        out_dir = self.stage_dir("evaluate")
        asset, _ = resolve_target(r.target)
        tok = AutoTokenizer.from_pretrained(str(asset.path))
        max_len = max(1024, r.data.max_length_tokens)
        sets = ev.load_eval_prompts(r.evaluation.sources, tok, num_prompts=r.evaluation.num_prompts, seed=r.data.seed,
                                    max_prompt_tokens=max_len - r.evaluation.max_tokens)
        eval_set, prompts = next(iter(sets.items()))
        if len(sets) > 1:
            log.warning("evaluation.sources has %d sets; the pipeline gates on the first (%s)", len(sets), eval_set)
        engine_kwargs = None if not r.training.use_gpu else {"dtype": r.target.dtype, "max_model_len": max_len}
        if engine_kwargs is None:
            engine_kwargs = dict(ev.CPU_ENGINE_KWARGS, dtype=r.target.dtype, max_model_len=max_len)
        report = ev.evaluate(target=asset.path, prompts=prompts, heads={r.training.method: head}, cfg=r.evaluation,
                             eval_set=eval_set, engine_kwargs=engine_kwargs, out_dir=out_dir)
        self.print("[evaluate]\n" + report.markdown)
        return {"table": str(out_dir / "table.json"), "rows": report.rows, "eval_set": eval_set,
                "best_K": report.best_K, "plots": {k: str(v) for k, v in report.plots.items()}}

    def _valid_evaluate(self, out: dict) -> bool:
        return Path(out["table"]).is_file() and bool(out["rows"])

    def stage_register(self) -> dict[str, Any]:
        from pipelines import register as reg

        r = self.recipe
        train_out, eval_out = self.upstream("train"), self.upstream("evaluate")
        method = r.training.method
        rows = eval_out["rows"]
        al_by_K = {int(x["K"]): float(x["acceptance_length"]) for x in rows
                   if x["method"] == method and x.get("acceptance_length") is not None
                   and int(x.get("concurrency", 1)) == min(r.evaluation.concurrency_sweep)}
        gate_K = r.registry.gate_num_speculative_tokens
        eval_set = eval_out["eval_set"]
        best = {int(c): int(k) for c, k in (eval_out.get("best_K") or {}).get(method, {}).items()}
        manifest = None
        cap = self.upstream("capture")
        if not cap.get("streaming"):
            from peagle_core.shards import MANIFEST_NAME

            manifest = Path(cap["capture_dir"]) / MANIFEST_NAME
        timings = {f"stage_seconds.{n}": rec.seconds for n, rec in self.records.items() if rec.status == "ran"}
        run_id = reg.log_run(
            config=r, training_curves=train_out.get("history") or [], eval_table=rows, data_manifest=manifest,
            artifacts={"evaluate": str(self.stage_dir("evaluate"))}, run_name=r.name, tags={"peagle.recipe": r.name, "peagle.pipeline_key": self.key("register"),
                                   "peagle.train_mlflow_run": str(train_out.get("mlflow_run_id") or "")},
            tracking_uri=self.tracking_uri,
        )
        if timings:
            from mlflow.entities import Metric

            now = int(time.time() * 1000)
            reg.get_client(self.tracking_uri).log_batch(run_id, metrics=[Metric(k, v, now, 0) for k, v in timings.items()])
        target_cfg = _target_config(r)
        mv = reg.register_head(
            train_out["head_dir"], model_name=self.model_name, eval_al=al_by_K[gate_K], K=gate_K, eval_set=eval_set,
            run_id=run_id, al_by_K=al_by_K, K_best=best, target=r.target.model, target_config=target_cfg,
            parallel_drafting=method == "peagle", tags={"peagle.pipeline_key": self.key("register"),
                                                        "peagle.recipe": r.name},
            tracking_uri=self.tracking_uri)
        decision = reg.maybe_promote(self.model_name, mv.version, K=gate_K, promote_margin=r.registry.promote_margin,
                                     eval_set=eval_set, tracking_uri=self.tracking_uri)
        reg.get_client(self.tracking_uri).set_terminated(run_id)
        self.print(f"[register] {self.model_name} v{mv.version} (AL {al_by_K[gate_K]:.3f} at K={gate_K} on {eval_set}); "
                   f"gate: {decision.reason}")
        return {"model_name": self.model_name, "version": str(mv.version), "run_id": run_id,
                "tracking_uri": self.tracking_uri, "promoted": decision.promoted, "reason": decision.reason,
                "champion_version": decision.champion_version}

    def _valid_register(self, out: dict) -> bool:
        from pipelines.register import get_client

        mv = get_client(out["tracking_uri"]).get_model_version(out["model_name"], out["version"])
        return (mv.tags or {}).get("peagle.pipeline_key") == self.key("register")

    def stage_serve(self) -> dict[str, Any]:
        from ray import serve

        from pipelines.serve import ServeAppArgs, build_app

        r, s = self.recipe, self.recipe.serving
        reg_out = self.upstream("register")
        cpu = not r.training.use_gpu
        engine_kwargs: dict[str, Any] = {"max_model_len": max(1024, r.data.max_length_tokens)}
        if cpu:
            engine_kwargs |= {"gpu_memory_utilization": 0.25, "enforce_eager": True}
        args = ServeAppArgs.from_recipe(
            r, tracking_uri=self.tracking_uri, model_id=Path(r.target.model.rstrip("/")).name,
            engine_kwargs=engine_kwargs, accelerator="cpu" if cpu else "gpu",
            **({"replica_num_cpus": 0.5, "ingress_num_cpus": 0.25} if cpu else {}))
        serve.start(http_options={"host": s.host, "port": s.port})
        app = build_app(args)
        serve.run(app, name=SERVE_APP_NAME, route_prefix="/", blocking=False)
        url = f"http://{s.host}:{s.port}"
        answer = chat_once(url, args.resolved_model_id(), api_key_env=s.api_key_env)
        from pipelines.serve import pin_head_ref

        served = pin_head_ref(args.head, self.tracking_uri)
        self.print(f"[serve] {url} serves {args.resolved_model_id()} + {served} (K={s.num_speculative_tokens}); "
                   f"smoke answer: {answer!r}")
        return {"url": url, "model_id": args.resolved_model_id(), "head": served, "registered": reg_out["version"],
                "smoke_answer": answer, "api_key_env": s.api_key_env}

    def _valid_serve(self, out: dict) -> bool:
        from ray import serve

        from pipelines.serve import pin_head_ref

        app = serve.status().applications.get(SERVE_APP_NAME)
        ref = self.recipe.serving.head_alias
        current = pin_head_ref(f"models:/{self.model_name}@{ref}", self.tracking_uri)
        return app is not None and str(app.status) in ("RUNNING", "ApplicationStatus.RUNNING") and out["head"] == current

    def _free_serve_cpus(self) -> None:
        """A running demo app holds ~2 CPUs of a laptop cluster: delete it before compute stages."""
        if self.recipe.training.use_gpu:
            return
        try:
            from ray import serve

            if SERVE_APP_NAME in serve.status().applications:
                self.print(f"deleting the running Serve app {SERVE_APP_NAME!r} to free CPUs for compute stages")
                serve.delete(SERVE_APP_NAME)
        except Exception as e:  # noqa: BLE001 - no Serve controller is fine
            log.debug("no Serve app to delete: %s", e)

    # ------------------------------------------------------------------------------------------ summary

    def summary(self, seconds: float) -> dict[str, Any]:
        out: dict[str, Any] = {"recipe": self.recipe.name, "run_dir": str(self.run_dir), "total_seconds": seconds,
                               "stages": {n: {"status": r.status, "seconds": round(r.seconds, 1)}
                                          for n, r in self.records.items()}}
        ev = self.records.get("evaluate")
        if ev:
            out["eval"] = headline(ev.outputs["rows"], self.recipe) | {"eval_set": ev.outputs.get("eval_set")}
        tr = self.records.get("train")
        if tr:
            out["train"] = {k: tr.outputs.get(k) for k in ("step", "head_dir", "bytes_written_run_dir", "streaming",
                                                           "hidden_state_bytes_on_disk", "mlflow_run_id")}
            est = getattr(self, "_stream_estimate", None)
            if est and tr.outputs.get("streaming"):
                from peagle_core.shards import bytes_per_token

                h = int(_target_config(self.recipe)["hidden_size"])
                out["train"]["materialized_capture_bytes_estimate"] = est["num_tokens"] * bytes_per_token(
                    h, self.recipe.capture.dtype)
        rg = self.records.get("register")
        if rg:
            out["mlflow"] = {k: rg.outputs.get(k) for k in ("tracking_uri", "run_id", "model_name", "version",
                                                            "promoted", "champion_version")}
        sv = self.records.get("serve")
        if sv:
            out["endpoint"] = {"url": sv.outputs["url"], "model_id": sv.outputs["model_id"],
                               "head": sv.outputs["head"], "curl": curl_line(sv.outputs["url"], sv.outputs["model_id"],
                                                                             sv.outputs.get("api_key_env"))}
        return out


# ---------------------------------------------------------------------------------------------- helpers


def _fmt_bytes(n: int) -> str:
    from peagle_core.shards import format_bytes

    return format_bytes(n)


def _cpus_per_worker(num_workers: int) -> float:
    """Threads/CPUs per stage actor: the node's cores split over the stage's workers (>= 1)."""
    return max(1, (os.cpu_count() or 1) // max(1, num_workers))


def _target_config(recipe: Recipe) -> dict:
    from pipelines.capture import resolve_target

    _, config = resolve_target(recipe.target)
    return config


def _fmt_metrics(m: dict) -> str:
    keys = [k for k in m if k in ("loss", "acc_depth0", "acc_depth1", "acc_depth4", "lr") or k.startswith("acc_d")]
    return ", ".join(f"{k}={m[k]:.4g}" for k in keys[:8] if isinstance(m.get(k), (int, float))) or "-"


def headline(rows: list[dict], recipe: Recipe) -> dict[str, Any]:
    """AL per K of the trained head and its tokens/s against no speculation at the lowest concurrency."""
    c = min(recipe.evaluation.concurrency_sweep)
    method = recipe.training.method
    base = next((x for x in rows if x["method"] == "none" and int(x.get("concurrency", 1)) == c), None)
    per_K = {}
    for x in rows:
        if x["method"] == method and int(x.get("concurrency", 1)) == c:
            per_K[int(x["K"])] = {"acceptance_length": x.get("acceptance_length"), "tokens_per_s": x.get("tokens_per_s"),
                                  "speedup": (x["tokens_per_s"] / base["tokens_per_s"]
                                              if base and base.get("tokens_per_s") and x.get("tokens_per_s") else None)}
    return {"method": method, "concurrency": c,
            "none_tokens_per_s": base.get("tokens_per_s") if base else None, "per_K": per_K}


def curl_line(url: str, model_id: str, api_key_env: str | None = None) -> str:
    body = json.dumps({"model": model_id, "messages": [{"role": "user", "content": "Write a Python function that "
                                                        "reverses a string."}], "max_tokens": 64, "temperature": 0})
    auth = f" -H \"Authorization: Bearer ${api_key_env}\"" if api_key_env else ""
    return f"curl -s {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d '{body}'"


def chat_once(url: str, model_id: str, *, api_key_env: str | None = None, timeout_s: float = 300.0) -> str:
    """One greedy chat request to the OpenAI endpoint (retried until ``timeout_s``); returns the answer.

    Raises:
        RuntimeError: no successful answer within ``timeout_s``.
    """
    import httpx

    headers = {"Authorization": f"Bearer {os.environ[api_key_env]}"} if api_key_env else {}
    body = {"model": model_id, "messages": [{"role": "user", "content": "What is 2 + 2?"}], "max_tokens": 16,
            "temperature": 0}
    deadline, last = time.time() + timeout_s, None
    while time.time() < deadline:
        try:
            r = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120)
            if r.status_code == 200:
                return r.json()["choices"][0]["message"]["content"]
            last = f"HTTP {r.status_code}: {r.text[:300]}"
        except httpx.HTTPError as e:
            last = repr(e)
        time.sleep(3)
    raise RuntimeError(f"{url} did not answer a chat request within {timeout_s:.0f}s (last: {last})")


def format_summary(s: dict[str, Any]) -> str:
    lines = ["", "=" * 78, (f"peagle pipeline summary: {s['recipe']}  (total {s['total_seconds']:.0f}s, run dir "
             f"{s['run_dir']})"), "-" * 78, "stage        status    seconds"]
    for name, st in s["stages"].items():
        lines.append(f"{name:<12} {st['status']:<9} {st['seconds']:>7.1f}")
    ev = s.get("eval")
    if ev:
        lines.append("-" * 78)
        base = ev.get("none_tokens_per_s")
        lines.append(f"{ev['method']} on {ev['eval_set']} (vLLM, greedy, concurrency {ev['concurrency']}); "
                     f"no speculation: {base:.1f} tokens/s" if base else f"{ev['method']} on {ev['eval_set']}")
        for k, v in sorted(ev["per_K"].items()):
            al, tps, sp = v.get("acceptance_length"), v.get("tokens_per_s"), v.get("speedup")
            lines.append(f"  K={k}: AL {al:.3f}" + (f", {tps:.1f} tokens/s" if tps else "")
                         + (f" ({sp:.2f}x vs none)" if sp else ""))
    tr = s.get("train")
    if tr:
        lines.append("-" * 78)
        lines.append(f"train: {tr['step']} steps; streaming={tr['streaming']}; bytes written under the run dir by "
                     f"train: {tr['bytes_written_run_dir']:,}; hidden states on disk: "
                     f"{tr.get('hidden_state_bytes_on_disk') or 0:,}"
                     + (f" (materialized would be ~{tr['materialized_capture_bytes_estimate']:,})"
                        if tr.get("materialized_capture_bytes_estimate") else ""))
    m = s.get("mlflow")
    if m:
        lines.append("-" * 78)
        lines.append(f"MLflow: {m['tracking_uri']}  run {m['run_id']}  model {m['model_name']} v{m['version']} "
                     f"({'champion' if m['promoted'] else 'challenger; champion v' + str(m['champion_version'])})")
        lines.append(f"  mlflow ui --backend-store-uri {m['tracking_uri']}")
    e = s.get("endpoint")
    if e:
        lines.append("-" * 78)
        lines.append(f"endpoint: {e['url']}/v1  (model {e['model_id']}, head {e['head']})")
        lines.append(f"  {e['curl']}")
    lines.append("=" * 78)
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None, *, stages: Iterable[str] = STAGES, prog: str = "ray_jobs.pipeline") -> int:
    """``python -m ray_jobs.<stage> --config FILE [--force] [--set section.field=value ...] [--run-dir DIR]``.

    Config mistakes print one line naming the field and exit 2 before any compute.
    """
    import argparse
    import sys

    from pipelines.recipe import load_recipe

    stages = list(stages)
    p = argparse.ArgumentParser(prog=f"python -m {prog}", description=f"peagle stage(s): {', '.join(stages)}")
    p.add_argument("--config", "-c", required=True, help="YAML recipe (configs/*.yaml)")
    p.add_argument("--set", "-s", action="append", default=[], metavar="section.field=value",
                   help="override a recipe field (YAML value, validated by the schema); repeatable")
    p.add_argument("--force", action="store_true", help="re-run the stage(s) even when their outputs are current")
    p.add_argument("--run-dir", default=None, help="run directory (default $PEAGLE_HOME/runs/<recipe name>)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        recipe = load_recipe(a.config, a.set)
        run = PipelineRun(recipe, run_dir=a.run_dir, force=stages if a.force else (), stages=stages,
                          print_fn=lambda s: print(s, flush=True))
        run.run()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0
