"""Attention masks between drafter slots ("elements", ``peagle_core.elements``): the P-EAGLE rule,
as a dense bool mask (SDPA) or a flex-attention ``BlockMask``.

Rule (P-EAGLE arXiv 2602.01469, Sec. 3): query ``(a, d)`` sees key ``(a', 0)`` for ``a' <= a`` and
key ``(a, d')`` for ``d' <= d``, both in the same document; padding (``valid=False``) is never
attended. EAGLE-3's training-time test (``peagle_core.objectives.eagle3``) uses the same rule with
depth = TTT step, plus one extra diagonal so that each query also sees its own key.

Shape legend: Tq query slots, Tk key slots, M elements (queries = keys).
"""

from __future__ import annotations

from typing import Literal

import torch

from peagle_core.elements import Elements

try:
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask
except ImportError:  # pragma: no cover - torch without flex attention
    BlockMask = None  # type: ignore[assignment,misc]
    create_block_mask = None  # type: ignore[assignment]

AttentionImpl = Literal["auto", "dense", "flex"]
# How a flex BlockMask is built: "compiled" = torch.compile(create_block_mask) on CUDA (eager on CPU);
# "blockwise" = the block tables from the metadata, query blocks a chunk at a time, eager everywhere (no compile)
BlockMaskBuild = Literal["compiled", "blockwise"]
FLEX_BLOCK = 128  # flex BlockMask block size; element metadata is padded to a multiple of it
BLOCKWISE_ROWS = 16  # query blocks per chunk of the blockwise build: a [16 * FLEX_BLOCK, Tk] bool mask at a time


def attention_rule(qa, qd, qdoc, qvalid, ka, kd, kdoc, kvalid):
    """The P-EAGLE rule on broadcastable element metadata (shared by the dense and flex masks).

    Args:
        qa, qd, qdoc, qvalid: query anchor, depth, document, validity (e.g. ``[Tq, 1]``).
        ka, kd, kdoc, kvalid: key anchor, depth, document, validity (e.g. ``[1, Tk]``).

    Returns:
        Bool tensor of the broadcast shape (e.g. ``[Tq, Tk]``), True = the query attends the key:
        ``((kd == 0 & ka <= qa) | (ka == qa & kd <= qd)) & same document & both valid``.
    """
    rule = ((kd == 0) & (ka <= qa)) | ((ka == qa) & (kd <= qd))
    return rule & (qdoc == kdoc) & qvalid & kvalid


def pad_metadata(t: torch.Tensor, length: int, value: int | bool) -> torch.Tensor:
    """``t [n]`` extended with ``value`` to ``[length]`` (unchanged if ``n >= length``).

    ``create_block_mask`` evaluates ``mask_mod`` on indices up to whole blocks (``FLEX_BLOCK``), so
    the metadata a ``mask_mod`` reads is padded with values no real slot has (e.g. document -1 for
    queries, -2 for keys, ``False`` validity).
    """
    if t.shape[0] >= length:
        return t
    return torch.cat([t, t.new_full((length - t.shape[0],), value)])


def _diagonal(k: Elements | None, diagonal: int | None) -> int | None:
    """Self-attention (``k is None``) defaults to diagonal 0: every query also sees itself."""
    return 0 if (k is None and diagonal is None) else diagonal


def dense_element_mask(q: Elements, k: Elements | None = None, *, diagonal: int | None = None) -> torch.Tensor:
    """Bool attention mask ``[1, 1, Tq, Tk]`` (True = attend) between element sets.

    Args:
        q: ``Tq`` query slots.
        k: ``Tk`` key slots; ``None`` = the queries themselves.
        diagonal: if set, query i also attends key ``i + diagonal``. Default: 0 when ``k`` is
            None, so invalid (filler) queries attend to themselves only and no softmax row is
            empty (SDPA would return NaN); none otherwise.
    """
    kk = q if k is None else k
    diagonal = _diagonal(k, diagonal)
    m = attention_rule(q.anchor[:, None], q.depth[:, None], q.doc[:, None], q.valid[:, None],
                       kk.anchor[None], kk.depth[None], kk.doc[None], kk.valid[None])
    if diagonal is not None:
        qi = torch.arange(q.num_elements, device=m.device)[:, None]
        ki = torch.arange(kk.num_elements, device=m.device)[None]
        m = m | (ki == qi + diagonal)
    return m[None, None]


def flex_element_mask(
    q: Elements, k: Elements | None = None, *, compile: bool | None = None, diagonal: int | None = None,
    build: BlockMaskBuild = "compiled",
) -> BlockMask:
    """Flex-attention ``BlockMask`` with the same pattern as ``dense_element_mask``.

    ``build="compiled"``: ``create_block_mask``, compiled when ``compile`` (default: True on CUDA, False on CPU).
    ``build="blockwise"``: :func:`blockwise_block_tables`, the same block tables without ``create_block_mask``
    and without compilation (with two sequence partitions the compiled build did not finish within 80 s on an
    H100, torch 2.11: ``bench.mask_compile``). ``diagonal`` as in ``dense_element_mask``.

    Raises:
        RuntimeError: torch has no ``torch.nn.attention.flex_attention``.
        ValueError: an unknown ``build``.
    """
    if create_block_mask is None:  # pragma: no cover
        raise RuntimeError("this torch has no torch.nn.attention.flex_attention; use attention='dense'")
    if build not in ("compiled", "blockwise"):
        raise ValueError(f"build={build!r}: use 'compiled' or 'blockwise'")
    kk = q if k is None else k
    diagonal = _diagonal(k, diagonal)
    Tq, Tk = q.num_elements, kk.num_elements
    dev = q.anchor.device
    if compile is None:
        compile = dev.type == "cuda"
    # Metadata padded to whole blocks: create_block_mask evaluates mask_mod on padded indices.
    Lq = -(-Tq // FLEX_BLOCK) * FLEX_BLOCK
    Lk = -(-Tk // FLEX_BLOCK) * FLEX_BLOCK
    qa, qd, qdoc = (pad_metadata(t, Lq, -1) for t in (q.anchor, q.depth, q.doc))
    qv = pad_metadata(q.valid, Lq, False)
    ka, kd, kdoc = (pad_metadata(t, Lk, -2) for t in (kk.anchor, kk.depth, kk.doc))
    kv = pad_metadata(kk.valid, Lk, False)

    def mask_mod(b, h, qi, ki):
        m = attention_rule(qa[qi], qd[qi], qdoc[qi], qv[qi], ka[ki], kd[ki], kdoc[ki], kv[ki])
        if diagonal is not None:
            m = m | (ki == qi + diagonal)
        return m

    if build == "blockwise":
        tables = blockwise_block_tables(mask_mod, Tq, Tk, dev)
        return BlockMask.from_kv_blocks(*tables, BLOCK_SIZE=FLEX_BLOCK, mask_mod=mask_mod, seq_lengths=(Tq, Tk))
    return create_block_mask(mask_mod, None, None, Tq, Tk, device=dev, _compile=compile)


def blockwise_block_tables(
    mask_mod, Tq: int, Tk: int, device: torch.device, *, rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The block tables ``create_block_mask(mask_mod, None, None, Tq, Tk)`` computes (partial and full blocks,
    ``separate_full_blocks``), built eagerly: ``mask_mod`` evaluated on ``rows`` query blocks at a time against
    every key, padded with False to whole blocks, summed per ``FLEX_BLOCK`` x ``FLEX_BLOCK`` tile; a tile is full
    when every entry attends, partial when some do. Peak memory ~``rows * FLEX_BLOCK * Tk`` bools per
    intermediate, never ``Tq * Tk``.

    Args:
        mask_mod: ``(b, h, q_idx, kv_idx) -> bool`` on broadcastable index tensors (as flex's).
        Tq, Tk: query and key lengths.
        rows: query blocks per chunk (default :data:`BLOCKWISE_ROWS`).

    Returns:
        ``(kv_num_blocks [1, 1, Qb], kv_indices [1, 1, Qb, Kb], full_kv_num_blocks, full_kv_indices)``, int32,
        the indices of each row's blocks first in ascending order (``BlockMask.from_kv_blocks``'s input);
        ``Qb = ceil(Tq / FLEX_BLOCK)``, ``Kb = ceil(Tk / FLEX_BLOCK)``.
    """
    B, rows = FLEX_BLOCK, rows or BLOCKWISE_ROWS
    Qb, Kb = -(-Tq // B), -(-Tk // B)
    zero = torch.zeros((), dtype=torch.long, device=device)
    ki = torch.arange(Tk, device=device)[None]
    partial = torch.zeros(Qb, Kb, dtype=torch.bool, device=device)
    full = torch.zeros(Qb, Kb, dtype=torch.bool, device=device)
    for s in range(0, Qb, rows):
        e = min(Qb, s + rows)
        qi = torch.arange(s * B, min(e * B, Tq), device=device)[:, None]
        m = mask_mod(zero, zero, qi, ki).expand(qi.shape[0], Tk)
        m = torch.nn.functional.pad(m, (0, Kb * B - Tk, 0, (e - s) * B - qi.shape[0]))  # False outside [Tq, Tk)
        count = m.view(e - s, B, Kb, B).sum(dim=(1, 3))  # [rows, Kb] attending entries per tile
        full[s:e], partial[s:e] = count == B * B, (count > 0) & (count < B * B)

    def ordered(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        num = t.sum(dim=-1).to(torch.int32)
        idx = torch.argsort(t.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
        return num[None, None].contiguous(), idx[None, None].contiguous()

    return (*ordered(partial), *ordered(full))


def query_block_slice(mask: BlockMask, start: int, length: int, kv_length: int) -> BlockMask:
    """Query rows ``start:start+length`` of a flex ``BlockMask`` over keys ``0:kv_length``, without
    another ``create_block_mask``: the block tables are sliced and ``mask_mod`` is shifted by
    ``start`` (a tensor, so a compiled flex kernel is not specialised on it).

    EAGLE-3's training-time test uses it to cut the mask of each step out of one mask over all steps
    (``peagle_core.objectives.eagle3.ttt_flex_step_masks``).

    Args:
        mask: ``BlockMask`` with batch and head dims of size 1 and blocks of ``FLEX_BLOCK``.
        start, length, kv_length: multiples of ``FLEX_BLOCK``.

    Raises:
        ValueError: an argument is not block-aligned, or a row in the slice attends a key block at or
            after ``kv_length``.
    """
    if any(v % FLEX_BLOCK for v in (start, length, kv_length)):
        raise ValueError(f"start={start}, length={length}, kv_length={kv_length} must be multiples of {FLEX_BLOCK}")
    rows, cols = slice(start // FLEX_BLOCK, (start + length) // FLEX_BLOCK), kv_length // FLEX_BLOCK

    def cut(num, idx):
        if num is None:
            return None, None
        num, idx = num[:, :, rows], idx[:, :, rows]
        used = torch.arange(idx.shape[-1], device=idx.device) < num[..., None]
        if bool((used & (idx >= cols)).any()):
            raise ValueError(f"query rows {start}:{start + length} attend keys at or after {kv_length}")
        return num, idx[..., :cols].contiguous()

    kv_num, kv_idx = cut(mask.kv_num_blocks, mask.kv_indices)
    full_num, full_idx = cut(mask.full_kv_num_blocks, mask.full_kv_indices)
    base, offset = mask.mask_mod, torch.tensor(start, device=mask.kv_indices.device)

    def mask_mod(b, h, qi, ki):
        return base(b, h, qi + offset, ki)

    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=FLEX_BLOCK, mask_mod=mask_mod,
                                    seq_lengths=(length, kv_length))


def resolve_attention(attention: AttentionImpl, device: torch.device) -> str:
    """``"dense"`` or ``"flex"``: ``"auto"`` is flex on CUDA (when torch has flex attention), dense
    elsewhere; ``"dense"`` / ``"flex"`` are returned as given.

    Raises:
        ValueError: any other value.
    """
    if attention == "auto":
        return "flex" if device.type == "cuda" and create_block_mask is not None else "dense"
    if attention not in ("dense", "flex"):
        raise ValueError(f"attention={attention!r}: use 'auto', 'dense' or 'flex'")
    return attention


def element_mask(
    q: Elements, k: Elements | None = None, *, attention: AttentionImpl = "auto", diagonal: int | None = None,
    block_mask: BlockMaskBuild = "compiled",
):
    """Dense bool ``[1, 1, Tq, Tk]`` or flex ``BlockMask`` for the elements (see module doc);
    ``diagonal`` as in ``dense_element_mask``, ``block_mask`` as ``flex_element_mask``'s ``build``.

    Raises:
        ValueError: unknown ``attention`` or ``block_mask``.
    """
    impl = resolve_attention(attention, q.anchor.device)
    if impl == "flex":
        return flex_element_mask(q, k, diagonal=diagonal, build=block_mask)
    return dense_element_mask(q, k, diagonal=diagonal)


__all__ = [
    "BLOCKWISE_ROWS",
    "FLEX_BLOCK",
    "AttentionImpl",
    "BlockMaskBuild",
    "attention_rule",
    "blockwise_block_tables",
    "dense_element_mask",
    "element_mask",
    "flex_element_mask",
    "pad_metadata",
    "query_block_slice",
    "resolve_attention",
]
