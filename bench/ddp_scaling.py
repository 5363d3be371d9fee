"""Benchmark: Ray Train DDP scaling of P-EAGLE training, 2 GPUs vs 1 (issue 8 item 5).

Efficiency = global tokens/s with 2 workers / (2 x tokens/s with 1 worker), weak scaling: every
worker trains on ``--num-tokens`` tokens per optimizer step. Goal >= 0.9.

What runs: Ray Train V2 ``TorchTrainer`` with ``ScalingConfig(num_workers, use_gpu)``, one run with
1 worker and one with 2, each worker driving the project's training core
``pipelines.train.Trainer`` (packing, bf16 autocast, exact global loss scaling across ranks,
gradient clipping, fused AdamW, the per-step "all ranks still have a batch" agreement, windowed
global tokens/s). The model is wrapped by ``ray.train.torch.prepare_model`` (DDP with NCCL on GPU,
gloo on CPU; no wrapper with 1 worker), as in ``pipelines.train.train_loop_per_worker``.

Why not ``pipelines.train.train_loop_per_worker`` itself: it reads its samples from
``ray.train.get_dataset_shard`` (Ray Data over a capture's parquet shards) and the target from a
safetensors directory, and the GPU box has neither a capture nor the converted target. So the
bench feeds the same ``Trainer`` from an in-memory iterator of synthetic captured samples
(random aux hidden states ``[n, 3*Ht]`` and final hidden ``[n, Ht]``, ``--num-docs`` documents per
pack, the first 20% of each a prompt without loss, as ``bench.train_step.make_batch``). No
checkpoints, no MLflow.

Drafter: SmolLM2-135M-sized P-EAGLE head with random weights (``bench.train_step.make_drafter``:
4 layers, H=576, vocab 49152, mask token = V-1), K=8 depths, COD r=0.8, r_min=0.2, one partition,
flex attention and the Triton loss on CUDA (``attention="auto"``, ``loss_impl="auto"``); the
recipe's ``TrainingConfig`` defaults otherwise (lr 1e-4, betas (0.9, 0.95), grad clip 1.0).

Timing: ``Trainer`` logs every ``--window-steps`` steps the tokens of all ranks (all-reduced) over
rank 0's wall time of the window; windows inside the first ``--warmup-steps`` steps (torch.compile
of the flex kernel and block mask, NCCL set-up) are dropped; tokens/s of a run = measured tokens /
measured seconds. Each ``Trainer`` step ends in a host sync (loss and grad norm read back), so the
windows time finished work.

Fallback ``--launcher torch``: the same worker function under ``torch.multiprocessing`` and
``torch.nn.parallel.DistributedDataParallel`` (what ``prepare_model`` builds), for a box where
``import ray.train`` fails; the result records which launcher ran.

GPU box: ``python -m bench.ddp_scaling`` (writes ``bench/results/ddp_scaling.json``; device calls
in ``bench/device/run_ddp_scaling.sh``). CPU smoke: ``python -m bench.ddp_scaling --smoke`` (2 gloo
workers, tiny sizes, a private local Ray cluster; writes under the temp dir unless ``--out-dir``).

Shape legend: N tokens per worker step, Ht target hidden, K parallel depths, W workers.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.common import TARGET_SHAPES, write_result
from pipelines.ports import free_port

SMOKE_SHAPE = {"hidden_size": 36, "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 6,
               "intermediate_size": 50, "vocab_size": 99, "num_hidden_layers": 7, "rope_theta": 10000.0}
# NVLink multicast stays off on the shared multi-GPU hosts (.library/device/KINDS.md); Ray workers
# inherit the driver's environment, so setting these before ray.init covers them.
NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
GOAL_EFFICIENCY = 0.9  # tokens/s(2) / (2 x tokens/s(1))


# ----------------------------------------------------------------------------------------------
# synthetic captured samples


def synthetic_samples(shape: dict, *, num_tokens: int, num_docs: int, num_packs: int, seed: int) -> list[dict]:
    """``num_packs * num_docs`` captured samples; each run of ``num_docs`` consecutive samples packs
    into exactly ``num_tokens`` tokens (``pipelines.train.iter_packed_batches``).

    Each sample: ``input_ids [n]`` int64 (< V-1: the last id is the mask token), ``loss_mask [n]``
    bool (False on the first 20%, the prompt), ``aux [n, 3*Ht]`` and ``final_hidden [n, Ht]``
    float32 standard normal.

    Raises:
        ValueError: ``num_tokens`` is not a multiple of ``num_docs`` or a document would be shorter
            than 2 tokens.
    """
    if num_tokens % num_docs or num_tokens // num_docs < 2:
        raise ValueError(f"num_tokens={num_tokens} must be a multiple of num_docs={num_docs} with >= 2 tokens "
                         "per document; change --num-tokens or --num-docs")
    g = torch.Generator().manual_seed(seed)
    n, Ht, V = num_tokens // num_docs, shape["hidden_size"], shape["vocab_size"]
    loss_mask = torch.arange(n) >= n // 5
    return [{"input_ids": torch.randint(0, V - 1, (n,), generator=g), "loss_mask": loss_mask,
             "aux": torch.randn(n, 3 * Ht, generator=g), "final_hidden": torch.randn(n, Ht, generator=g)}
            for _ in range(num_packs * num_docs)]


# ----------------------------------------------------------------------------------------------
# one worker (launcher-independent)


def train_worker(cfg: dict, *, rank: int, world: int, device: torch.device,
                 wrap: Callable[[torch.nn.Module], torch.nn.Module]) -> dict:
    """Build the drafter, wrap it (``wrap``: ``prepare_model`` or DDP), train ``warmup_steps +
    steps`` steps with ``pipelines.train.Trainer`` on synthetic samples and time the windows.

    Returns (meaningful on rank 0): ``tokens_per_s`` (global, measured windows), ``step_s`` (mean
    seconds per optimizer step), ``window_tokens_per_s`` (each measured window), ``loss_first``,
    ``loss_last``, ``num_parameters``, ``peak_mem_gib`` (CUDA).
    """
    from bench.train_step import make_drafter
    from peagle_core.drafter import num_parameters
    from peagle_core.objectives import build_objective
    from pipelines.recipe import TrainingConfig
    from pipelines.train import Trainer
    from pipelines.train.worker import collectives

    training = cfg["training"]
    tcfg = TrainingConfig(**training)
    torch.manual_seed(int(training["seed"]))  # identical init on every rank (DDP broadcasts rank 0's anyway)
    drafter = make_drafter(cfg["shape"], num_layers=cfg["num_layers"], parallel=True, device="cpu",
                           draft_vocab_size=cfg["draft_vocab_size"])
    n_params = num_parameters(drafter)
    model = wrap(drafter)
    float_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = cfg["shape"]
    target_lm_head = (torch.randn(shape["vocab_size"], shape["hidden_size"]) * 0.02).to(device, float_dtype)  # [V, Ht]
    obj_kw = dataclasses.asdict(tcfg.objective_config(cfg["num_depths"]))
    obj_kw["seed"] = int(training["seed"]) + rank  # per-rank COD stream, as in train_loop_per_worker
    objective = build_objective("peagle", **obj_kw)
    all_true, all_sum = collectives(world, device)
    windows: list[dict] = []
    warmup, window = int(cfg["warmup_steps"]), int(cfg["window_steps"])

    def on_log(step: int, m: dict) -> None:
        windows.append({"step": step, "tokens_per_s": float(m["tokens_per_s"]), "loss": float(m.get("loss", 0.0))})
        if rank == 0:
            tag = "warm-up" if step <= warmup else "measured"
            print(f"[ddp_scaling W={world}] step {step} loss {m.get('loss', float('nan')):.4f} "
                  f"tokens/s {m['tokens_per_s']:.0f} ({tag})", flush=True)

    trainer = Trainer(config=tcfg, model=model, objective=objective, target_lm_head=target_lm_head,
                      total_steps=warmup + int(cfg["steps"]), device=device, rank=rank, world_size=world,
                      all_true=all_true, all_sum=all_sum, on_log=on_log, log_every_steps=window)
    pool = synthetic_samples(shape, num_tokens=int(training["batch_tokens"]), num_docs=cfg["num_docs"],
                             num_packs=cfg["num_packs"], seed=1000 * (rank + 1))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    trainer.fit(lambda epoch: itertools.cycle(pool))  # endless: total_steps ends the run
    measured = [w for w in windows if w["step"] - window >= warmup]
    if not measured:
        raise ValueError(f"no measured window: steps={cfg['steps']} must be >= window_steps={window}")
    tokens_per_window = window * int(training["batch_tokens"]) * world
    seconds = sum(tokens_per_window / w["tokens_per_s"] for w in measured)
    out = {"tokens_per_s": tokens_per_window * len(measured) / seconds,
           "step_s": seconds / (window * len(measured)),
           "window_tokens_per_s": [w["tokens_per_s"] for w in measured],
           "num_measured_steps": window * len(measured), "loss_first": windows[0]["loss"],
           "loss_last": windows[-1]["loss"], "num_parameters": n_params}
    if device.type == "cuda":
        out["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return out


# ----------------------------------------------------------------------------------------------
# launchers


def ray_train_loop(cfg: dict) -> dict:
    """Ray Train worker function (``TorchTrainer(ray_train_loop, train_loop_config=cfg)``)."""
    import ray.train
    import ray.train.torch

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = ray.train.torch.get_device()
    if device.type == "cpu":
        torch.set_num_threads(int(cfg.get("cpu_threads_per_worker") or 1))
    return train_worker(cfg, rank=rank, world=world, device=device,
                        wrap=lambda m: ray.train.torch.prepare_model(m, parallel_strategy="ddp" if world > 1 else None))


def run_ray(cfg: dict, num_workers: int, *, use_gpu: bool, cpus_per_worker: int, storage: Path) -> dict:
    """One ``TorchTrainer.fit()`` with ``num_workers`` workers; rank 0's :func:`train_worker`
    result plus the wall time of the fit (worker start-up and compile included)."""
    import ray.train
    from ray.train.torch import TorchTrainer

    resources = {"CPU": cpus_per_worker, **({"GPU": 1} if use_gpu else {})}
    trainer = TorchTrainer(
        ray_train_loop, train_loop_config=cfg,
        scaling_config=ray.train.ScalingConfig(num_workers=num_workers, use_gpu=use_gpu,
                                               resources_per_worker=resources),
        run_config=ray.train.RunConfig(name=f"ddp-scaling-w{num_workers}-{os.getpid()}", storage_path=str(storage)),
    )
    t0 = time.perf_counter()
    result = trainer.fit()
    if result.return_value is None:
        raise RuntimeError(f"the {num_workers}-worker run returned nothing (error: {result.error})")
    return {**result.return_value, "fit_wall_s": time.perf_counter() - t0}


def _torch_worker(rank: int, world: int, cfg: dict, port: int, out_file: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    cuda = cfg["use_gpu"]
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(int(cfg.get("cpu_threads_per_worker") or 1))
    if world > 1:
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=rank, world_size=world)

    def wrap(m: torch.nn.Module) -> torch.nn.Module:
        m = m.to(device)
        if world == 1:
            return m
        return DistributedDataParallel(m, **({"device_ids": [device], "output_device": device} if cuda else {}))

    try:
        out = train_worker(cfg, rank=rank, world=world, device=device, wrap=wrap)
        if rank == 0:
            Path(out_file).write_text(json.dumps(out))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_torch(cfg: dict, num_workers: int, *, use_gpu: bool, cpus_per_worker: int, storage: Path) -> dict:
    """The same workers under ``torch.multiprocessing.spawn`` (no Ray)."""
    import torch.multiprocessing as mp

    out_file = storage / f"torch-w{num_workers}.json"
    cfg = {**cfg, "use_gpu": use_gpu}
    t0 = time.perf_counter()
    mp.spawn(_torch_worker, args=(num_workers, cfg, free_port(), str(out_file)), nprocs=num_workers, join=True)
    return {**json.loads(out_file.read_text()), "fit_wall_s": time.perf_counter() - t0}


# ----------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU, 2 gloo workers, tiny sizes (a minute)")
    p.add_argument("--launcher", default="ray", choices=["ray", "torch"],
                   help="ray: Ray Train TorchTrainer (the measurement); torch: torch.multiprocessing + DDP fallback")
    p.add_argument("--target", default="smollm2-135m", choices=sorted(TARGET_SHAPES))
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="runs (the first is the baseline)")
    p.add_argument("--num-tokens", type=int, default=8192, help="N: tokens per worker per optimizer step")
    p.add_argument("--num-docs", type=int, default=4, help="documents packed per step")
    p.add_argument("--num-depths", type=int, default=8, help="K parallel depths")
    p.add_argument("--num-layers", type=int, default=4, help="drafter decoder layers")
    p.add_argument("--draft-vocab-size", type=int, default=None, help="default: the target vocabulary")
    p.add_argument("--warmup-steps", type=int, default=10, help="steps not timed (compile, NCCL set-up)")
    p.add_argument("--steps", type=int, default=30, help="timed steps per run")
    p.add_argument("--window-steps", type=int, default=5, help="steps per timing window (divides both above)")
    p.add_argument("--cpus-per-worker", type=int, default=None, help="Ray CPUs per worker (default 4 GPU, 1 CPU)")
    p.add_argument("--cpu", action="store_true", help="CPU workers (gloo) even if a GPU is present")
    p.add_argument("--out", default=None, help="result name (default ddp_scaling[_smoke])")
    p.add_argument("--out-dir", default=None, help="default bench/results (smoke: the temp dir)")
    return p


def _check(args, use_gpu: bool) -> None:
    """Raises:
        ValueError: step counts that are not whole windows, or more GPU workers than GPUs."""
    if args.warmup_steps % args.window_steps or args.steps % args.window_steps or args.steps < 1:
        raise ValueError(f"--warmup-steps={args.warmup_steps} and --steps={args.steps} must be multiples of "
                         f"--window-steps={args.window_steps} (steps >= 1)")
    if use_gpu and max(args.workers) > torch.cuda.device_count():
        raise ValueError(f"--workers {args.workers} needs {max(args.workers)} GPUs, this box has "
                         f"{torch.cuda.device_count()}; pass --workers 1 or --cpu")


def _payload(args, cfg: dict, training, shape: dict, *, use_gpu: bool, cpus: int) -> dict:
    """The result file's header (settings, launcher, topology); ``runs`` filled as they finish."""
    return {
        "benchmark": "ddp_scaling",
        "launcher": {"ray": "ray.train.torch.TorchTrainer (Ray Train V2) + prepare_model DDP",
                     "torch": "torch.multiprocessing + DistributedDataParallel (fallback, no Ray)"}[args.launcher],
        "ray": None,
        "backend": "nccl" if use_gpu else "gloo",
        "gpu_topology": _gpu_topology() if use_gpu else None,
        "target": args.target if not args.smoke else "smoke",
        "goal": {"scaling_efficiency_min": GOAL_EFFICIENCY},
        "settings": {k: cfg[k] for k in ("num_layers", "num_depths", "draft_vocab_size", "num_docs", "warmup_steps",
                                          "steps", "window_steps")}
        | {"hidden_size": shape["hidden_size"], "vocab_size": shape["vocab_size"],
           "num_tokens_per_worker_step": args.num_tokens, "cpus_per_worker": cpus,
           "objective": {"cod_ratio": training.cod_ratio, "cod_min_ratio": training.cod_min_ratio,
                         "num_partitions": training.num_partitions, "attention": training.attention,
                         "loss": training.loss}, "bf16_autocast": use_gpu},
        "runs": [],
        "scaling_efficiency": None,
    }


def main(argv: list[str] | None = None) -> dict:
    from pipelines.recipe import TrainingConfig

    args = _parser().parse_args(argv)
    shape = dict(TARGET_SHAPES[args.target])
    if args.smoke:
        shape, args.cpu = dict(SMOKE_SHAPE), True
        args.num_tokens, args.num_docs, args.num_depths, args.num_layers = 64, 2, 3, 2
        args.warmup_steps, args.steps, args.window_steps = 2, 4, 2
    use_gpu = torch.cuda.is_available() and not args.cpu
    _check(args, use_gpu)
    cpus = args.cpus_per_worker or (4 if use_gpu else 1)
    training = TrainingConfig(method="peagle", batch_tokens=args.num_tokens, max_steps=args.warmup_steps + args.steps,
                              num_workers=max(args.workers), use_gpu=use_gpu)
    cfg = {"training": training.model_dump(mode="json"), "shape": shape, "num_layers": args.num_layers,
           "num_depths": args.num_depths, "draft_vocab_size": args.draft_vocab_size, "num_docs": args.num_docs,
           "num_packs": 2, "warmup_steps": args.warmup_steps, "steps": args.steps,
           "window_steps": args.window_steps, "cpu_threads_per_worker": 1}
    for k, v in NO_MULTICAST_ENV.items():
        os.environ.setdefault(k, v)
    payload = _payload(args, cfg, training, shape, use_gpu=use_gpu, cpus=cpus)
    out_dir = Path(args.out_dir) if args.out_dir else (Path(tempfile.gettempdir()) if args.smoke else None)
    path = _run_all(args, cfg, payload, use_gpu=use_gpu, cpus=cpus,
                    name=args.out or ("ddp_scaling_smoke" if args.smoke else "ddp_scaling"), out_dir=out_dir)
    print(f"[ddp_scaling] scaling efficiency {payload['scaling_efficiency']} (goal >= {GOAL_EFFICIENCY}); "
          f"wrote {path}", flush=True)
    return payload


def _run_all(args, cfg: dict, payload: dict, *, use_gpu: bool, cpus: int, name: str, out_dir: Path | None) -> Path:
    """One run per ``--workers`` entry under the launcher; the result file rewritten after each."""
    tmp = Path(tempfile.mkdtemp(prefix="ddp-"))  # short: Ray's socket paths live under it
    if args.launcher == "ray":
        import ray

        payload["ray"] = ray.__version__
        # 1 GiB object store: nothing big goes through it, and /dev/shm may be small on the box
        ray.init(address="local", num_cpus=max(args.workers) * cpus + 1, include_dashboard=False,
                 object_store_memory=2**30, log_to_driver=True, _temp_dir=str(tmp / "ray"))
        run = run_ray
    else:
        run = run_torch
    runs, path = payload["runs"], None
    try:
        for w in args.workers:
            r = run(cfg, w, use_gpu=use_gpu, cpus_per_worker=cpus, storage=tmp)
            r = {"num_workers": w, "num_gpus": w if use_gpu else 0, **r}
            r["scaling_efficiency"] = r["tokens_per_s"] / (runs[0]["tokens_per_s"] * w / runs[0]["num_workers"]
                                                           if runs else r["tokens_per_s"])
            runs.append(r)
            if len(runs) > 1:
                payload["scaling_efficiency"] = r["scaling_efficiency"]
            path = write_result(name, payload, out_dir)  # after every run: a later failure keeps this one
            print(f"[ddp_scaling] {w} worker(s): {r['tokens_per_s']:.0f} tokens/s global, "
                  f"{r['step_s'] * 1e3:.1f} ms/step, efficiency {r['scaling_efficiency']:.3f}", flush=True)
    finally:
        if args.launcher == "ray":
            ray.shutdown()
    shutil.rmtree(tmp, ignore_errors=True)
    return path


def _gpu_topology() -> str | None:
    """``nvidia-smi topo -m`` (how the GPUs are linked: NV# = NVLink, PIX/PHB/SYS = PCIe), or None."""
    import subprocess

    try:
        return subprocess.run(["nvidia-smi", "topo", "-m"], check=False, capture_output=True, text=True, timeout=30).stdout or None
    except (OSError, subprocess.SubprocessError):
        return None


if __name__ == "__main__":
    main(sys.argv[1:])
