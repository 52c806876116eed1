"""One APN layer vs a dense FFN (4x expansion, GELU): forward + backward time in the same run.

Sizes: the APN source's (d=384, K=256, k=4, r=32, 2048 tokens) and the quick preset's
(d=128, 32 x 128 = 4096 tokens, APN defaults); `--sizes paper` the paper preset's batch (d=384,
64 x 256 = 16384 tokens), for GPUs (`--device cuda`). Baseline and candidate alternate within each
repeat, and the median of the repeats is reported, so the ratio (APN / dense time) holds up on
a noisy shared machine. Also prints multiply-adds per token of each layer.

    python benchmarks/bench_apn.py [--repeats 7] [--iters 5] [--sizes seed,quick] [--device cpu]
"""
from __future__ import annotations

import json

import torch
import torch.nn as nn
import torch.nn.functional as F
from _timing import compare, parser, provenance

from forgetless.nn.apn import APN, APNConfig

SIZES = {"seed": dict(d=384, tokens=2048), "quick": dict(d=128, tokens=4096), "paper": dict(d=384, tokens=16384)}


def dense_ffn(d: int) -> nn.Module:
    return nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))


def measure(d: int, tokens: int, cfg: APNConfig, repeats: int, iters: int, device: str = "cpu") -> dict:
    torch.manual_seed(0)
    x = F.layer_norm(torch.randn(tokens, d), (d,)).to(device).requires_grad_()
    dense, apn = dense_ffn(d).to(device), APN(d, cfg).to(device)
    K, k, r = cfg.n_patches, cfg.top_k, cfg.rank
    return {**compare(dense, apn, x, repeats, iters), "dense_macs_per_token": 8 * d * d, "apn_macs_per_token": K * d + d * r + k * d * r,
            "dense_params": sum(p.numel() for p in dense.parameters()),
            "apn_params": sum(p.numel() for p in apn.parameters())}


def main():
    options = parser(__doc__)
    options.add_argument("--sizes", default="seed,quick", help=f"comma-separated, of {', '.join(SIZES)}")
    options.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    args = options.parse_args()
    sizes = args.sizes.split(",")
    if not set(sizes) <= set(SIZES):
        options.error(f"unknown size in --sizes {args.sizes}; valid: {', '.join(SIZES)}")
    results = {}
    for name in sizes:
        size = SIZES[name]
        r = results[name] = measure(size["d"], size["tokens"], APNConfig(), args.repeats, args.iters, args.device)
        print(f"{name:5s} d={size['d']} tokens={size['tokens']}: dense {r['baseline_ms']:.1f} ms, "
              f"APN {r['candidate_ms']:.1f} ms, ratio {r['ratio']:.2f} (fwd+bwd; "
              f"{r['apn_macs_per_token']:,} vs {r['dense_macs_per_token']:,} MACs/token)")
    first = results[sizes[0]]  # the headline; the others under config
    print(json.dumps({"bench": "apn", "provenance": provenance(), "size": sizes[0], "ratio": first["ratio"],
                      "baseline_ms": first["baseline_ms"], "candidate_ms": first["candidate_ms"],
                      "config": {"sizes": {name: SIZES[name] for name in sizes}, "device": args.device,
                                 "threads": torch.get_num_threads(), "repeats": args.repeats, "iters": args.iters,
                                 "apn": APNConfig().__dict__, **{name: results[name] for name in sizes[1:]}}}))


if __name__ == "__main__":
    main()
