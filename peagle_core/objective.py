"""Training objectives of a drafter head: the P-EAGLE parallel-group objective and a registry.

Source: P-EAGLE (arXiv 2602.01469, Sec. 3-4: parallel groups, COD sampling after PARD arXiv
2504.18583, the training attention mask, Algorithm 1 sequence partition); slot layout from vLLM
(``vllm/v1/spec_decode/llm_base_proposer.py``): the drafter slot at position ``p`` holds token
``x[p+1]`` and the target's aux hidden states at ``p``, and predicts ``x[p+2]``.

One *element* is a drafter slot ``(anchor a, depth d)``:

* depth 0: token ``x[a+1]``, hidden ``combine_hidden_states(aux[a])`` (next-token prediction);
* depth d >= 1: token ``mask_token_id``, hidden ``fc(mask_hidden)`` (multi-token prediction);
* RoPE position ``position_ids[a] + d`` (position within the document);
* it predicts ``x[a+d+2]``; the target distribution is
  ``softmax(target_lm_head(final_hidden[a+d+1]))`` restricted to the draft vocabulary.

A *loss element* is an element with ``a+d+2`` inside the same document and
``loss_mask[a+d+2]`` (an assistant token), kept by COD sampling. Every depth-0 element whose
token ``x[a+1]`` exists is in the forward (as a key), with or without a loss.

Attention (P-EAGLE Sec. 3): query ``(a, d)`` sees key ``(a', 0)`` for ``a' <= a`` and key
``(a, d')`` for ``d' <= d``, both in the same document; padding is never attended.

Element order: elements are sorted by ``(segment key, depth, anchor)`` with segment key = anchor
for depth 0 and anchor + 1 for depth >= 1, so every segment of Algorithm 1 is a contiguous slice
(see ``peagle_core.partition``).

Shape legend: N tokens of a packed sequence, M elements, T slots in one forward, K depths,
H drafter hidden, Ht target hidden, V target vocab, Vd draft vocab.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Literal

import torch
from torch import nn

from peagle_core.drafter import Eagle3Drafter
from peagle_core.fsdp import run_in_forward
from peagle_core.loss import LossImpl, linear_distill_loss

try:
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask
except ImportError:  # pragma: no cover - torch without flex attention
    BlockMask = None  # type: ignore[assignment,misc]
    create_block_mask = None  # type: ignore[assignment]

AttentionImpl = Literal["auto", "dense", "flex"]
LossKind = Literal["kl", "ce"]
FLEX_BLOCK = 128  # flex BlockMask block size; element metadata is padded to a multiple of it


# --------------------------------------------------------------------------------------------
# Packed batches
# --------------------------------------------------------------------------------------------


@dataclass
class PackedBatch:
    """One packed sequence of one or more documents (samples), what one forward trains on.

    Args:
        input_ids: ``[N]`` int64 token ids (target vocabulary).
        loss_mask: ``[N]`` bool, True at assistant tokens (the tokens a loss may predict).
        doc_ids: ``[N]`` int64, document index inside the pack (non-decreasing).
        position_ids: ``[N]`` int64, position inside the document (RoPE).
        aux: ``[N, 3*Ht]`` target aux hidden states (vLLM layer ids, "input of layer i").
        final_hidden: ``[N, Ht]`` target last hidden state AFTER the final norm (its
            ``lm_head`` gives the target's next-token logits).
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    doc_ids: torch.Tensor
    position_ids: torch.Tensor
    aux: torch.Tensor
    final_hidden: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> PackedBatch:
        """Move to ``device``; ``dtype`` (if given) applies to ``aux`` and ``final_hidden``."""
        return PackedBatch(
            input_ids=self.input_ids.to(device), loss_mask=self.loss_mask.to(device),
            doc_ids=self.doc_ids.to(device), position_ids=self.position_ids.to(device),
            aux=self.aux.to(device, dtype), final_hidden=self.final_hidden.to(device, dtype),
        )

    def validate(self, *, aux_width: int | None = None, target_hidden_size: int | None = None) -> None:
        """Check shapes and dtypes.

        Raises:
            ValueError: naming the field, for mismatched lengths, wrong ranks or widths.
        """
        N = self.num_tokens
        if self.input_ids.dim() != 1 or N < 1:
            raise ValueError(f"input_ids must be a non-empty 1-D tensor [N], got shape {tuple(self.input_ids.shape)}")
        for name in ("loss_mask", "doc_ids", "position_ids"):
            t = getattr(self, name)
            if tuple(t.shape) != (N,):
                raise ValueError(f"{name} has shape {tuple(t.shape)}, expected [N]=({N},) like input_ids")
        for name in ("aux", "final_hidden"):
            t = getattr(self, name)
            if t.dim() != 2 or t.shape[0] != N:
                raise ValueError(f"{name} has shape {tuple(t.shape)}, expected [N={N}, width]")
        if aux_width is not None and self.aux.shape[1] != aux_width:
            raise ValueError(f"aux width {self.aux.shape[1]} != 3*target_hidden_size={aux_width} of the drafter")
        if target_hidden_size is not None and self.final_hidden.shape[1] != target_hidden_size:
            raise ValueError(f"final_hidden width {self.final_hidden.shape[1]} != target_hidden_size={target_hidden_size}")
        if self.loss_mask.dtype != torch.bool:
            raise ValueError(f"loss_mask must be bool, got {self.loss_mask.dtype}")


def pack_samples(samples: Iterable[dict[str, Any]], max_tokens: int) -> list[PackedBatch]:
    """Greedy in-order packing of samples into sequences of at most ``max_tokens`` tokens.

    Args:
        samples: dicts with ``input_ids [n]``, ``loss_mask [n]`` (bool or 0/1), ``aux [n, 3*Ht]``,
            ``final_hidden [n, Ht]`` (tensors or array-likes).
        max_tokens: token budget of one packed sequence.

    Returns:
        Packed sequences; documents keep their order; ``doc_ids`` count from 0 in each pack and
        ``position_ids`` restart at 0 per document. A sample longer than ``max_tokens`` is cut to
        its first ``max_tokens`` tokens (with a warning).

    Raises:
        ValueError: ``max_tokens < 2``, a sample missing a key, or a sample with inconsistent
            lengths (names the sample index and key).
    """
    if max_tokens < 2:
        raise ValueError(f"max_tokens={max_tokens} must be >= 2 (a slot needs a token and a label)")
    keys = ("input_ids", "loss_mask", "aux", "final_hidden")
    packs: list[PackedBatch] = []
    cur: list[dict[str, torch.Tensor]] = []
    cur_len = 0
    num_cut = 0

    def flush() -> None:
        nonlocal cur, cur_len
        if cur:
            packs.append(PackedBatch(
                input_ids=torch.cat([s["input_ids"] for s in cur]),
                loss_mask=torch.cat([s["loss_mask"] for s in cur]),
                doc_ids=torch.cat([torch.full((len(s["input_ids"]),), i, dtype=torch.long) for i, s in enumerate(cur)]),
                position_ids=torch.cat([torch.arange(len(s["input_ids"])) for s in cur]),
                aux=torch.cat([s["aux"] for s in cur]),
                final_hidden=torch.cat([s["final_hidden"] for s in cur]),
            ))
        cur, cur_len = [], 0

    for i, sample in enumerate(samples):
        missing = [k for k in keys if k not in sample]
        if missing:
            raise ValueError(f"sample {i} lacks {missing}; each sample needs {list(keys)}")
        s = {k: torch.as_tensor(sample[k]) for k in keys}
        s["input_ids"] = s["input_ids"].long().flatten()
        s["loss_mask"] = s["loss_mask"].bool().flatten()
        n = len(s["input_ids"])
        for k in ("loss_mask", "aux", "final_hidden"):
            if s[k].shape[0] != n:
                raise ValueError(f"sample {i}: {k} has {s[k].shape[0]} rows but input_ids has {n} tokens")
        if n == 0:
            continue
        if n > max_tokens:
            s = {k: v[:max_tokens] for k, v in s.items()}
            n = max_tokens
            num_cut += 1
        if cur_len + n > max_tokens:
            flush()
        cur.append(s)
        cur_len += n
    flush()
    if num_cut:
        warnings.warn(f"pack_samples: {num_cut} sample(s) longer than max_tokens={max_tokens} were truncated",
                      stacklevel=2)
    return packs


# --------------------------------------------------------------------------------------------
# Validity, COD sampling, elements
# --------------------------------------------------------------------------------------------


def label_valid(batch: PackedBatch, num_depths: int) -> torch.Tensor:
    """``[N, K]`` bool: slot (anchor a, depth d) has a loss label, i.e. ``a+d+2 < N``, in a's
    document, and ``loss_mask[a+d+2]``."""
    N = batch.num_tokens
    a = torch.arange(N, device=batch.device)[:, None]
    t = a + torch.arange(num_depths, device=batch.device)[None] + 2  # [N, K] label index
    inside = t < N
    tc = t.clamp(max=N - 1)
    return inside & (batch.doc_ids[tc] == batch.doc_ids[:, None]) & batch.loss_mask[tc]


def cod_sample(
    valid: torch.Tensor,
    ratio: float,
    min_ratio: float = 0.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """COD (conditional-on-distribution) sampling of loss elements per depth (PARD / P-EAGLE).

    Depth 0 keeps every valid anchor (``n0`` of them). Depth d keeps
    ``n_d = floor(max(ratio**d, min_ratio) * n0)`` anchors, drawn uniformly without replacement
    among the anchors kept at depth d-1 that are valid at depth d (all of them when fewer). The
    count is relative to depth 0 as in PARD and speculators' ``cod_sample``; the nesting
    (kept at d implies kept at d-1) keeps every kept element's shallower slots in the forward.

    Args:
        valid: ``[N, K]`` bool, ``label_valid`` of the batch (or any per-depth validity).
        ratio: r in (0, 1].
        min_ratio: r_min in [0, 1].
        generator: CPU generator for reproducible draws (``torch.randperm``, one call per depth
            with more candidates than slots).

    Returns:
        ``[N, K]`` bool, the kept loss elements.

    Raises:
        ValueError: ``ratio`` outside (0, 1], ``min_ratio`` outside [0, 1], ``valid`` not 2-D.
    """
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"cod_ratio={ratio} must be in (0, 1]")
    if not 0.0 <= min_ratio <= 1.0:
        raise ValueError(f"cod_min_ratio={min_ratio} must be in [0, 1]")
    if valid.dim() != 2:
        raise ValueError(f"valid must be [N, K], got shape {tuple(valid.shape)}")
    K = valid.shape[1]
    kept = torch.zeros_like(valid, dtype=torch.bool)
    kept[:, 0] = valid[:, 0]
    n0 = int(valid[:, 0].sum())
    for d in range(1, K):
        cand = torch.nonzero(kept[:, d - 1] & valid[:, d]).flatten()
        n = min(math.floor(max(ratio**d, min_ratio) * n0 + 1e-9), cand.numel())
        if n == cand.numel():
            chosen = cand
        else:
            perm = torch.randperm(cand.numel(), generator=generator)[:n].to(cand.device)
            chosen = cand[perm]
        kept[chosen, d] = True
    return kept


@dataclass
class Elements:
    """Drafter slots of one packed sequence, sorted by ``(seg_key, depth, anchor)``.

    All fields are ``[M]`` tensors on the batch device.

    Args:
        anchor: anchor position a (index into the packed sequence).
        depth: d (P-EAGLE depth, or the TTT step for EAGLE-3).
        doc: document id of the anchor.
        position: RoPE position ``position_ids[a] + d``.
        input_ids: token of the slot (``x[a+1]`` at depth 0, ``mask_token_id`` otherwise).
        target_index: ``a + d + 1``: row of ``final_hidden`` whose target logits are the label
            distribution (clamped into range where ``loss`` is False).
        loss: True for loss elements.
        valid: False for slots that exist only to fill a shape (never attended, no loss).
        seg_key: anchor for depth 0, anchor + 1 for depth >= 1 (Algorithm 1's segment key).
    """

    anchor: torch.Tensor
    depth: torch.Tensor
    doc: torch.Tensor
    position: torch.Tensor
    input_ids: torch.Tensor
    target_index: torch.Tensor
    loss: torch.Tensor
    valid: torch.Tensor
    seg_key: torch.Tensor

    @property
    def num_elements(self) -> int:
        return int(self.anchor.shape[0])

    @property
    def num_loss_elements(self) -> int:
        return int(self.loss.sum())

    def index(self, idx: torch.Tensor | slice) -> Elements:
        return Elements(**{f.name: getattr(self, f.name)[idx] for f in fields(self)})

    def to(self, device: torch.device | str) -> Elements:
        return Elements(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})

    def as_tuples(self) -> list[tuple[int, int]]:
        """``[(anchor, depth), ...]`` in element order (for tests and debugging)."""
        return list(zip(self.anchor.tolist(), self.depth.tolist()))


def build_peagle_elements(
    batch: PackedBatch,
    num_depths: int,
    mask_token_id: int,
    *,
    cod_ratio: float = 1.0,
    cod_min_ratio: float = 0.0,
    generator: torch.Generator | None = None,
) -> Elements:
    """The P-EAGLE parallel groups of one packed sequence, COD-sampled.

    Depth-0 elements: every anchor whose token ``x[a+1]`` lies in its document (loss element
    iff its label is valid). Depth >= 1 elements: the COD-kept loss elements only.

    Raises:
        ValueError: ``num_depths < 1``.
    """
    if num_depths < 1:
        raise ValueError(f"num_depths={num_depths} must be >= 1")
    N, dev = batch.num_tokens, batch.device
    valid = label_valid(batch, num_depths)
    kept = cod_sample(valid.cpu(), cod_ratio, cod_min_ratio, generator).to(dev)  # [N, K]
    ar = torch.arange(N, device=dev)
    nxt = (ar + 1).clamp(max=N - 1)
    has_token = (ar + 1 < N) & (batch.doc_ids[nxt] == batch.doc_ids)  # [N]
    present = kept.clone()
    present[:, 0] = has_token
    a, d = torch.nonzero(present, as_tuple=True)  # row-major: by anchor then depth
    seg_key = a + (d > 0).long()
    # Sort by (seg_key, depth, anchor): segments of Algorithm 1 become contiguous slices.
    order = torch.argsort(seg_key * (num_depths * (N + 1)) + d * (N + 1) + a)
    a, d, seg_key = a[order], d[order], seg_key[order]
    ids = torch.where(d == 0, batch.input_ids[nxt[a]], torch.full_like(a, mask_token_id))
    return Elements(
        anchor=a, depth=d, doc=batch.doc_ids[a], position=batch.position_ids[a] + d, input_ids=ids,
        target_index=(a + d + 1).clamp(max=N - 1), loss=kept[a, d], valid=torch.ones_like(a, dtype=torch.bool),
        seg_key=seg_key,
    )


def pad_elements(el: Elements, length: int) -> Elements:
    """Append filler slots (``valid=False``, no loss, depth 0 of anchor 0) up to ``length``."""
    n = length - el.num_elements
    if n <= 0:
        return el
    z = el.anchor.new_zeros(n)
    fill = Elements(anchor=z, depth=z, doc=z - 1, position=z, input_ids=z, target_index=z,
                    loss=z.bool(), valid=z.bool(), seg_key=z + int(el.seg_key.max()) if el.num_elements else z)
    return Elements(**{f.name: torch.cat([getattr(el, f.name), getattr(fill, f.name)]) for f in fields(el)})


def forward_order(el: Elements, num_depths: int) -> torch.Tensor:
    """``[M]`` permutation sorting elements by ``(doc, depth, anchor)``, the order of a forward.

    The depth-0 keys of a document then form one contiguous causal run, and a depth-d query block
    needs only the depth-0 blocks left of it plus the few blocks of its own anchors at depths < d.
    In Algorithm 1's ``(seg_key, depth, anchor)`` order depth-0 keys are interleaved with deeper
    slots and most of every flex block-mask tile is masked-out work (tile density 0.131 -> 0.073 at
    N=8192, K=8; ``bench/step_breakdown.py``). Attention results do not depend on slot order.
    """
    span = int(el.anchor.max()) + 2 if el.num_elements else 1
    return torch.argsort((el.doc * (num_depths + 1) + el.depth) * span + el.anchor)


def element_hidden(drafter: Eagle3Drafter, batch: PackedBatch, el: Elements) -> torch.Tensor:
    """Hidden-state input ``[M, H]`` of the elements: ``combine_hidden_states(aux[a])`` at depth 0,
    ``mask_slot_hidden()`` (``fc(mask_hidden)``) at depths >= 1 (P-EAGLE Sec. 3)."""
    is0 = el.depth == 0
    h0 = drafter.combine_hidden_states(batch.aux[el.anchor[is0]])  # [M0, H]
    if bool(is0.all()):
        return h0
    mask_h = drafter.mask_slot_hidden().to(h0.dtype).expand(el.num_elements, h0.shape[-1])
    return mask_h.index_put((torch.nonzero(is0).flatten(),), h0)


# --------------------------------------------------------------------------------------------
# Attention masks
# --------------------------------------------------------------------------------------------


def _allowed(qa, qd, qdoc, qvalid, ka, kd, kdoc, kvalid):
    """The P-EAGLE rule on broadcastable element metadata (shared by dense and flex)."""
    rule = ((kd == 0) & (ka <= qa)) | ((ka == qa) & (kd <= qd))
    return rule & (qdoc == kdoc) & qvalid & kvalid


def dense_element_mask(q: Elements, k: Elements | None = None) -> torch.Tensor:
    """Bool attention mask ``[1, 1, Tq, Tk]`` (True = attend) between element sets.

    With ``k=None`` the keys are the queries themselves; then invalid (filler) queries attend to
    themselves only, so no softmax row is empty (SDPA would return NaN).
    """
    kk = q if k is None else k
    m = _allowed(q.anchor[:, None], q.depth[:, None], q.doc[:, None], q.valid[:, None],
                 kk.anchor[None], kk.depth[None], kk.doc[None], kk.valid[None])
    if k is None:
        m = m | torch.eye(q.num_elements, dtype=torch.bool, device=m.device)
    return m[None, None]


def _pad_meta(t: torch.Tensor, length: int, value: int) -> torch.Tensor:
    if t.shape[0] >= length:
        return t
    return torch.cat([t, t.new_full((length - t.shape[0],), value)])


def flex_element_mask(q: Elements, k: Elements | None = None, *, compile: bool | None = None) -> BlockMask:
    """Flex-attention ``BlockMask`` with the same pattern as ``dense_element_mask``.

    ``compile`` defaults to True on CUDA (``create_block_mask(_compile=True)``), False on CPU.

    Raises:
        RuntimeError: torch has no ``torch.nn.attention.flex_attention``.
    """
    if create_block_mask is None:  # pragma: no cover
        raise RuntimeError("this torch has no torch.nn.attention.flex_attention; use attention='dense'")
    self_attn = k is None
    kk = q if k is None else k
    Tq, Tk = q.num_elements, kk.num_elements
    dev = q.anchor.device
    if compile is None:
        compile = dev.type == "cuda"
    # Metadata padded to whole blocks: create_block_mask evaluates mask_mod on padded indices.
    Lq = -(-Tq // FLEX_BLOCK) * FLEX_BLOCK
    Lk = -(-Tk // FLEX_BLOCK) * FLEX_BLOCK
    qa, qd, qdoc = (_pad_meta(t, Lq, -1) for t in (q.anchor, q.depth, q.doc))
    qv = _pad_meta(q.valid, Lq, False)
    ka, kd, kdoc = (_pad_meta(t, Lk, -2) for t in (kk.anchor, kk.depth, kk.doc))
    kv = _pad_meta(kk.valid, Lk, False)

    def mask_mod(b, h, qi, ki):
        m = _allowed(qa[qi], qd[qi], qdoc[qi], qv[qi], ka[ki], kd[ki], kdoc[ki], kv[ki])
        if self_attn:
            m = m | (qi == ki)
        return m

    return create_block_mask(mask_mod, None, None, Tq, Tk, device=dev, _compile=compile)


def resolve_attention(attention: AttentionImpl, device: torch.device) -> str:
    if attention == "auto":
        return "flex" if device.type == "cuda" and create_block_mask is not None else "dense"
    if attention not in ("dense", "flex"):
        raise ValueError(f"attention={attention!r}: use 'auto', 'dense' or 'flex'")
    return attention


def element_mask(q: Elements, k: Elements | None = None, *, attention: AttentionImpl = "auto"):
    """Dense bool ``[1, 1, Tq, Tk]`` or flex ``BlockMask`` for the elements (see module doc)."""
    impl = resolve_attention(attention, q.anchor.device)
    return flex_element_mask(q, k) if impl == "flex" else dense_element_mask(q, k)


# --------------------------------------------------------------------------------------------
# Target weights, metrics
# --------------------------------------------------------------------------------------------


def unwrap(model: nn.Module) -> Eagle3Drafter:
    """The ``Eagle3Drafter`` inside DDP / ``torch.compile`` wrappers."""
    while True:
        if isinstance(model, Eagle3Drafter):
            return model
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if inner is None:
            raise TypeError(f"expected an Eagle3Drafter (optionally DDP/compile-wrapped), got {type(model).__name__}")
        model = inner


class TargetHead:
    """The target's ``lm_head`` restricted to the draft vocabulary, ``[Vd, Ht]``.

    The KL target is the target distribution restricted to the draft vocabulary and renormalized:
    ``softmax(final_hidden @ W[t2d].T)``. With a full draft vocabulary (``t2d`` all True) this is
    the exact target distribution; with a pruned one, target mass on ids outside the draft
    vocabulary is dropped (EAGLE-3 additionally drops positions whose target argmax is outside
    the draft vocabulary; peagle keeps them, so accuracy is measured against the restricted
    argmax). The restricted copy is cached per weight tensor.
    """

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._weight: torch.Tensor | None = None

    def __call__(self, target_lm_head: torch.Tensor, drafter: Eagle3Drafter) -> torch.Tensor:
        V, Vd = drafter.config.vocab_size, drafter.config.draft_vocab_size
        W = target_lm_head.detach()
        if W.dim() != 2 or W.shape[1] != drafter.config.target_hidden_size:
            raise ValueError(f"target_lm_head has shape {tuple(W.shape)}, expected [V={V}, Ht={drafter.config.target_hidden_size}]")
        if W.shape[0] == V:
            t2d = drafter.t2d
            key = (W.data_ptr(), W._version, W.device, t2d.data_ptr(), t2d._version, int(t2d.sum()))
            if key != self._key:
                self._weight = W if Vd == V else W[t2d.to(W.device)]
                self._key = key
            return self._weight
        if W.shape[0] == Vd:
            return W  # already restricted to the draft vocabulary
        raise ValueError(f"target_lm_head has {W.shape[0]} rows; expected vocab_size={V} (restricted with t2d) "
                         f"or draft_vocab_size={Vd}")


class DepthStats:
    """Per-depth sums: loss, loss elements, correct argmax (simulated acceptance)."""

    def __init__(self, num_depths: int, device: torch.device) -> None:
        self.loss = torch.zeros(num_depths, dtype=torch.float64, device=device)
        self.count = torch.zeros(num_depths, dtype=torch.float64, device=device)
        self.correct = torch.zeros(num_depths, dtype=torch.float64, device=device)
        self.num_forward_slots = 0

    def add(self, depth: torch.Tensor, row_loss: torch.Tensor, correct: torch.Tensor) -> None:
        K = self.loss.shape[0]
        self.loss += torch.bincount(depth, weights=row_loss.double(), minlength=K)[:K]
        self.count += torch.bincount(depth, minlength=K)[:K].double()
        self.correct += torch.bincount(depth, weights=correct.double(), minlength=K)[:K]

    def metrics(self, loss: float, weights: Sequence[float] | None = None) -> dict[str, float]:
        """``loss`` (the optimized value), ``num_loss_elements``, ``num_forward_slots``, per depth d
        ``loss_d{d}`` (mean), ``acc_d{d}`` (argmax draft == argmax target), ``count_d{d}``, and
        ``sim_acceptance_length`` = 1 + sum_k prod_{j<=k} acc_j (assumes independent depths)."""
        loss_s, count, correct = self.loss.tolist(), self.count.tolist(), self.correct.tolist()
        out: dict[str, float] = {
            "loss": float(loss), "num_loss_elements": float(sum(count)),
            "num_forward_slots": float(self.num_forward_slots),
        }
        al, run = 1.0, 1.0
        for d, (ls, c, k) in enumerate(zip(loss_s, count, correct)):
            acc = k / c if c else 0.0
            out[f"loss_d{d}"] = ls / c if c else 0.0
            out[f"acc_d{d}"] = acc
            out[f"count_d{d}"] = c
            run *= acc
            al += run
        out["sim_acceptance_length"] = al
        return out


# --------------------------------------------------------------------------------------------
# Objectives and registry
# --------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class ObjectiveConfig:
    """Options shared by every objective.

    Args:
        loss: ``"kl"`` = KL(target || draft) over the draft vocabulary; ``"ce"`` = cross-entropy
            on the target's argmax (restricted to the draft vocabulary).
        attention: ``"auto"`` (flex on CUDA, dense on CPU), ``"dense"`` (SDPA with a bool mask;
            O(T^2) memory) or ``"flex"`` (``BlockMask``; forward-only on CPU in torch 2.13).
        loss_impl: ``"auto"`` (Triton on CUDA, chunked torch elsewhere), ``"torch"`` (chunked),
            ``"triton"``, ``"plain"`` (materializes [M, Vd] logits; reference).
        loss_chunk_rows: rows per chunk of the vocabulary projection (memory ~ rows x Vd x 4 B x 3).
        seed: seed of the COD generator.
    """

    loss: LossKind = "kl"
    attention: AttentionImpl = "auto"
    loss_impl: LossImpl = "auto"
    loss_chunk_rows: int = 1024
    seed: int = 0

    def validate(self) -> None:
        if self.loss not in ("kl", "ce"):
            raise ValueError(f"loss={self.loss!r}: use 'kl' or 'ce'")
        if self.attention not in ("auto", "dense", "flex"):
            raise ValueError(f"attention={self.attention!r}: use 'auto', 'dense' or 'flex'")
        if self.loss_impl not in ("auto", "torch", "triton", "plain"):
            raise ValueError(f"loss_impl={self.loss_impl!r}: use 'auto', 'torch', 'triton' or 'plain'")
        if self.loss_chunk_rows < 1:
            raise ValueError(f"loss_chunk_rows={self.loss_chunk_rows} must be >= 1")


_REGISTRY: dict[str, type[Objective]] = {}


def register_objective(name: str) -> Callable[[type[Objective]], type[Objective]]:
    def deco(cls: type[Objective]) -> type[Objective]:
        cls.method = name
        _REGISTRY[name] = cls
        return cls

    return deco


def available_objectives() -> list[str]:
    _import_builtin()
    return sorted(_REGISTRY)


def _import_builtin() -> None:
    if "eagle3" not in _REGISTRY:
        import peagle_core.ttt  # noqa: F401  (registers "eagle3")


def build_objective(method: str, **cfg: Any) -> Objective:
    """Build a registered objective: ``"peagle"`` (``PEagleObjective``) or ``"eagle3"``
    (``peagle_core.ttt.Eagle3TTTObjective``) from its config fields.

    Raises:
        ValueError: unknown ``method`` or unknown/invalid config field (named).
    """
    _import_builtin()
    if method not in _REGISTRY:
        raise ValueError(f"method={method!r} is not a registered objective; use one of {sorted(_REGISTRY)}")
    cls = _REGISTRY[method]
    known = {f.name for f in fields(cls.config_cls)}
    unknown = sorted(set(cfg) - known)
    if unknown:
        raise ValueError(f"unknown {method} objective option(s) {unknown}; known: {sorted(known)}")
    return cls(cls.config_cls(**cfg))


class Objective(ABC):
    """A training objective: builds the drafter slots of a packed batch, runs forward and backward.

    Subclasses register with ``@register_objective(name)`` and set ``config_cls``.
    """

    method: ClassVar[str] = ""
    config_cls: ClassVar[type[ObjectiveConfig]] = ObjectiveConfig

    def __init__(self, cfg: ObjectiveConfig) -> None:
        cfg.validate()
        self.cfg = cfg
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self._target_head = TargetHead()

    @property
    @abstractmethod
    def num_depths(self) -> int:
        """K: depths (P-EAGLE) or TTT steps (EAGLE-3) reported in the metrics."""

    def check_drafter(self, drafter: Eagle3Drafter) -> None:
        """Raise ``ValueError`` if the head cannot be trained by this objective."""

    @abstractmethod
    def build_elements(self, batch: PackedBatch, drafter: nn.Module) -> Elements:
        """Draw the slots of one packed batch (consumes the COD generator)."""

    @abstractmethod
    def forward_backward(
        self,
        drafter: nn.Module,
        batch: PackedBatch,
        *,
        target_lm_head: torch.Tensor,
        loss_scale_denominator: float | None = None,
        no_sync: Callable[[], contextlib.AbstractContextManager] | None = None,
        elements: Elements | None = None,
    ) -> dict[str, float]:
        """Forward AND backward (gradients accumulate into ``.grad``); returns metrics.

        Args:
            drafter: the head (``Eagle3Drafter``, optionally DDP-wrapped, or FSDP2-sharded as a
                ``peagle_core.fsdp.ShardedDrafter``).
            batch: one packed sequence on the drafter's device.
            target_lm_head: ``[V, Ht]`` frozen target ``lm_head`` weight (or ``[Vd, Ht]`` already
                restricted to the draft vocabulary).
            loss_scale_denominator: divisor of the summed element losses; default = this batch's
                number of loss elements. Under DDP (which averages gradients over W ranks) pass
                ``global_loss_elements / W`` for an exact global mean.
            no_sync: callable returning a context manager (``ddp.no_sync``,
                ``ShardedDrafter.no_sync``) entered for every backward but the last, so DDP
                all-reduces (FSDP reduce-scatters) once per batch.
            elements: slots from ``build_elements`` (to count loss elements across ranks first).
        """

    @abstractmethod
    def compute_loss(
        self,
        drafter: nn.Module,
        batch: PackedBatch,
        *,
        target_lm_head: torch.Tensor,
        loss_scale_denominator: float | None = None,
        elements: Elements | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Single pass, no backward: ``(loss scalar tensor (differentiable when grad is on), metrics)``."""

    # Shared helpers -------------------------------------------------------------------------

    def _loss_rows(
        self, drafter: Eagle3Drafter, batch: PackedBatch, normed: torch.Tensor, el: Elements,
        W_t: torch.Tensor, row_scale: torch.Tensor, stats: DepthStats,
    ) -> torch.Tensor:
        """Loss of loss elements ``el`` (``normed [m, H]`` their drafter outputs): the scaled sum."""
        out = linear_distill_loss(
            normed, drafter.lm_head.weight, batch.final_hidden[el.target_index], W_t,
            row_scale=row_scale, kind=self.cfg.loss, impl=self.cfg.loss_impl, chunk_rows=self.cfg.loss_chunk_rows,
        )
        stats.add(el.depth, out.row_loss, out.draft_argmax == out.target_argmax)
        return out.loss


@dataclass(kw_only=True)
class PEagleConfig(ObjectiveConfig):
    """P-EAGLE objective options (arXiv 2602.01469).

    Args:
        num_depths: K, parallel depths trained (depth 0 = next-token prediction).
        cod_ratio: r, COD keep ratio per depth (depth d keeps max(r^d, r_min) of depth 0).
        cod_min_ratio: r_min.
        num_partitions: S, segments of Algorithm 1 (1 = one forward+backward).
    """

    num_depths: int = 8
    cod_ratio: float = 0.8
    cod_min_ratio: float = 0.2
    num_partitions: int = 1

    def validate(self) -> None:
        super().validate()
        if self.num_depths < 1:
            raise ValueError(f"num_depths={self.num_depths} must be >= 1")
        if not 0.0 < self.cod_ratio <= 1.0:
            raise ValueError(f"cod_ratio={self.cod_ratio} must be in (0, 1]")
        if not 0.0 <= self.cod_min_ratio <= 1.0:
            raise ValueError(f"cod_min_ratio={self.cod_min_ratio} must be in [0, 1]")
        if self.num_partitions < 1:
            raise ValueError(f"num_partitions={self.num_partitions} must be >= 1")


@register_objective("peagle")
class PEagleObjective(Objective):
    """P-EAGLE: all K depths of every anchor in one forward (per segment), KL/CE averaged over
    the COD-kept loss elements with uniform weight (P-EAGLE Sec. 4; public ports)."""

    config_cls = PEagleConfig
    cfg: PEagleConfig

    @property
    def num_depths(self) -> int:
        return self.cfg.num_depths

    def check_drafter(self, drafter: Eagle3Drafter) -> None:
        if not drafter.parallel_drafting or drafter.config.mask_token_id is None:
            raise ValueError("the P-EAGLE objective needs a head with mask_token_id and mask_hidden "
                             "(DrafterConfig(mask_token_id=...)); use method='eagle3' for an EAGLE-3 head")

    def build_elements(self, batch: PackedBatch, drafter: nn.Module) -> Elements:
        d = unwrap(drafter)
        self.check_drafter(d)
        batch.validate(aux_width=d.config.fc_input_size, target_hidden_size=d.config.target_hidden_size)
        return build_peagle_elements(batch, self.cfg.num_depths, d.config.mask_token_id,
                                     cod_ratio=self.cfg.cod_ratio, cod_min_ratio=self.cfg.cod_min_ratio,
                                     generator=self.generator)

    def _segment(
        self, drafter: nn.Module, batch: PackedBatch, el: Elements, W_t: torch.Tensor, denom: float,
        stats: DepthStats, num_context: int = 0,
    ) -> torch.Tensor:
        """One forward over elements ``el`` = ``num_context`` keys-only context slots, then the
        segment's own slots; returns the scaled loss sum of the own loss elements (a zero that
        still reaches every parameter when there is none)."""
        d = unwrap(drafter)
        attention = resolve_attention(self.cfg.attention, el.anchor.device)
        own = torch.arange(el.num_elements, device=el.anchor.device) >= num_context  # [T]
        order = forward_order(el, self.num_depths)  # (doc, depth, anchor): sparse block mask
        el, own = el.index(order), own[order]
        if attention == "flex":  # whole blocks: fewer distinct shapes for the compiled kernel
            el = pad_elements(el, -(-el.num_elements // FLEX_BLOCK) * FLEX_BLOCK)
            own = torch.cat([own, own.new_zeros(el.num_elements - own.numel())])
        T = el.num_elements
        hidden = element_hidden(d, batch, el)  # [T, H]
        mask = element_mask(el, attention=attention)
        normed, _ = drafter(el.input_ids[None], hidden[None], el.position[None], attn_mask=mask)
        stats.num_forward_slots += T
        rows = torch.nonzero(el.loss & own).flatten()
        if rows.numel() == 0:
            return (normed.sum() + d.lm_head.weight.sum()) * 0.0
        sub = el.index(rows)
        scale = torch.full((rows.numel(),), 1.0 / denom, device=normed.device, dtype=torch.float32)
        return self._loss_rows(d, batch, normed[0, rows], sub, W_t, scale, stats)

    def _prepare(self, drafter, batch, target_lm_head, loss_scale_denominator, elements):
        d = unwrap(drafter)
        el = self.build_elements(batch, drafter) if elements is None else elements
        W_t = self._target_head(target_lm_head, d)
        denom = float(loss_scale_denominator) if loss_scale_denominator is not None else float(max(el.num_loss_elements, 1))
        if denom <= 0:
            raise ValueError(f"loss_scale_denominator={loss_scale_denominator} must be > 0")
        return d, el, W_t, denom

    def forward_backward(self, drafter, batch, *, target_lm_head, loss_scale_denominator=None, no_sync=None,
                         elements=None) -> dict[str, float]:
        from peagle_core.partition import partition_elements

        _, el, W_t, denom = self._prepare(drafter, batch, target_lm_head, loss_scale_denominator, elements)
        segments = partition_elements(el, self.cfg.num_partitions, num_anchors=batch.num_tokens)
        # Segments without loss elements contribute no gradient: skip them. The last one that runs
        # does its backward outside no_sync (DDP all-reduce); if none has a loss, run the first
        # with a zero loss so every rank still calls backward once.
        todo = [s for s in segments if bool(el.loss[s.own].any())] or segments[:1]
        stats = DepthStats(self.num_depths, el.anchor.device)
        total = 0.0
        for i, seg in enumerate(todo):
            last = i == len(todo) - 1
            ctx = no_sync() if (no_sync is not None and not last) else contextlib.nullcontext()
            with ctx:
                loss = run_in_forward(drafter, self._segment, batch, el.index(seg.indices), W_t, denom,
                                      stats, num_context=int(seg.context.numel()))
                loss.backward()
            total += float(loss.detach())
        return stats.metrics(total)

    def compute_loss(self, drafter, batch, *, target_lm_head, loss_scale_denominator=None, elements=None):
        _, el, W_t, denom = self._prepare(drafter, batch, target_lm_head, loss_scale_denominator, elements)
        stats = DepthStats(self.num_depths, el.anchor.device)
        loss = run_in_forward(drafter, self._segment, batch, el, W_t, denom, stats)
        return loss, stats.metrics(float(loss.detach()))


__all__ = [
    "DepthStats",
    "Elements",
    "Objective",
    "ObjectiveConfig",
    "PEagleConfig",
    "PEagleObjective",
    "PackedBatch",
    "available_objectives",
    "build_objective",
    "build_peagle_elements",
    "cod_sample",
    "dense_element_mask",
    "element_hidden",
    "element_mask",
    "flex_element_mask",
    "forward_order",
    "label_valid",
    "pack_samples",
    "pad_elements",
    "register_objective",
    "unwrap",
]
