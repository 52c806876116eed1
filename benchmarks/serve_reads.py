"""Reads while learning (issue 50): latency of GET /v1/health, /v1/metrics, /v1/states and /v1/stats while
`--learners` clients each send a `--doc-kb` KB document to /v1/learn at once, against the same reads on the idle
server (the baseline, measured in the same run). The server is `forgetless serve`'s app on the smoke preset's
byte GPT (random weights: the screen is off, so every document is learned), under uvicorn on 127.0.0.1, one torch
thread; learn requests beyond `--serve-max-queued` (8) are answered 503 at once and counted.

    python benchmarks/serve_reads.py [--learners 50] [--doc-kb 60] [--reads 200] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch

from forgetless.continual.learner import chunk_windows
from forgetless.data.corpora import load_corpus
from forgetless.data.tokenizers import ByteTokenizer
from forgetless.models.gpt import GPT
from forgetless.presets import build_config
from forgetless.serve.app import make_app
from forgetless.serve.engine import Engine, ServeConfig

READS = ("/v1/health", "/v1/metrics", "/v1/states", "/v1/stats")
TOKEN = "benchmark-token-0123456789"


def serve(app):
    """Run `app` under uvicorn on a free loopback port in a thread; returns (url, server)."""
    import uvicorn
    sock = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="error"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    for _ in range(300):
        try:
            httpx.get(f"{url}/v1/health", timeout=1)
            return url, server
        except httpx.HTTPError:
            time.sleep(0.05)
    raise RuntimeError("the server did not start")


def read_latencies(url: str, n: int, stop: threading.Event | None = None) -> list[float]:
    """Seconds per read, cycling over READS, `n` reads (or until `stop` once n are done)."""
    out = []
    with httpx.Client(base_url=url, timeout=60) as http:
        while len(out) < n or stop is not None and not stop.is_set():
            start = time.perf_counter()
            assert http.get(READS[len(out) % len(READS)]).status_code == 200
            out.append(time.perf_counter() - start)
            time.sleep(0.01)
    return out


def summary(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"n": len(xs), "p50_ms": 1000 * statistics.median(xs), "p99_ms": 1000 * xs[int(0.99 * (len(xs) - 1))],
            "max_ms": 1000 * xs[-1]}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--learners", type=int, default=50)
    parser.add_argument("--doc-kb", type=int, default=60)
    parser.add_argument("--reads", type=int, default=200, help="reads in the idle baseline (and at least under load)")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = build_config("smoke").model
    text = load_corpus("shakespeare-modern").docs[33].data.decode("utf-8", "ignore")
    canary = chunk_windows(ByteTokenizer().encode(text[:20000].encode()), cfg.block_size)[:16]
    with tempfile.TemporaryDirectory() as folder:
        engine = Engine(GPT(cfg), ByteTokenizer(), canary, cfg.block_size,
                        ServeConfig(screen_k=0, screen_low_k=0, learn_per_minute=0,
                                    max_doc_bytes=args.doc_kb * 1024 + 1024), Path(folder))
        url, server = serve(make_app(engine, TOKEN))
        idle = read_latencies(url, args.reads)
        codes, stop = [], threading.Event()

        def learn(i: int):
            doc = f"{i} " + (text * 10)[i * 100:i * 100 + args.doc_kb * 1024]
            r = httpx.post(f"{url}/v1/learn", json={"text": doc}, headers={"Authorization": f"Bearer {TOKEN}"},
                           timeout=600)
            codes.append(r.status_code)

        threads = [threading.Thread(target=learn, args=(i,)) for i in range(args.learners)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        loaded: list[float] = []
        reader = threading.Thread(target=lambda: loaded.extend(read_latencies(url, args.reads, stop)))
        reader.start()
        for t in threads:
            t.join()
        learn_seconds = time.perf_counter() - start
        stop.set()
        reader.join()
        server.should_exit = True
        engine.close()
    result = {"learners": args.learners, "doc_kb": args.doc_kb, "idle": summary(idle), "learning": summary(loaded),
              "learn_status": {str(c): codes.count(c) for c in sorted(set(codes))}, "learn_seconds": learn_seconds}
    result["p99_ratio"] = result["learning"]["p99_ms"] / result["idle"]["p99_ms"]
    for name in ("idle", "learning"):
        s = result[name]
        print(f"{name:8s} reads {s['n']:4d}: p50 {s['p50_ms']:.1f} ms, p99 {s['p99_ms']:.1f} ms, max {s['max_ms']:.1f} ms")
    print(f"learns: {result['learn_status']} in {learn_seconds:.1f} s; p99 under learning / idle = "
          f"{result['p99_ratio']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
