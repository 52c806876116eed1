"""Progress off a terminal (logs, pipes, nohup): plain lines with the count, the loop's numbers and the
time left, throttled, and always one at the end."""
import re
import time

from forgetless import progress
from forgetless.progress import duration, progress_task


def test_plain_lines_with_eta_when_stderr_is_not_a_terminal(capsys, monkeypatch):
    monkeypatch.setattr(progress, "LOG_EVERY_S", 0.0)  # a line at every step
    with progress_task("seq-lora task 1", total=4) as advance:
        for step in range(4):
            advance(1, loss=2.5 - step / 10)
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0].startswith("seq-lora task 1: 1/4 loss 2.5 · ") and re.search(r"~\d+s left$", lines[0])
    assert lines[-1].startswith("seq-lora task 1: 4/4 loss 2.2 · ") and "left" not in lines[-1]
    assert len(lines) == 4


def test_plain_lines_are_throttled_and_a_loop_that_did_nothing_is_silent(capsys):
    with progress_task("bench arms", total=1000) as advance:
        for _ in range(1000):
            advance(1)
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bench arms: 1000/1000 · ")
    with progress_task("resumed", total=5, completed=5):
        pass
    assert capsys.readouterr().err == ""


def test_a_loop_whose_steps_take_long_still_logs(capsys, monkeypatch):
    monkeypatch.setattr(progress, "LOG_EVERY_S", 0.05)
    with progress_task("bench", total=2) as advance:
        time.sleep(0.5)  # the first arm: no advance for ten log intervals
        advance(1)
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) >= 3 and lines[0].startswith("bench: 0/2 · ") and lines[-1].startswith("bench: 1/2 · ")
    assert "left" not in lines[0]  # no rate known before the first unit


def test_the_planned_rate_gives_time_left_before_the_first_unit(capsys, monkeypatch):
    monkeypatch.setattr(progress, "LOG_EVERY_S", 0.05)
    with progress_task("bench", total=600, percent=True, rate=2.0) as advance:  # planned: 5 minutes
        time.sleep(0.2)
        advance(0)
    first = capsys.readouterr().err.strip().splitlines()[0]
    assert first.startswith("bench: 0% · ") and re.search(r"~(4m 5\ds|5m 00s) left$", first), first


def test_durations_read_like_a_clock():
    assert [duration(s) for s in (12.4, 187, 7500)] == ["12s", "3m 07s", "2h 05m"]
