"""The instruction-task sequence on a (tiny, random) pretrained model: R with general ability as task 0,
held-out tasks, general perplexity, saved and reused arms, the report."""
import copy
import io
import json

import pytest
from rich.console import Console

from forgetless import attach
from forgetless.continual import bootstrap, instruct
from forgetless.continual.instruct import load_stream, run_on, scores
from forgetless.data.instructions import load_task
from forgetless.errors import ForgetlessError
from forgetless.presets import build_config
from forgetless.report import terminal_table, write_report
from forgetless.report.frontier import operating_points
from forgetless.report.results import RunResult
from tiny_lm import tiny_llama, tiny_tokenizer
from tiny_results import round_trips

SMALL = {"data": {"tasks": ["dbpedia", "agnews"], "held_out_tasks": ["FOMC"], "train_examples": 16, "test_rows": 6,
                  "eval_windows": 4},
         "adapt": {"steps": 4, "batch_size": 4, "ckpt_every": 4}}


def run(tmp_path, methods, mix=None):
    tok = tiny_tokenizer()
    cfg = build_config("real", {**SMALL, "adapt": {**SMALL["adapt"], **({"mix": mix} if mix is not None else {})}})
    return run_on(tiny_llama(tok.vocab_size), tok, cfg, methods, [0], tmp_path, "real", "tiny-llama")


def test_instruction_sequence_scores_every_task_after_every_task(tmp_path, capsys):
    results = run(tmp_path, ["full", "lora", "ewc"])
    assert "plan: run 3 of 3 arms" in capsys.readouterr().err
    assert results["tasks"] == ["pydoc-topics", "dbpedia", "agnews"] and results["held_out_tasks"] == ["FOMC"]
    for label, m in results["methods"].items():
        R = m["r_matrix"]
        assert len(R) == 3 and all(len(row) == 3 for row in R), label           # rows: base, after task 1, 2
        assert all(0 <= v <= 100 for row in R for v in row)
        assert len(m["held_out"]) == 3 and all(len(row) == 1 for row in m["held_out"])
        assert len(m["general_ppl"]) == 3 and all(p > 1 for p in m["general_ppl"])
        assert m["op_tasks"]["mean"] == pytest.approx(sum(R[2][1:]) / 2)
        assert m["general_ppl_change"]["mean"] == pytest.approx(m["general_ppl"][2] / m["general_ppl"][0] - 1)
    full, lora = results["methods"]["full"], results["methods"]["lora"]
    assert full["general_ppl"][1] != full["general_ppl"][0]            # training moved the model
    assert full["r_matrix"][0] == lora["r_matrix"][0]                   # the same base before any task
    assert lora["trainable_params"] < full["trainable_params"]
    ewc = results["methods"]["ewc"]  # full fine-tuning at the same lr plus its penalty: the penalty acted
    assert ewc["trainable_params"] == full["trainable_params"] and ewc["general_ppl"][1:] != full["general_ppl"][1:]
    saved = tmp_path / "arms" / "lora" / "seed0"
    assert json.loads((saved / "forgetless_config.json").read_text())["task"] == 2
    files = write_report(results, tmp_path)
    assert (tmp_path / "r_matrix.png") in files and "OP tasks 1..T" in (tmp_path / "results.md").read_text()
    assert round_trips(tmp_path / "results.json")
    console = Console(width=80, file=io.StringIO(), record=True)  # a narrow terminal: labels and digits kept whole
    console.print(terminal_table(RunResult.load(tmp_path), "sequence", "caption"))
    text = console.export_text()
    assert "…" not in text and all(f"│ {label} " in text for label in results["methods"]), text
    arm = (tmp_path / "arms" / "full" / "seed0.json").stat().st_mtime
    run(tmp_path, ["full"])
    assert (tmp_path / "arms" / "full" / "seed0.json").stat().st_mtime == arm  # reused, not run again
    assert "plan: run 0 of 1 arm (1 saved)" in capsys.readouterr().err


def test_the_scores_before_training_are_saved_and_reused_by_a_later_run(tmp_path, monkeypatch):
    """A run with one more method (a study growing, or resumed) does not score the untrained model again."""
    first = run(tmp_path, ["lora"])["methods"]["lora"]
    calls = []
    monkeypatch.setattr(instruct, "scores", lambda *a, **k: calls.append(1) or scores(*a, **k))
    second = run(tmp_path, ["lora", "lora[r=2]"])["methods"]
    assert len(calls) == 2  # after each of the 2 tasks of the new arm; the saved before.json gave row 0
    assert second["lora[r=2]"]["r_matrix"][0] == first["r_matrix"][0] == second["lora"]["r_matrix"][0]
    assert second["lora[r=2]"]["general_ppl"][0] == first["general_ppl"][0]
    (tmp_path / "before.json").unlink()
    run(tmp_path, ["lora", "lora[r=2]", "lora[r=3]"])
    assert len(calls) == 2 + 3  # without it, the untrained model is scored again


def test_lean_r_cells_score_the_diagonal_and_the_last_row_with_the_same_metrics(tmp_path):
    """data.r_cells "metrics": between tasks only the task just learned is scored; the cells scored are the
    full run's bit for bit, and so are OP, BWT, LA, the general-PPL change and their bootstrap intervals."""
    tok, lm = tiny_tokenizer(), None
    three = {**SMALL, "data": {**SMALL["data"], "tasks": ["dbpedia", "agnews", "yahoo"]}}
    runs = {}
    for cells in ("all", "metrics"):
        cfg = build_config("real", {**three, "data": {**three["data"], "r_cells": cells}})
        lm = tiny_llama(tok.vocab_size)
        runs[cells] = run_on(lm, tok, cfg, ["lora", "mtl"], [0], tmp_path / cells, "real", "tiny-llama", "test")
    whole, lean = runs["all"]["methods"]["lora"], runs["metrics"]["methods"]["lora"]
    R, L = whole["r_matrix"], lean["r_matrix"]
    for t in range(4):
        for i in range(4):
            scored = t in (0, 3) or i == t
            assert (L[t][i] == R[t][i]) if scored else L[t][i] is None, (t, i)
    assert lean["held_out"][1] == [None] and lean["held_out"][3] == whole["held_out"][3]
    assert lean["general_ppl"][1] is None and lean["general_ppl"][3] == whole["general_ppl"][3]
    for m in ("op_tasks", "bwt_tasks", "la", "general_ppl_change"):
        assert lean[m] == whole[m], m
    assert lean["forgetting_tasks"]["mean"] is None and whole["forgetting_tasks"]["mean"] is not None
    assert runs["metrics"]["methods"]["mtl"]["r_matrix"] == runs["all"]["methods"]["mtl"]["r_matrix"]  # one phase
    arms = {c: json.loads((tmp_path / c / "arms" / "lora" / "seed0.json").read_text()) for c in runs}
    groups = {c: {"1": bootstrap.Runs.of([arms[c]], three["data"]["tasks"])} for c in runs}
    assert bootstrap.intervals(groups["metrics"], bootstrap.Draws(200)) == \
        bootstrap.intervals(groups["all"], bootstrap.Draws(200))
    write_report(runs["metrics"], tmp_path / "metrics")
    assert "| 1 | – | " in (tmp_path / "metrics" / "results.md").read_text()
    with pytest.raises(ForgetlessError, match="data.r_cells"):
        build_config("real", {"data": {"r_cells": "some"}})


def test_the_shared_scores_before_training_are_each_methods_own():
    """Every arm's row 0 is scored once on the bare model: attaching any method changes no score."""
    tok = tiny_tokenizer()
    cfg, lm = build_config("real", SMALL), tiny_llama(tok.vocab_size)
    stream = load_stream(cfg, tok)
    bare = scores(lm, tok, stream, cfg)
    for name in ["lora", "o-lora", "moram", "moe-lora", "neutral", "adapter", "cms", "apn"]:
        assert scores(attach(copy.deepcopy(lm), name).model, tok, stream, cfg) == bare, name


def test_mixing_from_earlier_tasks_changes_the_second_task_only(tmp_path):
    plain = run(tmp_path / "plain", ["lora"])["methods"]["lora"]
    mixed = run(tmp_path / "mixed", ["lora"], mix=0.5)["methods"]["lora"]
    assert mixed["r_matrix"][1] == plain["r_matrix"][1]  # task 1 has no earlier task to mix from
    assert mixed["general_ppl"][2] != plain["general_ppl"][2]


def test_validation_rows_are_left_out_of_training_and_scored_beside_r(tmp_path):
    """data.dev_rows: each task's last training rows become its validation set (never trained on), scored
    after every task; the *_dev metrics come from that R, and a sweep's operating point is chosen on them."""
    tok = tiny_tokenizer()
    cfg = build_config("real", {**SMALL, "data": {**SMALL["data"], "train_examples": 0, "dev_rows": 5}})
    stream = load_stream(cfg, tok)
    for task, dev in zip(stream.tasks, stream.dev):
        assert len(dev.test) == 5 and dev.labels == task.labels and dev.test == load_task(task.name).train[-5:]
        assert not {ex.prompt for ex in dev.test} & {ex.prompt for ex in task.train}
        assert len(task.train) == len(load_task(task.name).train) - 5
    assert sum(len(x) for x in stream.train[0].x) < sum(len(x) for x in load_stream(
        build_config("real", {**SMALL, "data": {**SMALL["data"], "train_examples": 0}}), tok).train[0].x)
    cfg = build_config("real", {**SMALL, "data": {**SMALL["data"], "dev_rows": 5}})
    results = run_on(tiny_llama(tok.vocab_size), tok, cfg, ["lora", "lora[lr=1e-2]"], [0], tmp_path, "real", "tiny")
    for m in results["methods"].values():
        R = m["r_matrix_dev"]
        assert len(R) == 3 and all(len(row) == 3 for row in R) and R != m["r_matrix"]
        assert m["la_dev"]["mean"] == pytest.approx((R[1][1] + R[2][2]) / 2)
        assert m["bwt_tasks_dev"]["mean"] == pytest.approx(R[2][1] - R[1][1])
    points = operating_points(results)["lora, lr"]["best_bwt_at_matched_la"]
    assert points["chosen_on"] == "validation"
    with pytest.raises(ForgetlessError, match="dev_rows=600 leaves no training example"):
        load_stream(build_config("real", {**SMALL, "data": {**SMALL["data"], "dev_rows": 600}}), tok)


def test_instruction_errors_are_one_line(tmp_path):
    tok = tiny_tokenizer()
    cfg = build_config("real", {**SMALL, "data": {**SMALL["data"], "tasks": ["no-such-task"]}})
    with pytest.raises(ForgetlessError, match="no cl500 task 'no-such-task'"):
        run_on(tiny_llama(tok.vocab_size), tok, cfg, ["lora"], [0], tmp_path, "real", "tiny")
    from forgetless.cli import app
    from typer.testing import CliRunner
    result = CliRunner().invoke(app, ["bench", "--protocol", "sequence", "--tasks", "dbpedia", "--out", str(tmp_path)])
    assert result.exit_code == 2 and "instruction tasks need a pretrained model" in result.output


def test_neutral_mixes_general_text_without_targets_and_replay_mixes_earlier_tasks(tmp_path, monkeypatch):
    """Neutral's l1 term silences its adapters on the mixed rows, so they are general-text windows (no LM
    targets), never earlier tasks; a replay arm (lora with mix) draws earlier tasks' rows from task 2 on."""
    from forgetless.continual import bootstrap, instruct
    seen = []

    class Recording(instruct.InstructionSampler):
        def __init__(self, rows, batch_size, seed, other=None, p=0.0, group=1):
            seen.append((other, p))
            super().__init__(rows, batch_size, seed, other, p, group=group)

    monkeypatch.setattr(instruct, "InstructionSampler", Recording)
    run(tmp_path / "neutral", ["neutral"])
    assert [p for _, p in seen] == [0.1, 0.1]
    for other, _ in seen:
        assert all((y == -100).all() for y in other.y) and all(len(x) == 256 for x in other.x)
    seen.clear()
    run(tmp_path / "replay", ["lora"], mix=0.5)
    assert seen[0] == (None, 0.0) and seen[1][1] == 0.5
    assert any((y != -100).any() for y in seen[1][0].y)                 # task 1's rows, answers scored
