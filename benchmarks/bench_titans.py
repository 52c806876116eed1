"""A HOPE block (x + HOPE(LN x): Titans memory then the CMS chain, no attention) vs a causal attention block
(the GPT's Block: attention + dense FFN) of equal parameters: forward + backward tokens/s at context
256 / 1024 / 4096 / 16384 with the same tokens per step (batch = tokens / context, at least 1), in one run. The
memory is linear in the context, attention quadratic. Also timed: the HOPE block with self-modifying
projections, our memory alone in a residual block (its parallel form, the default) and the same memory in its
sequential form (the reference: same weights, same math), and, when installed, titans-pytorch's NeuralMemory
(the peer: same width, heads and chunk; a 2-layer MLP memory of expansion 2) in a residual block. Each row's
time is printed with its ratio to the attention block's and to the peer's.

    python benchmarks/bench_titans.py [--contexts 256,1024,4096,16384] [--layers all] [--repeats 3] [--iters 2]
                                      [--quick] [--device cpu]

The peer: `pip install titans-pytorch` would pull its dependencies' own torch requirements, so install it apart,
without dependencies, into a folder of its own and put that folder on PYTHONPATH when running this script:

    pip install --no-deps --target /tmp/titans_deps titans-pytorch tensordict assoc-scan einx einops x-transformers \\
        rotary-embedding-torch axial-positional-embedding hyper-connections pyvers frozendict loguru torch-einops-utils

(titans-pytorch 0.5.5 with tensordict 0.15.3 imports on torch 2.13.0+cpu this way). Without it the peer row
says why it is missing. `--quick` checks the script on tiny sizes (d=32, contexts 16/32/64); its numbers mean
nothing. Times are medians over repeats (min-max spread printed), the layers alternating within each repeat;
threads are stated.
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn as nn
from _timing import provenance, step_ms

from forgetless.models.gpt import Block, GPTConfig
from forgetless.nn.adapter import n_params, width_for
from forgetless.nn.hope import HOPE, HopeConfig
from forgetless.nn.titans import NeuralMemory, TitansConfig


class Residual(nn.Module):
    """x + layer(LN x): a pre-norm block around a sequence layer (B, T, d) -> (B, T, d)."""

    def __init__(self, d: int, layer: nn.Module):
        super().__init__()
        self.ln, self.layer = nn.LayerNorm(d), layer

    def forward(self, x):  # (B, T, d)
        out = self.layer(self.ln(x))
        return x + (out[0] if isinstance(out, tuple) else out)  # titans-pytorch returns (reads, state)


def peer(d: int, heads: int, chunk: int) -> tuple[nn.Module | None, str]:
    try:
        from titans_pytorch import NeuralMemory as PeerMemory
    except ImportError as e:
        return None, f"titans-pytorch not importable ({e}); see this script's docstring"
    memory = PeerMemory(dim=d, chunk_size=chunk, heads=heads, dim_head=d // heads,
                        default_model_kwargs=dict(depth=2, expansion_factor=2.0))
    return Residual(d, memory), "titans-pytorch NeuralMemory"


def layers(d: int, n_head: int, heads: int, chunk: int) -> dict[str, nn.Module | None]:
    """The attention block and the HOPE block, its CMS levels sized to the attention block's parameters."""
    cfg = GPTConfig(d_model=d, n_head=n_head, block_size=1 << 20)
    attention = Block(cfg)
    opts = HopeConfig(heads=heads, chunk=chunk)
    level = width_for(lambda w: n_params(Residual(d, HOPE(d, w, opts))), n_params(attention))
    self_modifying = HopeConfig(heads=heads, chunk=chunk, self_modify=True)
    memory, sequential = (Residual(d, NeuralMemory(d, TitansConfig(heads=heads, chunk=chunk))) for _ in range(2))
    sequential.load_state_dict(memory.state_dict())
    sequential.layer.scan = "sequential"
    return {"attention block": attention, "HOPE block": Residual(d, HOPE(d, level, opts)),
            "HOPE block, self-modifying": Residual(d, HOPE(d, level, self_modifying)),
            "memory alone": memory, "memory alone, sequential": sequential}


ROWS = ("attention block", "HOPE block", "HOPE block, self-modifying", "memory alone", "memory alone, sequential",
        "titans-pytorch")
SHORT = dict(zip(ROWS, ("attention", "hope", "self-modifying", "memory", "sequential", "peer")))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="256,1024,4096,16384")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per step (batch = tokens / context)")
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--chunk", type=int, default=16)
    parser.add_argument("--layers", default="all", help="rows to time, comma-separated among: all, "
                        + ", ".join(SHORT.values()) + " (attention is always timed)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--iters", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, to check the script runs")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    args = parser.parse_args()
    if args.quick:
        args.contexts, args.tokens, args.d, args.chunk, args.repeats, args.iters = "16,32,64", 64, 32, 8, 1, 1
    wanted = set(SHORT.values()) if args.layers == "all" else {"attention", *args.layers.split(",")}
    if unknown := wanted - set(SHORT.values()):
        raise SystemExit(f"--layers: unknown {', '.join(sorted(unknown))}; choose among {', '.join(SHORT.values())}")
    torch.manual_seed(0)
    models = layers(args.d, 4, 2, args.chunk)
    models["titans-pytorch"], peer_note = peer(args.d, 2, args.chunk) if "peer" in wanted else (None, "not asked")
    models = {name: m.to(args.device) for name, m in models.items() if m is not None and SHORT[name] in wanted}
    params = {name: n_params(m) for name, m in models.items()}
    print(f"d={args.d}, {args.tokens} tokens per step, chunk {args.chunk}, {args.device}, threads "
          f"{torch.get_num_threads()}; parameters: " + ", ".join(f"{k} {v:,}" for k, v in params.items()))
    if "titans-pytorch" not in models:
        print(f"peer: {peer_note}")
    rows = []
    for T in (int(c) for c in args.contexts.split(",")):
        x = torch.randn(max(1, args.tokens // T), T, args.d, device=args.device, requires_grad=True)  # (B, T, d)
        for m in models.values():
            step_ms(m, x, 1)  # warm up
        ms = {name: [] for name in models}
        for _ in range(args.repeats):
            for name, m in models.items():
                ms[name].append(step_ms(m, x, args.iters))
        rows.append(row(T, x.shape[0], ms))
        print(f"context {T:5d} (batch {x.shape[0]}):")
        for name in models:
            r = rows[-1][name]
            vs_peer = f", x{r['vs_peer']:.2f} the peer's" if "vs_peer" in r else ""
            print(f"  {name:28s} {r['ms']:9.1f} ms [{r['min_ms']:.1f}-{r['max_ms']:.1f}] "
                  f"({r['tokens_per_s']:,} tok/s), x{r['ratio']:.2f} attention's{vs_peer}")
    first = rows[0]
    candidate = first.get("HOPE block", first.get("memory alone", first["attention block"]))
    print(json.dumps({"bench": "titans", "provenance": provenance(titans_pytorch="titans-pytorch"),
                      "ratio": candidate["ratio"], "baseline_ms": first["attention block"]["ms"],
                      "candidate_ms": candidate["ms"],
                      "config": {"d": args.d, "tokens": args.tokens, "chunk": args.chunk, "params": params,
                                 "device": args.device, "threads": torch.get_num_threads(), "repeats": args.repeats,
                                 "iters": args.iters, "peer": peer_note},
                      "contexts": rows}))


def row(T: int, batch: int, ms: dict[str, list[float]]) -> dict:
    """One context's medians (ms, spread, tokens/s) and their ratios to the attention block (`ratio`) and the
    peer (`vs_peer`)."""
    med = {name: statistics.median(v) for name, v in ms.items()}
    out = {"context": T, "batch": batch}
    for name, v in med.items():
        out[name] = {"ms": round(v, 2), "tokens_per_s": round(batch * T / v * 1000),
                     "ratio": round(v / med["attention block"], 3), "min_ms": round(min(ms[name]), 2),
                     "max_ms": round(max(ms[name]), 2)}
        if "titans-pytorch" in med:
            out[name]["vs_peer"] = round(v / med["titans-pytorch"], 3)
    return out


if __name__ == "__main__":
    main()
