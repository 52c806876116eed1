"""`--workers N`: bases and arms in forked CPU processes give the numbers one process gives, and bad
worker counts are one-line errors."""
import json
import time

import pytest
import torch

from forgetless.continual.workers import check_workers, run_jobs
from forgetless.errors import ForgetlessError
from test_cli import invoke

SKIP = {"wall_s", "peak_rss_mb", "code", "config_hash"}  # times, memory and the code fingerprint


def metrics(run_dir):
    """Every arm's saved result without its times and memory."""
    return {path.relative_to(run_dir).as_posix(): {k: v for k, v in json.loads(path.read_text()).items() if k not in SKIP}
            for path in sorted((run_dir / "arms").rglob("seed*.json"))}


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # workers run one thread each: the same float order as this process
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("protocol", ["two-domain", "sequence"])
def test_workers_give_the_serial_numbers(protocol, tmp_path, text_file, monkeypatch, one_thread):
    monkeypatch.setenv("FORGETLESS_CACHE", str(tmp_path / "cache"))  # the bases are pretrained by the workers
    args = ["bench", "--preset", "smoke", "--methods", "lora,adapter", "--seeds", 2, "--domain-a", text_file,
            "--domain-b", f"renamed:{text_file}", "--protocol", protocol]
    if protocol == "sequence":
        args += ["--tasks", f"renamed:{text_file}"]
    parallel = invoke(*args, "--workers", 2, "--out", tmp_path / "parallel")
    assert parallel.exit_code == 0, parallel.output
    serial = invoke(*args, "--out", tmp_path / "serial")  # the bases are cached now: only arms run
    assert serial.exit_code == 0, serial.output
    arms = metrics(tmp_path / "parallel")
    assert len(arms) == (6 if protocol == "two-domain" else 4) and arms == metrics(tmp_path / "serial")


def test_jobs_report_to_the_parent_as_they_finish():
    seen = {}
    run_jobs([lambda k=k: k * k for k in range(5)], 2, seen.__setitem__)
    assert seen == {k: k * k for k in range(5)}
    order = []
    run_jobs([lambda k=k: k for k in range(3)], 1, lambda i, r: order.append((i, r)))
    assert order == [(0, 0), (1, 1), (2, 2)]


def test_workers_take_the_longest_jobs_first():
    """Two workers, three jobs handed out longest first: jobs 1 and 2 first (which of the two starts first depends on
    the machine's load), the shortest, job 0, only once a worker is free (in the given order it would start first)."""
    def job():
        started = time.monotonic()  # one clock for every process on Linux
        time.sleep(1.0)
        return started
    starts = {}
    run_jobs([job, job, job], 2, starts.__setitem__, seconds=[1.0, 5.0, 3.0])
    assert max(starts, key=starts.get) == 0  # the shortest started last
    assert starts[0] >= min(starts[1], starts[2]) + 0.95  # it waited for a worker to finish a 1 s job


def test_worker_errors_reach_the_parent():
    def broken():
        raise ForgetlessError("arm failed: reason")
    with pytest.raises(ForgetlessError, match="arm failed: reason"):
        run_jobs([lambda: 1, broken], 2, lambda i, r: None)


def test_bad_worker_counts_are_one_line_errors(monkeypatch):
    with pytest.raises(ForgetlessError, match="--workers must be at least 1, got 0"):
        check_workers(0, torch.device("cpu"))
    with pytest.raises(ForgetlessError, match="on cuda use 1"):
        check_workers(2, torch.device("cuda"))
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ForgetlessError, match="torchrun already runs one process per rank"):
        check_workers(2, torch.device("cpu"))
    check_workers(1, torch.device("cuda"))  # one process is always fine
    monkeypatch.delenv("WORLD_SIZE")
    result = invoke("bench", "--model", "hf:/nowhere", "--protocol", "sequence", "--tasks", "dbpedia", "--workers", 2)
    assert result.exit_code == 2 and "an instruction stream on a pretrained model runs in one process" in result.output
    assert invoke("bench", "--workers", "two").output.strip().endswith(
        "--workers takes a number of processes or auto, got 'two'")


@pytest.mark.parametrize("arm_s, forked", [(5.0, False), (0.0, True)])
def test_auto_workers_fork_only_for_arms_long_enough_to_gain(arm_s, forked, tmp_path, text_file, monkeypatch):
    """--workers auto (the default): smoke arms take well under a second, so one process; arms the plan times
    at AUTO_ARM_S or more run one process per thread (2 here)."""
    monkeypatch.setenv("FORGETLESS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr("forgetless.continual.plan.AUTO_ARM_S", arm_s)
    torch.set_num_threads(2)
    result = invoke("bench", "--preset", "smoke", "--methods", "lora", "--seeds", 2, "--domain-a", text_file,
                    "--domain-b", f"renamed:{text_file}", "--out", tmp_path / "run")
    assert result.exit_code == 0, result.output
    plan = next(x for x in result.output.splitlines() if x.startswith("plan:"))
    assert ("on 2 workers (auto)" in plan) == forked and ("worker" in plan) == forked, plan
    assert result.output.count("lora seed") == (0 if forked else 2)  # workers' bars stay quiet; the parent counts
    assert "arms 4/4" in result.output or not forked
