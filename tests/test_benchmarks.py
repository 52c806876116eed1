"""The harness benchmark runs a real (smoke) bench and accounts for its time; the precision benchmark times bf16
against fp32 and checks the metrics (tiny model); bench_real times every method interleaved with its own LoRA
baseline."""
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from forgetless.config import code_fingerprint
from forgetless.device import machine_text

ROOT = Path(__file__).resolve().parents[1]


def test_bench_harness_splits_a_cold_run_into_phases(tmp_path, text_file):
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_harness.py"), "--threads", "1", "--",
                          "--preset", "smoke", "--seeds", "1", "--methods", "lora", "--domain-a", str(text_file),
                          "--domain-b", f"renamed:{text_file}"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    line = json.loads(run.stdout.strip().splitlines()[-1])
    phases, total = line["phases_s"], line["baseline_ms"] / 1000
    assert line["cold"] and phases["pretrain"] > 0 and phases["adapt"] > 0 and phases["evaluate"] > 0
    assert abs(sum(phases.values()) - total) < 0.05 * total  # every second counted once
    assert line["candidate_ms"] > 0  # the plan's estimate was caught
    assert line["provenance"]["torch"] == torch.__version__ and line["provenance"]["code"] == code_fingerprint()
    assert line["provenance"]["machine"] == machine_text()  # the CPU and how it runs bf16, beside the numbers


def bench_real(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_real.py"), *args], capture_output=True,
                          text=True, timeout=300)


def test_bench_real_quick_interleaves_each_method_with_its_own_lora():
    run = bench_real("--quick", "--threads", "1", "--methods", "lora,cms", "--steps", "2", "--profile", "3")
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["config"]["model"] == "llama-tiny" and out["config"]["threads"] == 1 and out["config"]["precision"] == "fp32"
    assert set(out["methods"]) == {"lora", "cms"}
    for r in out["methods"].values():
        steps, lora = r["step_ms_all"], r["baseline_ms_all"]
        assert len(steps) == len(lora) == 2  # one LoRA step per round, beside the method's
        # the kept steps are rounded to 0.1 ms: the ratio lies within what those roundings allow (and its own 3 digits)
        least = statistics.median(t - 0.05 for t in steps) / statistics.median(t + 0.05 for t in lora)
        most = statistics.median(t + 0.05 for t in steps) / statistics.median(t - 0.05 for t in lora)
        assert least - 5e-4 <= r["ratio"] <= most + 5e-4
        low, high = r["ratio_per_round"]
        assert low <= r["ratio"] + 1e-3 and r["ratio"] <= high + 1e-3  # two rounds: the ratio of sums lies between
        assert r["ms_spread"]["min"] <= r["ms"] <= r["ms_spread"]["max"] and r["peak_rss_mb"] >= r["rss_before_mb"] > 0
    assert out["methods"]["cms"]["trainable_params"] > out["methods"]["lora"]["trainable_params"]
    profile = out["methods"]["cms"]["profile_ms"]  # the total, then the 3 operators most over LoRA's
    assert profile[0][0] == "total" and len(profile) == 4 and all(mine >= 0 and lora >= 0 for _, mine, lora in profile)
    gaps = [op[2] - op[1] for op in profile[1:]]  # sorted before each time was rounded to 0.1 ms: out of order by
    assert all(a <= b + 0.1 + 1e-9 for a, b in zip(gaps, gaps[1:]))  # at most the two roundings
    pooled = [t for r in out["methods"].values() for t in r["baseline_ms_all"]]
    assert out["baseline_ms"] == pytest.approx(statistics.median(pooled), abs=0.1)
    assert "target <= 1.3x" in run.stdout


def test_bench_real_skips_bf16_on_a_cpu_without_it():
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file() or {"avx512_bf16", "amx_bf16"} & set(cpuinfo.read_text().split()):
        pytest.skip("not a Linux CPU without native bf16")
    run = bench_real("--precision", "bf16")  # decided before SmolLM2 would load
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith("bf16 skipped: this CPU") and "no native bf16" in run.stdout
    assert json.loads(run.stdout.strip().splitlines()[-1])["skipped"]


def test_bench_harness_exits_with_the_cli_error(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_harness.py"), "--", "--preset", "nope"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "unknown preset 'nope'" in run.stdout + run.stderr


def test_reproduce_script_names_its_sections():
    listed = subprocess.run(["bash", str(ROOT / "scripts" / "reproduce.sh"), "list"], capture_output=True, text=True)
    assert listed.returncode == 0 and {"two-domain-quick", "real-standard", "first-run"} <= set(listed.stdout.split())
    bad = subprocess.run(["bash", str(ROOT / "scripts" / "reproduce.sh"), "nope"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown section 'nope'" in bad.stderr


def test_reproduce_publishes_the_table_and_only_the_figures_the_docs_show(tmp_path):
    script = (ROOT / "scripts" / "reproduce.sh").read_text()
    start = script.index("publish() {")
    publish = script[start:script.index("\n}\n", start) + 3]
    run = tmp_path / "runs" / "sec"
    run.mkdir(parents=True)
    for name in ("results.md", "shown.png", "readme.png", "unshown.png"):
        (run / name).write_text(name)
    (tmp_path / "docs" / "results").mkdir(parents=True)
    (tmp_path / "docs" / "RESULTS.md").write_text("![b](figures/other/unshown.png)\n")
    (tmp_path / "docs" / "results" / "area.md").write_text("![a](../figures/sec/shown.png)\n")  # a results page
    (tmp_path / "README.md").write_text("![c](docs/figures/sec/readme.png)\n")
    done = subprocess.run(["bash", "-c", f"set -euo pipefail\n{publish}\npublish runs/sec sec"], cwd=tmp_path,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (tmp_path / "docs" / "figures" / "sec").iterdir()) == ["readme.png", "results.md", "shown.png"]


def test_bench_precision_quick_times_both_precisions_and_checks_the_metrics():
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_precision.py"), "--quick", "--force",
                          "--threads", "1", "--repeats", "1"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    line = json.loads(run.stdout.strip().splitlines()[-1])
    assert line["config"]["targets"] == ["q_proj", "v_proj"] and line["config"]["threads"] == 1
    for part in ("step", "forward"):
        timed = line[part]
        assert timed["fp32"]["median_ms"] > 0 and timed["bf16"]["median_ms"] > 0
        assert timed["ratio"] == pytest.approx(timed["bf16"]["median_ms"] / timed["fp32"]["median_ms"], rel=1e-2)
    assert line["arm"]["fp32_s"] > 0 and line["arm"]["bf16_s"] > 0 and line["arm"]["bf16_peak_rss_mb"] > 0
    check = line["metric_check"]
    assert check["cells"] == len(check["r_cells"]) + len(check["general_ppl"]) == 4 + 2  # R 2x2, PPL before/after
    assert check["max_z"] == max(c["z"] for c in check["r_cells"] + check["general_ppl"])
    assert f"--precision auto picks {line['auto']['used']} here" in run.stdout


def test_bench_precision_skips_the_arm_where_bf16_is_emulated(monkeypatch, capsys):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_precision
    monkeypatch.setattr(bench_precision, "resolve_precision", lambda precision, device: ("fp32", "auto: test"))
    monkeypatch.setattr(sys, "argv", ["bench_precision.py", "--quick", "--threads", "1", "--tokens", "16"])
    bench_precision.main()
    out = capsys.readouterr().out
    line = json.loads(out.strip().splitlines()[-1])
    assert line["config"]["repeats"] == 2 and line["config"]["iters"] == 1  # few calls where bf16 is emulated
    assert "emulated" in line["arm"]["skipped"] and line["metric_check"] == line["arm"]
    assert "arm and metric check skipped: bf16 is emulated" in out and "auto picks fp32 here" in out


def test_bench_arm_quick_times_old_and_new_and_checks_the_metrics():
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_arm.py"), "--quick", "--precisions", "fp32",
                          "--threads", "1"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    line = json.loads(run.stdout.strip().splitlines()[-1])
    fp32 = line["precisions"]["fp32"]
    assert [len(fp32["old"]), len(fp32["new"])] == [1, 1] and fp32["old"][0]["wall_s"] > 0 and fp32["speedup"] > 0
    assert fp32["metric_check"]["cells"] > 0 and fp32["metric_check"]["max_z"] < 1  # 2 steps: scores barely move
    padded = line["padding"]["dbpedia"]  # 2 steps of a group of 8: other rows than as drawn, so only the form
    assert all(v["tokens"] > 0 and 0 <= v["padding"] < 1 for v in padded.values()) and len(padded) == 2
    old = fp32["old"][0]  # the untrained model is scored in each arm
    assert 0 <= old["base_scores_s"] <= old["wall_s"]
    assert abs(old["without_base_s"] - (old["wall_s"] - old["base_scores_s"])) < 0.002


def test_bench_arm_quick_bf16_against_fp32_and_the_attention_steps():
    """bf16 is emulated on some CPUs: the tiny Llama keeps it seconds."""
    bench = [sys.executable, str(ROOT / "benchmarks" / "bench_arm.py"), "--quick", "--threads", "1"]
    run = subprocess.run(bench + ["--bf16-against-fp32"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    line = json.loads(run.stdout.strip().splitlines()[-1])
    cross = line["precisions"]["new_bf16_vs_old_fp32"]
    assert list(line["precisions"]) == ["new_bf16_vs_old_fp32"] and line["new_bf16_vs_old_fp32"] == cross["speedup"]
    assert [len(cross["old"]), len(cross["new"])] == [1, 1] and cross["metric_check"]["cells"] > 0
    run = subprocess.run(bench + ["--attention", "2", "--precisions", "bf16"], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    line = json.loads(run.stdout.strip().splitlines()[-1])
    assert line["bench"] == "arm attention" and line["steps"] == 2 and line["ran"] == {"sdpa": ["sdpa"],
                                                                                      "eager": ["eager"]}
    run = subprocess.run(bench + ["--attention", "2", "--precisions", "fp32"], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode != 0 and "--attention compares bf16 training steps" in run.stderr


def test_bench_memory_counts_the_terms_state_over_what_trains(tmp_path):
    """EWC-distill's start holds a Fisher and one anchor (= teacher) of every weight; lora+ewc's only of LoRA's."""
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_memory.py"), "--methods",
                          "peft-lora,lora+ewc,ewc-distill", "--shapes", "xs", "--losses", "answer", "--batch", "2",
                          "--tokens", "16", "--json", str(tmp_path / "m.json")], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = {r["method"]: r for r in json.loads((tmp_path / "m.json").read_text())}
    weights = 4 * rows["peft-lora"]["params"]  # fp32
    grown = {m: r["held"]["start"] - r["held"]["attach"] for m, r in rows.items()}
    assert grown["ewc-distill"] >= 2 * weights and grown["lora+ewc"] < 0.1 * weights
    assert "| fp32 | answer | lora+ewc |" in run.stdout


def test_bench_serve_load_quick_runs_every_arm_and_the_baseline_without_errors():
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_serve_load.py"), "--quick", "--threads", "1",
                          "--streams", "4"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    one, off, on = out["arms"]
    assert [a["streams"] for a in out["arms"]] == [1, 4, 4] and [a["learn"] for a in out["arms"]] == [False, False, True]
    assert all(not a["errors"] and 0 < a["tokens"] <= a["streams"] * 4 and a["ttft_p99_s"] > 0 for a in out["arms"])
    assert on["learned"] >= 1 and out["baseline"]["sequential"]["tokens"] > 0
    assert all(a["forwards"] > 0 and a["mean_batch"] >= 1 and len(a["texts"]) == a["streams"] for a in out["arms"])
    assert len(out["baseline"]["sequential"]["texts"]) == 4 and "equal to generate's" in run.stdout
    assert out["ratios"]["p99_ttft_on_over_off"] == on["ttft_p99_s"] / off["ttft_p99_s"]


def test_bench_heap_runs_adapt_under_both_heaps_and_prints_the_ratios(tmp_path, text_file):
    from tiny_models import SENTENCES, bpe_tokenizer, quantizable_llama
    tok = bpe_tokenizer()
    quantizable_llama(len(tok)).save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    data = tmp_path / "new.json"
    data.write_text(json.dumps([{"prompt": f"Q{i}", "answer": s} for i, s in enumerate(SENTENCES * 3)]))
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_heap.py"), "--model", f"hf:{tmp_path / 'model'}",
                          "--data", str(data), "--retain", str(text_file), "--method", "ewc-distill[fisher_samples=2]",
                          "--steps", "1", "--flags", "--preset smoke --precision fp32 --max-length 24"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [line for line in run.stdout.splitlines() if line.startswith("| 1 |") or line.startswith("| 2 |")]
    assert "| glibc |" in rows[0] and "| lean |" in rows[1], run.stdout
    assert "lean / glibc: training peak" in run.stdout and "(1 steps per run)" in run.stdout
