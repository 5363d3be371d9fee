"""Captured target states on disk: safetensors shards, a parquet manifest, checksums, capacity.

No Ray here: the trainer on a bare GPU box reads a capture with :func:`iter_samples` alone.

A captured sample (one conversation) is a dict::

    sample_id     str
    input_ids     int32      [N]          target token ids (chat template applied)
    loss_mask     uint8/bool [N]          1 on assistant tokens (what the target generated)
    aux           float      [N, 3*Ht]    aux hidden states at vLLM layer ids (input of layer i), concatenated
    final_hidden  float      [N, Ht]      target's last hidden state AFTER its final norm: logits = lm_head(final_hidden)

Why ``final_hidden`` and not the target's draft-vocab log-probs: the loss needs the target
distribution over the draft vocab at every position; storing it costs ``Vd * 2`` bytes/token
(e.g. Vd = 32k -> 64 KiB/token in bf16) against ``Ht * 2`` for the final hidden state
(SmolLM2: 1.1 KiB, Llama-3.1-8B: 8 KiB), i.e. 8-55x less; and the draft vocabulary (d2t) can be
chosen after capture. The trainer recomputes ``lm_head(final_hidden)[:, t2d]`` (Ht x Vd FLOPs per
token, small next to the drafter).

A shard ``shard-00000.safetensors`` holds its samples concatenated along tokens::

    input_ids [sum N] int32, loss_mask [sum N] uint8, aux [sum N, 3*Ht], final_hidden [sum N, Ht]
    offsets [S] int64, lengths [S] int64

plus header metadata (JSON strings): ``sample_ids``, ``checksums`` (sha256 per sample over its
bytes), ``format_version`` and the writer's own keys. Files are written to a temporary name and
renamed, so a shard on disk is either absent or complete; bit rot or truncation is caught by
checksums on read (:class:`ShardError`, naming the file).

Shape legend: N tokens of one sample, S samples in a shard, Ht target hidden size, V target vocab.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

FORMAT_VERSION = "1"
SAMPLE_KEYS = ("input_ids", "loss_mask", "aux", "final_hidden")
HIDDEN_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
}
MANIFEST_COLUMNS = ("sample_id", "shard", "offset", "length", "checksum")
MANIFEST_NAME = "manifest.parquet"
META_NAME = "capture_meta.json"
TOKEN_COUNTS_NAME = "token_counts.safetensors"
ID_BYTES, MASK_BYTES = 4, 1  # int32 ids, uint8 mask


class ShardError(ValueError):
    """A shard or manifest on disk is missing, truncated, corrupted or inconsistent (message names the file)."""


def shard_name(index: int) -> str:
    """File name of shard ``index``: ``shard-00000.safetensors``."""
    return f"shard-{index:05d}.safetensors"


def dtype_name(dtype: torch.dtype | str) -> str:
    """``"float16" | "bfloat16" | "float32"`` for a torch dtype or name.

    Raises:
        ValueError: any other dtype.
    """
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if name not in HIDDEN_DTYPES:
        raise ValueError(f"hidden-state dtype {dtype!r} is not supported; use one of {sorted(HIDDEN_DTYPES)}")
    return name


# ----------------------------------------------------------------------------------------------
# capacity


def bytes_per_token(hidden_size: int, dtype: torch.dtype | str, num_aux: int = 3) -> int:
    """Bytes one captured token takes on disk: int32 id + uint8 mask + (num_aux + 1) x Ht hidden values.

    SmolLM2-135M (Ht = 576) in bf16: 4 + 1 + 4*576*2 = 4613 B; Llama-3.1-8B (Ht = 4096): 32 KiB + 5 B.
    """
    itemsize = HIDDEN_DTYPES[dtype_name(dtype)].itemsize
    return ID_BYTES + MASK_BYTES + (num_aux + 1) * int(hidden_size) * itemsize


def estimate_storage_bytes(
    num_samples: int, mean_len: float, hidden_size: int, dtype: torch.dtype | str = "bfloat16", num_aux: int = 3
) -> int:
    """Storage of a materialized capture: ``num_samples x mean_len tokens x bytes_per_token`` (shard
    headers and the manifest are negligible).

    Example: 30k samples x 64k tokens of GPT-OSS-120B (Ht = 2880) in bf16 -> ~45 TB (SpecForge users
    report 35 TB for that recipe), which is why long-context recipes should stream instead.

    Raises:
        ValueError: negative counts/lengths or a non-positive hidden size.
    """
    if num_samples < 0 or mean_len < 0 or hidden_size <= 0:
        raise ValueError(
            f"estimate_storage_bytes needs num_samples >= 0, mean_len >= 0, hidden_size > 0; got "
            f"{num_samples}, {mean_len}, {hidden_size}"
        )
    return round(num_samples * mean_len * bytes_per_token(hidden_size, dtype, num_aux))


def format_bytes(num_bytes: float) -> str:
    """``1536 -> '1.5 KiB'`` (binary units)."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(value) < 1024 or unit == "PiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


# ----------------------------------------------------------------------------------------------
# validation and checksums


def _as_tensor(x: Any) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x
    return torch.from_numpy(np.ascontiguousarray(x))


def _raw_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach().contiguous()
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def sample_checksum(sample: Mapping[str, Any]) -> str:
    """sha256 (hex) over dtype, shape and bytes of ``input_ids, loss_mask, aux, final_hidden``.

    ``loss_mask`` is hashed as uint8 (bool and uint8 masks give the same checksum).
    """
    h = hashlib.sha256()
    for key in SAMPLE_KEYS:
        t = _as_tensor(sample[key])
        if key == "loss_mask":
            t = t.to(torch.uint8)
        h.update(f"{key}:{str(t.dtype).removeprefix('torch.')}:{tuple(t.shape)};".encode())
        h.update(_raw_bytes(t))
    return h.hexdigest()


def validate_sample(
    sample: Mapping[str, Any],
    *,
    hidden_size: int | None = None,
    num_aux: int = 3,
    dtype: torch.dtype | str | None = None,
    max_length: int | None = None,
) -> None:
    """Check one captured sample against the contract above, before it is written.

    Raises:
        ValueError: naming the sample id and the field: a missing key; ``input_ids`` not 1-D integer
            or empty; ``loss_mask`` of another length, not 0/1, or all zero (no assistant tokens);
            ``aux`` not ``[N, num_aux*Ht]`` / ``final_hidden`` not ``[N, Ht]``; hidden states of an
            unsupported or unexpected dtype, or holding NaN/Inf; more than ``max_length`` tokens.
    """
    sid = sample.get("sample_id")
    where = f"sample {sid!r}"
    if not isinstance(sid, str) or not sid:
        raise ValueError(f"{where}: sample_id must be a non-empty str, got {type(sid).__name__}")
    missing = [k for k in SAMPLE_KEYS if k not in sample]
    if missing:
        raise ValueError(f"{where}: missing {missing}; a captured sample needs {list(SAMPLE_KEYS)}")
    ids, mask = _as_tensor(sample["input_ids"]), _as_tensor(sample["loss_mask"])
    aux, fin = _as_tensor(sample["aux"]), _as_tensor(sample["final_hidden"])
    if ids.dim() != 1 or ids.numel() == 0 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"{where}: input_ids must be a non-empty 1-D integer tensor, got {ids.dtype} {tuple(ids.shape)}")
    n = ids.numel()
    if max_length is not None and n > max_length:
        raise ValueError(f"{where}: {n} tokens > max_length_tokens={max_length}; truncate or drop it first")
    if tuple(mask.shape) != (n,):
        raise ValueError(f"{where}: loss_mask shape {tuple(mask.shape)} != input_ids shape ({n},)")
    if mask.dtype not in (torch.bool, torch.uint8):
        raise ValueError(f"{where}: loss_mask dtype {mask.dtype}; use bool or uint8")
    if mask.dtype == torch.uint8 and bool((mask > 1).any()):
        raise ValueError(f"{where}: loss_mask holds values other than 0/1")
    if not bool(mask.any()):
        raise ValueError(f"{where}: loss_mask is all zero (no assistant tokens); drop empty assistant turns")
    for name, t in (("aux", aux), ("final_hidden", fin)):
        if t.dtype not in HIDDEN_DTYPES.values():
            raise ValueError(f"{where}: {name} dtype {t.dtype}; use one of {sorted(HIDDEN_DTYPES)}")
        if dtype is not None and t.dtype != HIDDEN_DTYPES[dtype_name(dtype)]:
            raise ValueError(f"{where}: {name} dtype {t.dtype} != capture dtype {dtype_name(dtype)}")
        if t.dim() != 2 or t.shape[0] != n:
            raise ValueError(f"{where}: {name} shape {tuple(t.shape)}; expected [{n}, ...] (one row per token)")
    ht = fin.shape[1]
    if hidden_size is not None and ht != hidden_size:
        raise ValueError(f"{where}: final_hidden width {ht} != target hidden_size {hidden_size}")
    if aux.shape[1] != num_aux * ht:
        raise ValueError(f"{where}: aux width {aux.shape[1]} != {num_aux} x hidden {ht} (3 aux layers concatenated)")
    if aux.dtype != fin.dtype:
        raise ValueError(f"{where}: aux dtype {aux.dtype} != final_hidden dtype {fin.dtype}")
    for name, t in (("aux", aux), ("final_hidden", fin)):
        if not bool(torch.isfinite(t).all()):
            num_bad = int((~torch.isfinite(t)).sum())
            raise ValueError(f"{where}: {name} holds {num_bad} NaN/Inf values (target forward overflowed?)")


# ----------------------------------------------------------------------------------------------
# shards


@dataclass
class Shard:
    """One shard read back: concatenated tensors, per-sample offsets/lengths, header metadata."""

    path: Path
    tensors: dict[str, torch.Tensor]
    sample_ids: list[str]
    checksums: list[str]
    metadata: dict[str, str] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.sample_ids)

    def sample(self, i: int) -> dict[str, Any]:
        """Sample ``i`` as a dict of views into the shard tensors."""
        off, n = int(self.tensors["offsets"][i]), int(self.tensors["lengths"][i])
        out: dict[str, Any] = {"sample_id": self.sample_ids[i]}
        for key in SAMPLE_KEYS:
            out[key] = self.tensors[key][off:off + n]
        return out

    def samples(self) -> Iterator[dict[str, Any]]:
        for i in range(len(self)):
            yield self.sample(i)

    def rows(self) -> list[dict[str, Any]]:
        """Manifest rows (``sample_id, shard, offset, length, checksum``)."""
        offs, lens = self.tensors["offsets"].tolist(), self.tensors["lengths"].tolist()
        return [
            {"sample_id": s, "shard": self.path.name, "offset": o, "length": n, "checksum": c}
            for s, o, n, c in zip(self.sample_ids, offs, lens, self.checksums)
        ]


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temp file in the same directory, fsync, rename (readers never see a partial file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_shard(
    path: str | Path,
    samples: Sequence[Mapping[str, Any]],
    *,
    metadata: Mapping[str, Any] | None = None,
    validate: bool = True,
) -> list[dict[str, Any]]:
    """Write ``samples`` (see module docstring) into one safetensors shard, atomically.

    ``metadata``: extra header keys (values JSON-encoded unless already str). An empty ``samples``
    writes a valid empty shard (all samples of that slot were dropped), so resume sees it as done.

    Returns:
        manifest rows ``[{sample_id, shard, offset, length, checksum}]`` in sample order.

    Raises:
        ValueError: a sample fails :func:`validate_sample`, duplicate sample ids, mixed dtypes or
            widths, or a metadata key clashing with a reserved one.
    """
    from safetensors.torch import save

    path = Path(path)
    samples = list(samples)
    if validate:
        for s in samples:
            validate_sample(s)
    ids = [s["sample_id"] for s in samples]
    if len(set(ids)) != len(ids):
        dup = sorted({i for i in ids if ids.count(i) > 1})
        raise ValueError(f"{path.name}: duplicate sample ids {dup[:5]}")
    if samples:
        aux0, fin0 = _as_tensor(samples[0]["aux"]), _as_tensor(samples[0]["final_hidden"])
        for s in samples:
            a, f = _as_tensor(s["aux"]), _as_tensor(s["final_hidden"])
            if a.dtype != aux0.dtype or a.shape[1] != aux0.shape[1] or f.shape[1] != fin0.shape[1]:
                raise ValueError(
                    f"{path.name}: sample {s['sample_id']!r} has aux {a.dtype} {tuple(a.shape)} / final_hidden "
                    f"{tuple(f.shape)} unlike the first sample's {aux0.dtype} {tuple(aux0.shape)}; one shard, one layout"
                )
        tensors = {
            "input_ids": torch.cat([_as_tensor(s["input_ids"]).to(torch.int32) for s in samples]),
            "loss_mask": torch.cat([_as_tensor(s["loss_mask"]).to(torch.uint8) for s in samples]),
            "aux": torch.cat([_as_tensor(s["aux"]) for s in samples]).contiguous(),
            "final_hidden": torch.cat([_as_tensor(s["final_hidden"]) for s in samples]).contiguous(),
        }
    else:  # safetensors accepts zero-size tensors
        tensors = {
            "input_ids": torch.zeros(0, dtype=torch.int32),
            "loss_mask": torch.zeros(0, dtype=torch.uint8),
            "aux": torch.zeros(0, 0, dtype=torch.float32),
            "final_hidden": torch.zeros(0, 0, dtype=torch.float32),
        }
    lengths = torch.tensor([_as_tensor(s["input_ids"]).numel() for s in samples], dtype=torch.int64)
    offsets = torch.cumsum(lengths, 0) - lengths
    tensors["offsets"], tensors["lengths"] = offsets, lengths
    checksums = [sample_checksum(s) for s in samples]
    header = {k: v if isinstance(v, str) else json.dumps(v, sort_keys=True) for k, v in (metadata or {}).items()}
    clash = {"format_version", "sample_ids", "checksums"} & set(header)
    if clash:
        raise ValueError(f"{path.name}: metadata keys {sorted(clash)} are reserved by the shard format")
    header.update(format_version=FORMAT_VERSION, sample_ids=json.dumps(ids), checksums=json.dumps(checksums))
    _atomic_write_bytes(path, save(tensors, metadata=header))
    return [
        {"sample_id": s, "shard": path.name, "offset": int(o), "length": int(n), "checksum": c}
        for s, o, n, c in zip(ids, offsets.tolist(), lengths.tolist(), checksums)
    ]


def shard_header(path: str | Path) -> dict[str, str]:
    """Header metadata of a shard without reading its tensors (cheap; for resume decisions).

    Raises:
        ShardError: missing or unparseable file (e.g. truncated header).
    """
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise ShardError(f"shard {path} does not exist")
    try:
        with safe_open(str(path), framework="pt") as f:
            return dict(f.metadata() or {})
    except Exception as e:  # safetensors raises its own SafetensorError / OSError
        raise ShardError(f"shard {path} is unreadable ({type(e).__name__}: {e}); delete it and re-run capture") from e


def read_shard(path: str | Path, verify: bool = True) -> Shard:
    """Read a shard written by :func:`write_shard`.

    ``verify=True`` recomputes every sample's sha256 and compares it with the header (about
    1 s per GB); ``verify=False`` still checks structure (sizes, offsets).

    Raises:
        ShardError: naming ``path``: missing, truncated or unparseable file; missing tensors;
            offsets/lengths inconsistent with the tensors; a checksum mismatch (names the sample).
    """
    from safetensors.torch import load

    path = Path(path)
    if not path.is_file():
        raise ShardError(f"shard {path} does not exist")
    data = path.read_bytes()
    try:
        tensors = load(data)
        header = shard_header(path)
    except ShardError:
        raise
    except Exception as e:
        raise ShardError(
            f"shard {path} is truncated or corrupt ({type(e).__name__}: {e}); delete it and re-run capture"
        ) from e
    missing = [k for k in (*SAMPLE_KEYS, "offsets", "lengths") if k not in tensors]
    if missing or "sample_ids" not in header or "checksums" not in header:
        raise ShardError(f"shard {path} lacks {missing or ['sample_ids/checksums header']}; not a peagle shard")
    if header.get("format_version") != FORMAT_VERSION:
        raise ShardError(f"shard {path}: format_version {header.get('format_version')!r} != {FORMAT_VERSION}")
    try:
        sample_ids, checksums = json.loads(header["sample_ids"]), json.loads(header["checksums"])
    except ValueError as e:
        raise ShardError(f"shard {path}: header JSON is corrupt ({e})") from e
    offs, lens = tensors["offsets"], tensors["lengths"]
    total = tensors["input_ids"].numel()
    n_s = len(sample_ids)
    consistent = (
        len(checksums) == n_s == offs.numel() == lens.numel()
        and all(tensors[k].shape[0] == total for k in SAMPLE_KEYS)
        and (n_s == 0 or (int(lens.sum()) == total and bool((offs == torch.cumsum(lens, 0) - lens).all())))
    )
    if not consistent:
        raise ShardError(f"shard {path}: offsets/lengths/sample ids do not match its {total} tokens; corrupt shard")
    shard = Shard(path, tensors, sample_ids, checksums, header)
    if verify:
        for i, want in enumerate(checksums):
            got = sample_checksum(shard.sample(i))
            if got != want:
                raise ShardError(
                    f"shard {path}: checksum mismatch for sample {sample_ids[i]!r} (stored {want[:12]}..., "
                    f"computed {got[:12]}...); the file is corrupt, delete it and re-run capture"
                )
    return shard


# ----------------------------------------------------------------------------------------------
# manifest and capture directory


def write_manifest(capture_dir: str | Path, rows: Iterable[Mapping[str, Any]]) -> Path:
    """Write ``manifest.parquet`` (columns ``sample_id, shard, offset, length, checksum``) atomically.

    Raises:
        ValueError: duplicate sample ids.
    """
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = list(rows)
    ids = [r["sample_id"] for r in rows]
    if len(set(ids)) != len(ids):
        raise ValueError(f"manifest for {capture_dir}: duplicate sample ids")
    table = pa.table({
        "sample_id": pa.array(ids, pa.string()),
        "shard": pa.array([r["shard"] for r in rows], pa.string()),
        "offset": pa.array([int(r["offset"]) for r in rows], pa.int64()),
        "length": pa.array([int(r["length"]) for r in rows], pa.int64()),
        "checksum": pa.array([r["checksum"] for r in rows], pa.string()),
    })
    buf = io.BytesIO()
    pq.write_table(table, buf)
    path = Path(capture_dir) / MANIFEST_NAME
    _atomic_write_bytes(path, buf.getvalue())
    return path


def load_manifest(capture_dir: str | Path):
    """``manifest.parquet`` of a capture as a ``pyarrow.Table`` (``.to_pylist()`` for rows).

    Raises:
        ShardError: no manifest (the capture did not finish: re-run it to resume) or wrong columns.
    """
    import pyarrow.parquet as pq

    path = Path(capture_dir) / MANIFEST_NAME
    if not path.is_file():
        raise ShardError(f"{path} does not exist: the capture did not finish; re-run capture to resume it")
    try:
        table = pq.read_table(path)
    except Exception as e:
        raise ShardError(f"{path} is unreadable ({type(e).__name__}: {e})") from e
    missing = [c for c in MANIFEST_COLUMNS if c not in table.column_names]
    if missing:
        raise ShardError(f"{path} lacks columns {missing}")
    return table


def write_capture_meta(capture_dir: str | Path, meta: Mapping[str, Any]) -> Path:
    """Write ``capture_meta.json`` atomically (target path/sha, aux layer ids, dtype, sizes, counts)."""
    path = Path(capture_dir) / META_NAME
    _atomic_write_bytes(path, (json.dumps(dict(meta), indent=2, sort_keys=True, default=str) + "\n").encode())
    return path


def load_capture_meta(capture_dir: str | Path) -> dict[str, Any]:
    """``capture_meta.json`` of a capture.

    Raises:
        ShardError: missing or unparseable.
    """
    path = Path(capture_dir) / META_NAME
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ShardError(f"{path} is missing or corrupt ({e})") from e


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16; float32 holds it exactly
        t = t.to(torch.float32)
    return t.numpy()


def iter_samples(
    capture_dir: str | Path, verify: bool = True, *, as_numpy: bool = False, shards: Sequence[str] | None = None
) -> Iterator[dict[str, Any]]:
    """Samples of a materialized capture in manifest order (torch views, or numpy with ``as_numpy``;
    bf16 becomes float32 in numpy).

    ``verify=True`` checks each sample's sha256 against the shard header; the manifest's
    offset/length/checksum are always checked against the shard. ``shards`` limits to those file names.

    Raises:
        ShardError: missing manifest, a missing/corrupt shard, or a manifest row disagreeing with its shard.
    """
    capture_dir = Path(capture_dir)
    rows = load_manifest(capture_dir).to_pylist()
    by_shard: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_shard.setdefault(r["shard"], []).append(r)
    for name, want in by_shard.items():
        if shards is not None and name not in shards:
            continue
        shard = read_shard(capture_dir / name, verify=verify)
        index = {r["sample_id"]: (i, r) for i, r in enumerate(shard.rows())}
        for r in want:
            hit = index.get(r["sample_id"])
            if hit is None or (hit[1]["offset"], hit[1]["length"], hit[1]["checksum"]) != (
                r["offset"], r["length"], r["checksum"]
            ):
                raise ShardError(
                    f"shard {shard.path}: manifest row for {r['sample_id']!r} does not match the shard "
                    f"(manifest {r['offset']}/{r['length']}/{r['checksum'][:12]}, shard {hit and hit[1]}); "
                    "re-run capture to rebuild"
                )
            s = shard.sample(hit[0])
            yield {k: (_to_numpy(v) if as_numpy and isinstance(v, torch.Tensor) else v) for k, v in s.items()}


# ----------------------------------------------------------------------------------------------
# token counts (draft vocabulary, d2t/t2d)


def count_token_ids(
    token_ids: Iterable[Sequence[int] | np.ndarray | torch.Tensor], vocab_size: int,
    masks: Iterable[Any] | None = None,
) -> torch.Tensor:
    """``[V]`` int64 counts of target ids over sequences (only where ``mask`` is set when given).

    Raises:
        ValueError: an id outside ``[0, vocab_size)``.
    """
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    mask_iter = iter(masks) if masks is not None else None
    for ids in token_ids:
        t = _as_tensor(np.asarray(ids) if not isinstance(ids, torch.Tensor) else ids).to(torch.int64).reshape(-1)
        if mask_iter is not None:
            t = t[_as_tensor(np.asarray(next(mask_iter))).reshape(-1).to(torch.bool)]
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= vocab_size):
            raise ValueError(f"token id {int(t.max())} or {int(t.min())} outside [0, vocab_size={vocab_size})")
        counts += torch.bincount(t, minlength=vocab_size)
    return counts


def save_token_counts(path: str | Path, counts: torch.Tensor, metadata: Mapping[str, Any] | None = None) -> Path:
    """Write ``counts [V]`` int64 as ``token_counts.safetensors`` (key ``counts``), atomically."""
    from safetensors.torch import save

    path = Path(path)
    header = {k: v if isinstance(v, str) else json.dumps(v, sort_keys=True) for k, v in (metadata or {}).items()}
    _atomic_write_bytes(path, save({"counts": counts.to(torch.int64).contiguous()}, metadata=header))
    return path


def load_token_counts(path: str | Path) -> torch.Tensor:
    """``counts [V]`` int64 from :func:`save_token_counts` (input of ``vocab_mapping_from_counts``).

    Raises:
        ShardError: missing or corrupt file.
    """
    from safetensors.torch import load_file

    try:
        return load_file(str(path))["counts"]
    except Exception as e:
        raise ShardError(f"token counts {path} missing or corrupt ({type(e).__name__}: {e})") from e
