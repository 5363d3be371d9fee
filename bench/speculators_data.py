"""speculators side by side, the data half (:mod:`bench.speculators_side`): peagle's capture as speculators'
hidden-state samples and data directory, and :class:`CaptureTransfer`, the online backend that feeds its trainer.

Shape legend: N tokens of one conversation, Ht target hidden.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

BACKEND = "peagle-capture"  # the speculators hidden-states backend name of CaptureTransfer
SIDE_FILE = "peagle_side.json"  # what the data directory was made from (read by CaptureTransfer and train)
HS_DIR = "hidden_states"  # speculators' file backend: <data>/hidden_states/hs_<i>.safetensors

# ----------------------------------------------------------------------------------------------
# samples: peagle's capture -> speculators' hidden-state sample


def speculators_sample(sample: dict[str, Any], norm_weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """One captured peagle sample (``input_ids [N]``, ``aux [N, 3*Ht]``, ``final_hidden [N, Ht]`` after the
    target's final norm) -> speculators' sample ``{"hidden_states": [N, 4, Ht], "token_ids": [N] int64}``.

    Layer 3 is ``final_hidden / norm_weight`` (computed in float32, stored in the aux dtype): a pre-norm state
    whose RMS is ~1, so speculators' ``verifier_norm`` (the target's RMSNorm with ``norm_weight``) maps it back to
    ``final_hidden``.

    Raises:
        ValueError: ``aux`` is not 3 layers of ``final_hidden``'s width, or ``norm_weight`` has a zero.
    """
    aux, final = sample["aux"], sample["final_hidden"]
    n, ht = final.shape
    if aux.shape != (n, 3 * ht):
        raise ValueError(f"aux has shape {tuple(aux.shape)}, expected ({n}, {3 * ht}) for 3 aux layers")
    if bool((norm_weight == 0).any()):
        raise ValueError("the target's final norm weight has zeros: final_hidden cannot be mapped back to a "
                         "pre-norm state")
    pre = (final.float() / norm_weight.float().to(final.device)).to(aux.dtype)  # [N, Ht]
    hidden = torch.cat([aux.reshape(n, 3, ht), pre.unsqueeze(1)], dim=1)  # [N, 4, Ht]
    return {"hidden_states": hidden.contiguous(), "token_ids": torch.as_tensor(sample["input_ids"]).long()}


def final_norm_weight(target_dir: str | Path) -> torch.Tensor:
    """``[Ht]`` the target's final norm weight (``model.norm.weight``, ``pipelines.train.load_target_tensor``).

    Raises:
        ValueError: no such tensor in the target's safetensors files.
    """
    from pipelines.train import load_target_tensor

    return load_target_tensor(target_dir, ["model.norm.weight"])[1]


# ----------------------------------------------------------------------------------------------
# data: the regenerated conversations -> speculators' data directory


def write_dataset(tokenized: list[dict[str, Any]], out: Path) -> None:
    """Tokenized rows (``input_ids``, ``loss_mask``) -> the ``datasets`` dataset speculators' ``ArrowDataset``
    loads from ``out`` (``input_ids``/``loss_mask`` int64 lists, ``seq_len``; torch format, as its
    ``prepare-data`` writes pre-tokenized rows)."""
    from datasets import Dataset

    ds = Dataset.from_dict({
        "input_ids": [np.asarray(r["input_ids"], dtype=np.int64) for r in tokenized],
        "loss_mask": [np.asarray(r["loss_mask"], dtype=np.int64) for r in tokenized],
        "seq_len": [len(r["input_ids"]) for r in tokenized],
    })
    ds.set_format(type="torch")
    ds.save_to_disk(str(out))


def write_data(out: Path, tokenized: list[dict], recipe, plan, tokenizer, *, model=None,
               tokenize_s: float | None = None) -> dict:
    """speculators' data directory for conversations tokenized as peagle's capture tokenizes them
    (``pipelines.capture.tokenize_rows`` with ``recipe.data.max_length_tokens`` and ``recipe.capture.on_too_long``:
    ``{sample_id, input_ids [N], loss_mask [N]}``; ``tokenize_s``, the seconds that took, is recorded): the dataset,
    ``d2t-<Vd>.npy`` /
    ``t2d-<Vd>.npy`` from peagle's ``plan`` (its draft vocabulary), :data:`SIDE_FILE`; with ``model`` (the target)
    also every sample's hidden states as ``hidden_states/hs_<i>.safetensors`` (speculators' ``file`` backend).

    Returns:
        The :data:`SIDE_FILE` record.
    """
    from safetensors.torch import save_file

    from pipelines.capture import capture_tokenized
    from pipelines.capture.forward import pad_id

    out.mkdir(parents=True, exist_ok=True)
    write_dataset(tokenized, out)
    vd = plan.drafter.draft_vocab_size
    if plan.d2t is not None:
        np.save(out / f"d2t-{vd}.npy", plan.d2t.numpy())
        np.save(out / f"t2d-{vd}.npy", plan.t2d.numpy())
    side = {"target_dir": str(plan.target_dir), "target": plan.target_name, "target_sha256": plan.target_sha256,
            "target_dtype": recipe.target.dtype, "target_num_hidden_layers": plan.drafter.target_num_hidden_layers,
            "aux_layer_ids": list(plan.drafter.aux_layer_ids), "mask_token_id": plan.drafter.mask_token_id,
            "draft_vocab_size": vd, "vocab_size": plan.drafter.vocab_size, "pad_token_id": pad_id(tokenizer),
            "max_length_tokens": recipe.data.max_length_tokens, "capture": recipe.capture.model_dump(mode="json"),
            "num_conversations": len(tokenized), "num_tokens": int(sum(len(r["input_ids"]) for r in tokenized)),
            "hidden_states": "files" if model is not None else "online", "tokenize_s": tokenize_s}
    if model is not None:
        hs, w = out / HS_DIR, final_norm_weight(plan.target_dir)
        hs.mkdir(exist_ok=True)
        for s in range(0, len(tokenized), recipe.capture.batch_size):
            part = [dict(r, sample_id=str(i)) for i, r in enumerate(tokenized[s:s + recipe.capture.batch_size], s)]
            for r, smp in zip(part, capture_tokenized(model, part, recipe.capture, plan.drafter.aux_layer_ids,
                                                      pad_token_id=side["pad_token_id"],
                                                      max_length_tokens=side["max_length_tokens"])):
                save_file(speculators_sample(smp, w), str(hs / f"hs_{r['sample_id']}.safetensors"))
    (out / SIDE_FILE).write_text(json.dumps(side, indent=2))
    return side


class CaptureTransfer:
    """speculators' hidden-states transfer (the ``hs_connectors.HiddenStatesTransfer`` methods, duck-typed, so that
    this module imports without speculators) that captures sample ``i`` of the data directory on demand: peagle's
    ``capture_tokenized`` with the target of :data:`SIDE_FILE` (loaded once per data-loader worker, on the GPU when
    there is one), then :func:`speculators_sample`. Picklable: speculators' workers are spawned processes.
    """

    def __init__(self, data_path: str | Path):
        self.data_path = str(data_path)
        self._state: dict | None = None
        self.num_captured = 0

    def __getstate__(self) -> dict:
        return {"data_path": self.data_path, "_state": None, "num_captured": 0}

    def _load(self) -> dict:
        if self._state is None:
            from datasets import load_from_disk

            from pipelines.capture import load_target
            from pipelines.recipe.stages import CaptureConfig

            side = json.loads((Path(self.data_path) / SIDE_FILE).read_text())
            model, _ = load_target(side["target_dir"], side["target_dtype"])
            self._state = {"side": side, "model": model, "cfg": CaptureConfig(**side["capture"]),
                           "data": load_from_disk(self.data_path), "norm": final_norm_weight(side["target_dir"])}
        return self._state

    def setup(self) -> None:
        """Nothing to set up before the first sample (speculators calls it before generating)."""

    def get_cached(self, file_idx: int) -> dict[str, torch.Tensor]:
        from pipelines.capture import capture_tokenized

        st = self._load()
        row, side = st["data"][file_idx], st["side"]
        tok = [{"sample_id": str(file_idx), "input_ids": np.asarray(row["input_ids"], dtype=np.int32),
                "loss_mask": np.asarray(row["loss_mask"], dtype=np.uint8)}]
        (smp,) = capture_tokenized(st["model"], tok, st["cfg"], side["aux_layer_ids"],
                                   pad_token_id=side["pad_token_id"], max_length_tokens=side["max_length_tokens"],
                                   validate=False)
        self.num_captured += 1
        return {k: v.cpu() for k, v in speculators_sample(smp, st["norm"]).items()}

    def get_generated(self, hs_transfer_params: dict) -> None:
        raise RuntimeError(f"{BACKEND}: every sample is captured on demand; nothing is generated by vLLM")

    def delete(self, handle: str) -> None:
        """Nothing is stored."""


class CaptureBackend:
    """speculators' ``HiddenStatesBackend`` hooks for :class:`CaptureTransfer` (training only)."""

    @staticmethod
    def add_train_args(parser) -> None:
        """No flags of its own."""

    @staticmethod
    def add_launch_args(parser) -> None:
        """Not a vLLM connector."""

    @staticmethod
    def from_train_args(args, data_path: str) -> CaptureTransfer:
        return CaptureTransfer(data_path)

    @staticmethod
    def build_kv_transfer_config(args) -> dict:
        raise RuntimeError(f"{BACKEND} captures in the trainer: there is no vLLM server to configure")


def register_backend() -> None:
    """Make :data:`BACKEND` a choice of speculators' ``--hidden-states-backend`` (before its CLI is built)."""
    from hs_connectors import HiddenStatesBackend

    HiddenStatesBackend.registry.setdefault(BACKEND, CaptureBackend)
