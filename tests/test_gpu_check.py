"""scripts/gpu-check.sh --dry-run: a tiny version of every step of the GPU check on the CPU, and its report."""
import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = ["wheels", "device", "smoke-cpu", "cuda-tests", "smoke-cuda", "smoke-compare", "apn", "bench-real", "precision",
         "at-size", "titans", "titans-64k"]


def test_dry_run_runs_every_step_and_writes_the_report(tmp_path):
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-check.sh"), "--dry-run"], capture_output=True,
                          text=True, timeout=600, env={**os.environ, "OUT": str(tmp_path)})
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"gpu-check-cpu-dry-run.{x}" for x in ("json", "log", "md")]
    report = json.loads((tmp_path / "gpu-check-cpu-dry-run.json").read_text())
    steps = {s["name"]: s for s in report["steps"]}
    assert list(steps) == STEPS and report["dry_run"] and report["device"]["cuda"] is False
    assert {name for name, s in steps.items() if s["status"] != "ok"} == set()
    assert "2 passed, 1 skipped" in steps["cuda-tests"]["summary"]  # fp16 skips on the CPU
    compared = steps["smoke-compare"]["result"]
    assert compared["outside"] == [] and set(compared["metrics"]) == {"full", "lora"}
    assert all(d["diff"] < 1e-4 for d in compared["max_difference"].values())  # CPU twice (1 and 2 threads)
    assert set(steps["bench-real"]["result"]["methods"]) == {"lora", "apn-retrofit"}
    assert steps["bench-real"]["result"]["config"]["precision"] == "bf16"
    precision = steps["precision"]["result"]
    assert precision["config"]["quick"] and precision["arm"]["bf16_s"] > 0 and precision["metric_check"]["cells"] > 0
    at_size = steps["at-size"]["result"]["variants"]
    assert set(at_size) == {"bf16", "nf4", "nf4-reentrant"}
    assert all(v.get("skipped") == "bitsandbytes is not installed" or v["lora_moved"] and v["checkpointing"]
               for v in at_size.values())
    assert steps["apn"]["result"]["size"] == "quick" and steps["titans"]["result"]["contexts"][0]["context"] == 16
    md = (tmp_path / "gpu-check-cpu-dry-run.md").read_text()
    assert md.startswith("# GPU check on cpu-dry-run") and "| bench-real | ok |" in md
