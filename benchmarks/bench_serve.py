"""`forgetless serve` under load: latency and throughput of /v1/score with learning off vs on.

Server: `forgetless serve` in a subprocess on loopback, `--threads` torch threads, the preset's GPT with
random weights saved as a base (the weights do not change the cost of a request), the canary from
shakespeare-modern, `--method` learning, no rate limit. Load: `--clients` concurrent clients (asyncio +
httpx, one connection each) send `--requests` /v1/score requests, each `--score-chars` characters of
Shakespeare. Baseline: learning off. Candidate: the same load while one more client streams /v1/learn
documents (`--learn-chars` characters) back to back (a document sent before the scorers finish is counted
when it finishes; under load one document can outlast the whole score run). The arms alternate `--repeats` times on one server;
latencies are pooled per arm, throughputs are medians.

    python benchmarks/bench_serve.py [--clients 64] [--requests 1000] [--threads 2] [--repeats 1]
        [--preset quick] [--method lora]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
from _timing import provenance

from forgetless.checkpoint import save_checkpoint
from forgetless.data.corpora import load_corpus
from forgetless.data.splits import join
from forgetless.models.gpt import GPT
from forgetless.presets import build_config

TOKEN = "bench-token-0123456789"  # serve wants 16 characters or more
CORPUS = "shakespeare-modern"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, folder: Path) -> tuple[subprocess.Popen, str]:
    """A random-weight base of the preset, then `forgetless serve` on it; returns the process and its URL."""
    torch.manual_seed(0)
    cfg = build_config(args.preset).model
    save_checkpoint(folder / "base.safetensors", {f"model.{k}": v for k, v in GPT(cfg).state_dict().items()},
                    {"kind": "base", "model_config": cfg.to_dict(), "tokenizer": {"kind": "bytes"}, "domain": CORPUS})
    (folder / "token").write_text(TOKEN)
    (folder / "token").chmod(0o600)  # serve refuses a token file others can read
    port = free_port()
    command = [sys.executable, "-m", "forgetless", "serve", "--base", folder / "base.safetensors", "--state-dir",
               folder / "state", "--token-file", folder / "token", "--port", port, "--serve-method", args.method,
               "--serve-learn-per-minute", "0", "--device", "cpu"]
    return launch(command, args.threads, 300)


def launch(command: list, threads: int, seconds: float) -> tuple[subprocess.Popen, str]:
    """`forgetless serve` `command` (its last `--port` on loopback) with `threads` torch threads, once it answers
    /v1/health (within `seconds`, else exit with the reason); returns the process and its URL."""
    port = command[command.index("--port") + 1]
    proc = subprocess.Popen([str(c) for c in command], env={**os.environ, "OMP_NUM_THREADS": str(threads)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            httpx.get(f"{url}/v1/health", timeout=1).raise_for_status()
            return proc, url
        except httpx.HTTPError:
            if proc.poll() is not None:
                sys.exit(f"the server did not start:\n{proc.stderr.read().decode()[-2000:]}")
            time.sleep(0.2)
    proc.kill()
    sys.exit(f"the server did not answer within {seconds:.0f} s")


async def run_arm(url: str, texts: list[str], docs: list[str], clients: int, learn: bool) -> dict:
    """`len(texts)` score requests from `clients` clients (and a stream of learn requests when `learn`)."""
    latencies, learned, pending = [], [], iter(texts)
    done = asyncio.Event()
    limits = httpx.Limits(max_connections=clients + 1, max_keepalive_connections=clients + 1)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        async def scorer():
            for text in pending:  # one shared iterator: each text is sent once
                t0 = time.perf_counter()
                r = await http.post("/v1/score", json={"text": text})
                r.raise_for_status()
                latencies.append(time.perf_counter() - t0)

        async def learner():
            i = 0
            while not done.is_set():  # a document sent while the scorers run is counted when it finishes
                t0 = time.perf_counter()
                r = await http.post("/v1/learn", json={"text": docs[i % len(docs)]},
                                    headers={"Authorization": f"Bearer {TOKEN}"})
                r.raise_for_status()
                learned.append(time.perf_counter() - t0)
                i += 1

        stream = asyncio.create_task(learner()) if learn else None
        t0 = time.perf_counter()
        await asyncio.gather(*(scorer() for _ in range(clients)))
        seconds = time.perf_counter() - t0
        done.set()
        if stream:
            await stream
        learn_seconds = time.perf_counter() - t0
    return {"latencies": latencies, "seconds": seconds, "learned": learned, "learn_seconds": learn_seconds}


def quantile_ms(values: list[float], q: float) -> float:
    return 1000 * statistics.quantiles(values, n=100, method="inclusive")[round(100 * q) - 1]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=64, help="concurrent score clients")
    parser.add_argument("--requests", type=int, default=1000, help="score requests per arm and repeat")
    parser.add_argument("--repeats", type=int, default=1, help="times each arm runs (alternating)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="the server's torch threads")
    parser.add_argument("--preset", default="quick", help="whose model the server runs (random weights)")
    parser.add_argument("--method", default="lora", help="the method that learns (--serve-method)")
    parser.add_argument("--score-chars", type=int, default=512, help="characters of each scored text")
    parser.add_argument("--learn-chars", type=int, default=2048, help="characters of each learned document")
    args = parser.parse_args()
    text = join(load_corpus(CORPUS).docs).decode("utf-8", "ignore")
    step = len(text) // (args.requests + 64)
    texts = [text[i * step:i * step + args.score_chars] for i in range(args.requests)]
    docs = [text[i:i + args.learn_chars] for i in range(0, 64 * args.learn_chars, args.learn_chars)]
    with tempfile.TemporaryDirectory() as folder:
        proc, url = start_server(args, Path(folder))
        try:
            asyncio.run(run_arm(url, texts[:2 * args.clients], docs, args.clients, False))  # warm up
            runs = {"off": [], "on": []}
            for _ in range(args.repeats):
                for arm in runs:
                    runs[arm].append(asyncio.run(run_arm(url, texts, docs, args.clients, arm == "on")))
            stats = httpx.get(f"{url}/v1/stats").json()
        finally:
            proc.kill()
    result = {}
    for arm, arm_runs in runs.items():
        latencies = [x for r in arm_runs for x in r["latencies"]]
        result[arm] = {"p50_ms": quantile_ms(latencies, 0.5), "p99_ms": quantile_ms(latencies, 0.99),
                       "rps": statistics.median(len(r["latencies"]) / r["seconds"] for r in arm_runs)}
    learned = [x for r in runs["on"] for x in r["learned"]]
    docs_per_s = len(learned) / sum(r["learn_seconds"] for r in runs["on"])  # until the last document finished
    learn_p50 = round(1000 * statistics.median(learned), 1)
    for arm, r in result.items():
        print(f"learning {arm:>3}: /v1/score p50 {r['p50_ms']:.1f} ms, p99 {r['p99_ms']:.1f} ms, "
              f"{r['rps']:.1f} requests/s ({args.clients} clients, {args.requests} requests x {args.repeats})")
    print(f"learning on: {len(learned)} documents sent while scoring, {docs_per_s:.2f}/s, /v1/learn p50 "
          f"{learn_p50} ms; {stats['counters']['rollbacks']} rollbacks")
    off, on = result["off"], result["on"]
    print(json.dumps({"bench": "serve", "provenance": provenance(), "ratio": round(on["p50_ms"] / off["p50_ms"], 3),
                      "baseline_ms": round(off["p50_ms"], 2), "candidate_ms": round(on["p50_ms"], 2),
                      "p99_ratio": round(on["p99_ms"] / off["p99_ms"], 3), "baseline_p99_ms": round(off["p99_ms"], 2),
                      "candidate_p99_ms": round(on["p99_ms"], 2), "throughput_ratio": round(on["rps"] / off["rps"], 3),
                      "baseline_rps": round(off["rps"], 2), "candidate_rps": round(on["rps"], 2),
                      "learned_docs": len(learned), "learn_docs_per_s": round(docs_per_s, 3), "learn_p50_ms": learn_p50,
                      "config": {"clients": args.clients, "requests": args.requests, "repeats": args.repeats,
                                 "threads": args.threads, "preset": args.preset, "method": args.method,
                                 "score_chars": args.score_chars, "learn_chars": args.learn_chars}}))


if __name__ == "__main__":
    main()
