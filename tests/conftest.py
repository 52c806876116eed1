"""Tests run offline: Tiny Shakespeare comes from ../shared (or $FORGETLESS_TINYSHAKESPEARE),
and every cache write goes to a temporary folder."""
import os
from pathlib import Path

import pytest
import torch

SHARED_TINY = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"
SRC = Path(__file__).resolve().parents[1] / "src"


def pytest_configure(config):
    if not os.environ.get("FORGETLESS_TINYSHAKESPEARE") and SHARED_TINY.is_file():
        os.environ["FORGETLESS_TINYSHAKESPEARE"] = str(SHARED_TINY)
    # subprocesses (`python -m forgetless`) test this checkout, whatever is installed
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")]))
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))  # -n: this is one of that many test processes
    threads = max(1, min(2, cores()) // workers)
    torch.set_num_threads(threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))  # its subprocesses too: no more threads than cores


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one test process per core, at most 4 (each holds its own torch, models and fixtures)."""
    return min(4, cores())


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("FORGETLESS_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


@pytest.fixture
def text_file(tmp_path):
    """A small UTF-8 play-like text file (about 40 kB)."""
    lines = []
    for i in range(400):
        speaker = ["ROMEO", "JULIET", "MERCUTIO"][i % 3]
        lines.append(f"{speaker}:\nO speak again, bright angel, line {i}; Mercutio and Romeo go.\n")
    path = tmp_path / "play.txt"
    path.write_text("\n".join(lines))
    return path


@pytest.fixture(scope="module")
def one_thread():
    """Models this small run fastest on one thread (two threads on a busy 2-core machine: ten times slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
