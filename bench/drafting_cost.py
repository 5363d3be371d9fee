"""Drafting cost vs K: P-EAGLE parallel drafting (ONE forward over K slots) vs EAGLE-3
sequential drafting (K forwards), random weights, per decode step (issue 8 item 1).

Each step drafts for ``batch`` sequences whose drafter KV cache already holds ``context`` committed
slots; the step appends the anchor (real token + hidden state) and, for P-EAGLE, K-1 mask slots,
then discards the speculative slots — exactly what ``Eagle3Drafter.draft_parallel`` /
``draft_sequential`` do in the reference decoder. Sequential is timed for the same 4-layer head and
for the 1-layer head EAGLE-3 normally ships.

Goals: parallel t(K=11)/t(K=1) <= 1.15; parallel >= 5x faster than sequential at K=7.

Two modes, the same for both methods: eager (``DrafterCache``, grows by concatenation) and, on
CUDA, CUDA graphs: a ``StaticDrafterCache`` keeps every buffer at a fixed address (committed slots
plus room for the K speculative ones, overwritten each step as vLLM's proposer does with its
persistent buffers) and one drafting step is captured whole and replayed. Before timing, every
configuration checks that the static cache drafts the same tokens as the dynamic one. Attention
uses the reference decoder's SDPA backends (no cuDNN: ``peagle_core.decoder.decoding_attention``).

    python -m bench.drafting_cost            # GPU, bf16, writes bench/results/drafting_cost.json
    python -m bench.drafting_cost --smoke    # CPU, tiny, seconds (eager only)
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from bench.common import TARGET_SHAPES, time_ms, write_result
from peagle_core.decoder import decoding_attention
from peagle_core.drafter import Eagle3Drafter
from peagle_core.drafter_cache import DrafterCache
from peagle_core.drafter_config import DrafterConfig

NUM_LAYERS = 4  # the P-EAGLE head, and the same-size sequential head beside the 1-layer EAGLE-3 head
EAGER_ITERS, GRAPH_ITERS = 20, 50  # timed repeats (median) per cell, eager / CUDA-graph replays
TINY_SHAPE = {"hidden_size": 36, "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 6, "intermediate_size": 50,
                  "vocab_size": 99, "num_hidden_layers": 5, "rope_theta": 10000.0}


def build(shape: dict, num_layers: int, device, dtype, mask: bool = True) -> Eagle3Drafter:
    cfg = DrafterConfig.from_target(
        {**shape, "rope_parameters": {"rope_type": "default", "rope_theta": shape["rope_theta"]},
         "max_position_embeddings": 8192},
        num_hidden_layers=num_layers, mask_token_id=shape["vocab_size"] - 1 if mask else None,
    )
    return Eagle3Drafter(cfg).to(device=device, dtype=dtype).eval()


def prefilled_cache(d: Eagle3Drafter, batch: int, context: int, device, dtype) -> DrafterCache:
    cache = DrafterCache(d.config.num_hidden_layers)
    ids = torch.randint(0, d.config.vocab_size - 2, (batch, context), device=device)
    aux = torch.randn(batch, context, d.config.fc_input_size, device=device, dtype=dtype)
    pos = torch.arange(context, device=device).expand(batch, context)
    with torch.no_grad():
        d(ids, d.combine_hidden_states(aux), pos, cache=cache)
    return cache


class StaticDrafterCache:
    """``DrafterCache`` with fixed addresses, for CUDA-graph capture: ``k, v [B, nKV, C + room, D]``
    per layer, ``key_positions / key_valid [B, C + room]``; a forward writes its slots at the fill
    offset, attention always spans the whole buffer (slots past the fill are invalid), and ``crop``
    only clears validity. Duck-types the methods the drafter calls (``length``, ``extend_meta``,
    ``update``, ``crop``)."""

    def __init__(self, src: DrafterCache, room: int) -> None:
        def grow(t: torch.Tensor, dim: int) -> torch.Tensor:
            pad = list(t.shape)
            pad[dim] = room
            return torch.cat([t, t.new_zeros(pad)], dim)

        self.k = [grow(t, 2) for t in src.k]
        self.v = [grow(t, 2) for t in src.v]
        self.key_positions = grow(src.key_positions, 1)
        self.key_valid = grow(src.key_valid, 1)
        self._fill, self._at = src.length, src.length

    @property
    def length(self) -> int:
        return self._fill

    def extend_meta(self, positions: torch.Tensor, valid: torch.Tensor) -> None:
        self._at, T = self._fill, positions.shape[1]
        self.key_positions[:, self._at:self._at + T] = positions
        self.key_valid[:, self._at:self._at + T] = valid
        self._fill = self._at + T

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        T = k.shape[2]
        self.k[layer][:, :, self._at:self._at + T] = k
        self.v[layer][:, :, self._at:self._at + T] = v
        return self.k[layer], self.v[layer]

    def crop(self, length: int) -> None:
        self.key_valid[:, length:] = False
        self._fill = length


def step_fn(d: Eagle3Drafter, cache, method: str, K: int, batch: int, context: int, device, dtype, out=None):
    """One drafting step for ``batch`` sequences on ``cache`` (restored afterwards); ``out`` keeps
    the last draft ``[B, K]``."""
    g = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(0, d.config.vocab_size - 2, (batch, 1), generator=g).to(device)
    aux = torch.randn(batch, 1, d.config.fc_input_size, generator=g).to(device=device, dtype=dtype)
    pos = torch.full((batch, 1), context, device=device)
    committed = cache.length
    fn = d.draft_parallel if method == "parallel" else d.draft_sequential

    def run():
        drafts = fn(ids, aux, pos, K, cache)
        cache.crop(committed)  # the anchor slot too: every timed step sees the same cache
        if out is not None:
            out[:] = [drafts]
    return run


def graphed(run):
    """Capture ``run`` in a CUDA graph (after warm-up on a side stream); returns its replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            run()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run()
    return g.replay


def measure_batch(name: str, heads: dict[str, Eagle3Drafter], B: int, Ks: list[int], context: int, device, dtype,
                  *, graphs: bool, smoke: bool) -> list[dict]:
    """Rows ``{target, batch, K, context, <method>_ms[, <method>_graph_ms]}`` for every K at batch ``B``.

    Raises:
        RuntimeError: the static cache drafts other tokens than the dynamic one (checked on CUDA with
            graphs, and in the smoke run).
    """
    caches = {k: prefilled_cache(h, B, context, device, dtype) for k, h in heads.items()}
    rows = []
    for K in Ks:
        row = {"target": name, "batch": B, "K": K, "context": context}
        for method, head in heads.items():
            kind = "parallel" if method == "parallel" else "sequential"
            run = step_fn(head, caches[method], kind, K, B, context, device, dtype)
            with torch.no_grad():
                row[f"{method}_ms"] = time_ms(run, warmup=2 if smoke else 5, iters=3 if smoke else EAGER_ITERS)
            if not (graphs or smoke):
                continue
            # static cache: same drafts as the dynamic one, then graph timing
            a, b = [], []
            static = StaticDrafterCache(caches[method], room=K + 1)
            step_fn(head, caches[method], kind, K, B, context, device, dtype, out=a)()
            step_fn(head, static, kind, K, B, context, device, dtype, out=b)()
            agree = (a[0] == b[0]).float().mean().item()
            if agree < 0.99:  # bf16 near-ties may flip a rare token; a bug flips most
                raise RuntimeError(f"static cache drafts differ ({agree:.3f} agree): {name} B={B} K={K} {method}")
            if graphs:
                with torch.no_grad():
                    replay = graphed(step_fn(head, static, kind, K, B, context, device, dtype))
                    row[f"{method}_graph_ms"] = time_ms(replay, warmup=3, iters=GRAPH_ITERS)
                del replay
        rows.append(row)
        print(row, flush=True)
    return rows


def _ratios(r: dict[int, dict], unit: str) -> dict[str, float]:
    """The goal ratios of one (target, batch) from its rows by K, on ``<method>_<unit>`` times."""
    return {
        "parallel_t11_over_t1": r[11][f"parallel_{unit}"] / r[1][f"parallel_{unit}"],
        "sequential_over_parallel_K7": r[7][f"sequential_{unit}"] / r[7][f"parallel_{unit}"],
        "sequential1layer_over_parallel_K7": r[7][f"sequential-1layer_{unit}"] / r[7][f"parallel_{unit}"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny CPU run (seconds)")
    ap.add_argument("--context", type=int, default=512, help="committed slots in the drafter KV cache")
    ap.add_argument("--no-graphs", action="store_true", help="eager only")
    ap.add_argument("--out", default=None, help="result file directory (default bench/results)")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    shapes = {"tiny": TINY_SHAPE} if args.smoke else TARGET_SHAPES
    Ks = [1, 3, 5, 7, 11]
    batches = [1, 8] if args.smoke else [1, 8, 32, 64]
    context = 32 if args.smoke else args.context
    graphs = device == "cuda" and not args.no_graphs
    rows = []
    torch.manual_seed(0)

    def save(partial: bool):
        summary = []
        for name in shapes:
            for B in batches:
                r = {x["K"]: x for x in rows if x["target"] == name and x["batch"] == B}
                if 1 not in r or 7 not in r or 11 not in r:
                    continue
                graph = {f"graph_{k}": v for k, v in _ratios(r, "graph_ms").items()} if graphs else {}
                summary.append({"target": name, "batch": B, **_ratios(r, "ms"), **graph})
        goals = {"parallel_t11_over_t1": "<= 1.15", "sequential_over_parallel_K7": ">= 5"}
        path = write_result("drafting_cost" + ("_smoke" if args.smoke else ""),
                            {"dtype": str(dtype), "mode": "eager+cuda-graphs" if graphs else "eager",
                             "partial": partial, "rows": rows, "summary": summary, "goals": goals,
                             "settings": {"num_layers": NUM_LAYERS, "context": context, "eager_iters": 3 if args.smoke else EAGER_ITERS,
                                          "graph_iters": GRAPH_ITERS}},
                            None if args.out is None else Path(args.out))
        return summary, path

    with decoding_attention(torch.device(device)):
        for name, shape in shapes.items():
            heads = {"parallel": build(shape, NUM_LAYERS, device, dtype),
                     "sequential": build(shape, NUM_LAYERS, device, dtype, mask=False),
                     "sequential-1layer": build(shape, 1, device, dtype, mask=False)}
            for B in batches:
                rows.extend(measure_batch(name, heads, B, Ks, context, device, dtype, graphs=graphs, smoke=args.smoke))
                save(partial=True)  # a run cut short keeps every finished batch
            del heads
            if device == "cuda":
                torch.cuda.empty_cache()
    summary, path = save(partial=False)
    for s in summary:
        print(s)
    print("wrote", path)


if __name__ == "__main__":
    main()
