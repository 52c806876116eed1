"""One CMS FFN (4 levels, periods 1/4/32/128, the dense width split between them) vs the dense FFN:
forward + backward time in the same run, at the quick preset's size (d=128, 32 x 128 tokens).

    python benchmarks/bench_cms.py [--repeats 7] [--iters 5]
"""
from __future__ import annotations

import json

import torch
import torch.nn.functional as F
from _timing import compare, parse_args, provenance

from forgetless.models.gpt import DenseFFN, GPTConfig
from forgetless.nn.cms import CMSConfig, cms_ffn


def main():
    args = parse_args(__doc__)
    torch.manual_seed(0)
    cfg = GPTConfig(d_model=128)
    x = F.layer_norm(torch.randn(32 * 128, 128), (128,)).requires_grad_()
    dense, cms = DenseFFN(cfg), cms_ffn(GPTConfig(d_model=128, ffn="cms"))
    r = compare(dense, cms, x, args.repeats, args.iters)
    print(f"dense FFN {r['baseline_ms']:.1f} ms, CMS {r['candidate_ms']:.1f} ms, ratio {r['ratio']:.2f} (fwd+bwd; "
          f"{sum(p.numel() for p in cms.parameters()):,} vs {sum(p.numel() for p in dense.parameters()):,} parameters)")
    print(json.dumps({"bench": "cms", "provenance": provenance(), **r, "config": {"d": 128, "tokens": 4096, "cms": CMSConfig().__dict__,
                                                      "threads": torch.get_num_threads(), "repeats": args.repeats,
                                                      "iters": args.iters}}))


if __name__ == "__main__":
    main()
