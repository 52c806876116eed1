"""The two-sided screen of `forgetless serve` (issue 50) on a poison set: how many documents of each class it
refuses, and by which rule.

Clean documents are `--doc-chars` pieces of shakespeare-modern: set A (plays 34-35, where the byte thresholds'
defaults were chosen, see docs/results/serving.md) and set B (shakespeare-poems, held out from that choice; the smoke
base was pretrained on plays 1-33 only). The loss window
is `--window` set-A documents other than the scored ones (as if accepted last). Poison, built from set B: one
80-character sentence repeated, random printable ASCII, base64 of random bytes, a clean document's characters
shuffled, and German (the msgstr texts of a system .mo catalogue; left out where none is installed). Each
document is screened as `Engine.screen` does (`byte_screen`, then `loss_screen` against the window) under the
base's weights, frozen: the serving learner would move them a little between documents. The loss rules alone
(both sides) are counted too.

    python benchmarks/serve_screen.py [--model smoke|smollm2-135m] [--steps 300] [--doc-chars 1000] [--json FILE]
"""
from __future__ import annotations

import argparse
import base64
import collections
import gettext
import glob
import json
import random
import statistics
import time

import torch

from forgetless.continual.evaluate import evaluate
from forgetless.continual.learner import chunk_windows
from forgetless.data.corpora import load_corpus
from forgetless.serve.engine import ServeConfig, byte_screen, loss_screen

CATALOGUES = "/usr/share/locale/de/LC_MESSAGES/*.mo"


def german(n_chars: int) -> str:
    """German text from the installed message catalogues (their translations, longest first), or ''."""
    texts = []
    for path in sorted(glob.glob(CATALOGUES)):
        with open(path, "rb") as f:
            catalog = gettext.GNUTranslations(f)._catalog
        texts += [v for v in catalog.values() if isinstance(v, str) and len(v) > 40 and "%" not in v]
        if sum(map(len, texts)) > n_chars:
            break
    return " ".join(texts)


def model(name: str, steps: int, seed: int):
    """(model, tokenizer with encode(bytes) -> (N,) ids, block size)."""
    if name == "smoke":
        from serve_faults import Setup
        from forgetless.data.tokenizers import ByteTokenizer
        from forgetless.models.gpt import GPT
        setup = Setup(steps, seed, n_docs=1)
        lm = GPT(setup.cfg)
        lm.load_state_dict(setup.base)
        return lm.eval(), ByteTokenizer(), setup.block
    from forgetless.data.domains import load_domains
    from forgetless.models.hf import load_model
    lm, text_tokenizer = load_model(name, "cpu")
    _, tokenizer = load_domains(["shakespeare-modern"], text_tokenizer, 256, 0.1, 4)
    return lm.eval(), tokenizer, 256


def sets(doc_chars: int, n: int, window: int, seed: int) -> dict[str, list[str]]:
    plays = [d.data.decode("utf-8", "ignore") for d in load_corpus("shakespeare-modern").docs]
    a = plays[33] + plays[34]
    b = "".join(d.data.decode("utf-8", "ignore") for d in load_corpus("shakespeare-poems").docs)
    pieces = [a[i * doc_chars:(i + 1) * doc_chars] for i in range(window + n)]
    clean_b = [b[i * doc_chars:(i + 1) * doc_chars] for i in range(n)]
    rng = random.Random(seed)
    classes = {"window": pieces[:window], "clean A": pieces[window:], "clean B": clean_b,
               "repeated sentence": [(d[:80] + " ") * (doc_chars // 81 + 1) for d in clean_b],
               "random printable": ["".join(chr(rng.randrange(32, 127)) for _ in range(doc_chars)) for _ in range(n)],
               "random base64": [base64.b64encode(rng.randbytes(doc_chars)).decode()[:doc_chars] for _ in range(n)],
               "shuffled": ["".join(rng.sample(d, len(d))) for d in clean_b]}
    other = german(n * doc_chars)
    if len(other) >= n * doc_chars:
        classes["German"] = [other[i * doc_chars:(i + 1) * doc_chars] for i in range(n)]
    return classes


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smoke", help="smoke (the smoke preset's byte GPT, pretrained here) or a "
                        "--model spec of forgetless serve, e.g. smollm2-135m")
    parser.add_argument("--steps", type=int, default=300, help="smoke: AdamW pretraining steps")
    parser.add_argument("--doc-chars", type=int, default=1000)
    parser.add_argument("--n", type=int, default=16, help="documents per class")
    parser.add_argument("--window", type=int, default=32, help="accepted documents the loss screen compares with")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the counts here")
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    start = time.time()
    lm, tokenizer, block = model(args.model, args.steps, args.seed)
    cfg = ServeConfig(screen_window=args.window)

    def loss(text: str) -> float:
        ids = tokenizer.encode(text.encode())
        return evaluate(lm, chunk_windows(ids, min(block, len(ids) - 1)))["loss"]

    classes = sets(args.doc_chars, args.n, args.window, args.seed)
    recent = [loss(d) for d in classes.pop("window")]
    rows = {}
    for name, docs in classes.items():
        reasons, losses, by_loss = collections.Counter(), [loss(doc) for doc in docs], 0
        for doc, value in zip(docs, losses):
            alone = loss_screen(value, recent, cfg)  # the loss rules alone, for comparison
            refusal = byte_screen(doc.encode(), cfg) or alone
            by_loss += alone is not None
            reasons[refusal[0] if refusal else "passed"] += 1
        rows[name] = {"n": len(docs), "refused": len(docs) - reasons["passed"], **dict(reasons),
                      "refused_by_loss_alone": by_loss, "median_loss": statistics.median(losses)}
    result = {"model": args.model, "doc_chars": args.doc_chars, "window_median": statistics.median(recent),
              "thresholds": {k: getattr(cfg, k) for k in ("screen_k", "screen_low_k", "screen_min_spread",
                                                          "screen_max_entropy", "screen_min_compression",
                                                          "screen_min_entropy", "screen_max_symbol_share")},
              "classes": rows, "seconds": time.time() - start}
    print(f"{args.model}, {args.doc_chars}-character documents, window median loss {result['window_median']:.3f}")
    print("| class | documents | refused | by rule | refused by the loss rules alone | median loss |\n|---|---|---|---|---|---|")
    for name, row in rows.items():
        rules = ", ".join(f"{k} {v}" for k, v in row.items() if k not in ("n", "refused", "passed", "median_loss",
                                                                              "refused_by_loss_alone"))
        print(f"| {name} | {row['n']} | {row['refused']} | {rules or '-'} | {row['refused_by_loss_alone']} | "
              f"{row['median_loss']:.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
