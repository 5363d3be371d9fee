"""Compact copies of a training checkpoint: the state a machine returns so that another one resumes the run.

A checkpoint (:mod:`pipelines.train.checkpoint`) holds every trainable drafter tensor in float32 (FSDP2 ones
and those written before 2026-11-28 the frozen ones too) and AdamW's two moments per trainable parameter: ~250
MB for a 4-layer SmolLM2 head, more than a lent machine returns in one call. :func:`compact_checkpoint` writes
a copy in one of the :data:`FORMS`; :func:`expand_checkpoint` (on the machine that resumes) turns it back into
a checkpoint directory that :meth:`~pipelines.train.checkpoint.Checkpointer.load` reads: frozen parameters the
copy lacks keep the values the drafter was built with, bf16 weights and moments are cast to the parameters'
dtype, a dropped ``exp_avg`` restarts at zero and a factored ``exp_avg_sq`` is rebuilt from its row and column
means (Adafactor's rank-1 estimate, Shazeer & Stern 2018). The scheduler, the data position, the RNG states
and ``trainer_state.json`` are copied whole in every form (kilobytes), so the resumed run trains the same
samples in the same order at the same learning rates; only the weights and AdamW's moments are approximated.

Which form resumes without a loss spike is measured by ``bench/resume_state.py``
(``bench/results/resume_state.json``).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import load_file, save_file

from pipelines.train.checkpoint import FROZEN_KEY, MODEL_FILE, OPTIMIZER_FILE, SCHEDULER_FILE, STATE_FILE

FORM_KEY = "compact_form"                # trainer_state.json of a compact copy: the form's name
COMPACT_OPTIMIZER_FILE = "optimizer_compact.pt"  # moments that need expand_checkpoint before they load
_ROW, _COL = "exp_avg_sq_row", "exp_avg_sq_col"

__all__ = ["COMPACT_OPTIMIZER_FILE", "FORMS", "FORM_KEY", "CheckpointForm", "compact_checkpoint",
           "expand_checkpoint", "form_bytes"]


@dataclass(frozen=True, kw_only=True)
class CheckpointForm:
    """What a compact copy keeps of a checkpoint.

    Args:
        name: the form's name (a key of :data:`FORMS`).
        keep_frozen: keep the parameters the optimizer does not update (False: dropped; the resuming run
            builds them again: the target's embeddings of a head with ``drafter.train_embed_tokens=false``).
        weights_dtype: dtype of the floating-point weights (None: as saved, float32).
        moments_dtype: dtype of the AdamW moments kept (None: as saved, float32).
        exp_avg: ``"keep"`` or ``"drop"`` (zeros after expansion; the step count and bias correction go on).
        exp_avg_sq: ``"keep"``, ``"factored"`` (2-D tensors as row and column means in float32, 1-D ones kept),
            or ``"drop"`` (only with ``exp_avg="drop"``: the optimizer state is dropped whole and AdamW restarts,
            bias correction included; the learning-rate schedule goes on from the saved step).
        description: one line for tables.
    """

    name: str
    keep_frozen: bool = False
    weights_dtype: torch.dtype | None = None
    moments_dtype: torch.dtype | None = None
    exp_avg: Literal["keep", "drop"] = "keep"
    exp_avg_sq: Literal["keep", "factored", "drop"] = "keep"
    description: str = ""

    @property
    def needs_expand(self) -> bool:
        """The copy's optimizer state must go through :func:`expand_checkpoint` before it loads."""
        return self.exp_avg_sq != "drop" and (self.exp_avg == "drop" or self.exp_avg_sq == "factored")


_BF16 = torch.bfloat16
FORMS: dict[str, CheckpointForm] = {f.name: f for f in (
    CheckpointForm(name="full", keep_frozen=True, description="the checkpoint as written (fp32 weights, frozen "
                   "ones where it holds them, fp32 AdamW moments)"),
    CheckpointForm(name="trainable", description="fp32 trainable weights, fp32 moments (lossless)"),
    CheckpointForm(name="fp32-weights-bf16-moments", moments_dtype=_BF16,
                   description="fp32 trainable weights, both AdamW moments in bf16"),
    CheckpointForm(name="bf16-weights-bf16-moments", weights_dtype=_BF16, moments_dtype=_BF16,
                   description="bf16 trainable weights, both AdamW moments in bf16"),
    CheckpointForm(name="bf16-weights-bf16-m-factored-v", weights_dtype=_BF16, moments_dtype=_BF16,
                   exp_avg_sq="factored", description="bf16 trainable weights, exp_avg in bf16, exp_avg_sq as row "
                   "and column means (Adafactor)"),
    CheckpointForm(name="bf16-weights-bf16-v", weights_dtype=_BF16, moments_dtype=_BF16, exp_avg="drop",
                   description="bf16 trainable weights, exp_avg_sq in bf16, exp_avg restarted at zero"),
    CheckpointForm(name="bf16-weights-factored-v", weights_dtype=_BF16, moments_dtype=_BF16, exp_avg="drop",
                   exp_avg_sq="factored", description="bf16 trainable weights, exp_avg_sq as row and column "
                   "means (Adafactor), exp_avg restarted at zero"),
    CheckpointForm(name="fp32-weights", exp_avg="drop", exp_avg_sq="drop",
                   description="fp32 trainable weights, AdamW re-initialised"),
    CheckpointForm(name="bf16-weights", weights_dtype=_BF16, exp_avg="drop", exp_avg_sq="drop",
                   description="bf16 trainable weights, AdamW re-initialised"),
)}


def _form(name: str) -> CheckpointForm:
    if name not in FORMS:
        raise ValueError(f"checkpoint form {name!r}: choose one of {sorted(FORMS)}")
    return FORMS[name]


def _cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return t.to(dtype) if dtype is not None and t.is_floating_point() else t


def _compact_param_state(st: dict, f: CheckpointForm) -> dict:
    """One parameter's AdamW state (``step``, ``exp_avg``, ``exp_avg_sq``) in form ``f``."""
    out = {k: v for k, v in st.items() if k not in ("exp_avg", "exp_avg_sq")}  # step
    if f.exp_avg == "keep":
        out["exp_avg"] = _cast(st["exp_avg"], f.moments_dtype)
    v = st["exp_avg_sq"]
    if f.exp_avg_sq == "factored" and v.ndim == 2:
        out[_ROW], out[_COL] = v.float().mean(1), v.float().mean(0)  # [rows], [cols]
    else:
        out["exp_avg_sq"] = _cast(v, f.moments_dtype)
    return out


def _expand_param_state(st: dict) -> dict:
    """Inverse of :func:`_compact_param_state` up to the approximation: full-shape float32 moments."""
    out = {k: v for k, v in st.items() if k not in (_ROW, _COL, "exp_avg", "exp_avg_sq")}
    if _ROW in st:
        row, col = st[_ROW], st[_COL]
        v = torch.outer(row, col) / row.mean().clamp_min(torch.finfo(torch.float32).tiny)  # [rows, cols]
    else:
        v = st["exp_avg_sq"].float()
    out["exp_avg"] = st["exp_avg"].float() if "exp_avg" in st else torch.zeros_like(v)
    out["exp_avg_sq"] = v
    return out


def compact_checkpoint(src: str | os.PathLike, dst: str | os.PathLike, form: str) -> Path:
    """Write the checkpoint directory ``src`` to ``dst`` in ``form`` (a key of :data:`FORMS`); ``dst`` is
    replaced if it exists. ``trainer_state.json`` of the copy records the form under ``compact_form``; a form
    whose moments need :func:`expand_checkpoint` writes them to ``optimizer_compact.pt`` (no ``optimizer.pt``:
    an unexpanded copy does not load).

    Returns:
        ``dst``.

    Raises:
        ValueError: an unknown form; ``src`` is not a checkpoint (names the missing file); a form that drops
            frozen parameters for a checkpoint that does not list them (written before ``frozen_parameters``
            was recorded) or for an FSDP2-sharded one (its loader is strict).
    """
    f = _form(form)
    src, dst = Path(src), Path(dst)
    for name in (MODEL_FILE, OPTIMIZER_FILE, SCHEDULER_FILE, STATE_FILE):
        if not (src / name).is_file():
            raise ValueError(f"{src} is not a training checkpoint: {name} is missing")
    meta = json.loads((src / STATE_FILE).read_text())
    if not f.keep_frozen and (FROZEN_KEY not in meta or meta.get("sharded")):
        why = "is FSDP2-sharded" if meta.get("sharded") else f"lists no {FROZEN_KEY}"
        raise ValueError(f"checkpoint {src} {why}: form {form!r} drops frozen parameters; use form='full'")
    frozen = set() if f.keep_frozen else set(meta[FROZEN_KEY])
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    model = {k: _cast(v, f.weights_dtype).contiguous() for k, v in load_file(str(src / MODEL_FILE)).items()
             if k not in frozen}
    save_file(model, str(dst / MODEL_FILE), metadata={"format": "pt"})
    opt = torch.load(src / OPTIMIZER_FILE, map_location="cpu", weights_only=True)
    if f.exp_avg_sq == "drop":
        opt = {**opt, "state": {}}
    elif f.name != "full":
        opt = {**opt, "state": {i: _compact_param_state(st, f) for i, st in opt["state"].items()}}
    torch.save(opt, dst / (COMPACT_OPTIMIZER_FILE if f.needs_expand else OPTIMIZER_FILE))
    for p in src.iterdir():  # scheduler, rank files: copied whole
        if p.is_file() and p.name not in (MODEL_FILE, OPTIMIZER_FILE, STATE_FILE):
            shutil.copy2(p, dst / p.name)
    (dst / STATE_FILE).write_text(json.dumps({**meta, FORM_KEY: f.name}, indent=2, sort_keys=True, default=str))
    return dst


def expand_checkpoint(directory: str | os.PathLike) -> Path:
    """Make a compact copy loadable in place: ``optimizer_compact.pt`` -> ``optimizer.pt`` with full-shape float32
    moments (zeros for a dropped ``exp_avg``, the rank-1 estimate for a factored ``exp_avg_sq``). Nothing to do
    for a full checkpoint or a form that loads as written.

    Returns:
        ``directory``.

    Raises:
        ValueError: ``directory`` has neither ``optimizer.pt`` nor ``optimizer_compact.pt``.
    """
    d = Path(directory)
    src = d / COMPACT_OPTIMIZER_FILE
    if not src.is_file():
        if not (d / OPTIMIZER_FILE).is_file():
            raise ValueError(f"{d} is not a training checkpoint: {OPTIMIZER_FILE} is missing")
        return d
    opt = torch.load(src, map_location="cpu", weights_only=True)
    opt = {**opt, "state": {i: _expand_param_state(st) for i, st in opt["state"].items()}}
    torch.save(opt, d / OPTIMIZER_FILE)
    src.unlink()
    return d


def form_bytes(directory: str | os.PathLike) -> int:
    """Bytes of the files of a checkpoint directory (any form), not recursing."""
    return sum(p.stat().st_size for p in Path(directory).iterdir() if p.is_file())
