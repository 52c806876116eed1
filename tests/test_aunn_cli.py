"""`forgetless aunn ...` end to end: train, condition, generate, the three experiments at toy sizes, errors."""
import json
import shutil
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from forgetless.cli import app

runner = CliRunner()


@pytest.fixture(autouse=True)
def keep_threads():
    """The aunn CLI sets torch's thread count; give the rest of the suite its own back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def aunn(*args):
    return runner.invoke(app, ["aunn", *map(str, args)])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("aunn") / "play.safetensors"
    text = tmp_path_factory.getbasetemp() / "play.txt"
    text.write_text("ROMEO: O speak again, bright angel.\nJULIET: Romeo!\n" * 20)
    result = aunn("train", "--data", text, "--out", path, "--size", "tiny", "--train-steps", 40, "--train-mode", "anneal",
                  "--train-batch-size", 64)
    assert result.exit_code == 0, result.output
    assert "parameters" in result.output and path.stat().st_size > 1000
    return path


def test_condition_shows_predictions_and_writes_a_checkpoint(checkpoint, tmp_path):
    result = aunn("condition", "--checkpoint", checkpoint, "--prompt", "JULIET:", "--steps", 2, "--peek", 8,
                  "--out", tmp_path / "c.safetensors")
    assert result.exit_code == 0, result.output
    assert "before:" in result.output and "after 2 step(s):" in result.output
    from forgetless.aunn.use import load_learner
    before, _ = load_learner(checkpoint)
    after, _ = load_learner(tmp_path / "c.safetensors")
    assert after.position == before.position + len("JULIET:")


def test_out_overwrites_only_the_checkpoint_it_updates(checkpoint, tmp_path):
    own, other = tmp_path / "own.safetensors", tmp_path / "other.txt"
    shutil.copy(checkpoint, own)
    other.write_text("keep")
    for args in (("condition", "--prompt", "JULIET:"), ("generate", "--length", 4)):
        result = aunn(*args, "--checkpoint", own, "--out", other)
        assert result.exit_code == 2, result.output
        assert "or pass --out equal to --checkpoint to update it" in " ".join(result.output.split())
    assert other.read_text() == "keep"
    assert aunn("generate", "--checkpoint", own, "--length", 4, "--out", own).exit_code == 0
    from forgetless.aunn.use import load_learner
    assert load_learner(own)[0].position == load_learner(checkpoint)[0].position + 4


def test_generate_is_reproducible_through_the_cli(checkpoint):
    outs = [aunn("generate", "--checkpoint", checkpoint, "--length", 16, "--seed", s, "--prompt", "ROMEO:")
            for s in (5, 5)]
    assert all(o.exit_code == 0 for o in outs), outs[0].output
    assert outs[0].stdout == outs[1].stdout and outs[0].stdout.startswith("ROMEO:")


@pytest.mark.parametrize("args, message", [
    (("bench", "nope"), "unknown experiment 'nope'"),
    (("bench", "toy", "--set", "bogus=1"), "unknown config key toy.bogus"),
    (("bench", "toy", "--set", "arms"), "write KEY=VALUE"),
    (("bench", "toy", "--set", "arms=batch+wings"), "MODE[+fast][+fourier]"),
    (("bench", "toy", "--set", "far=32"), "toy.far must be at least 48"),
    (("bench", "toy", "--set", "patterns=ab", "--set", "run=30", "--set", "far=48"), "toy.far must be at least 124"),
    (("bench", "toy", "--set", "patterns=aé"), "two or more distinct ASCII letters"),
    (("bench", "digits", "--set", "early=7"), "contain digits.early"),
    (("bench", "digits", "--set", "learners=aunn,svm"), "digits.learners must be some of"),
    (("bench", "digits", "--set", "pixel_steps=-1"), "digits.pixel_steps must not be negative"),
    (("bench", "digits", "--set", "baseline_hidden=0"), "digits.baseline_hidden and digits.baseline_lr must be positive"),
    (("bench", "digits", "--set", "baseline_lr=-1e-3"), "digits.baseline_hidden and digits.baseline_lr must be positive"),
    (("train", "--data", "no/such/file.txt", "--out", "x.safetensors", "--model-encoding", "onehot"),
     "valid: binary, fourier"),  # before the data is read: no such file
    (("train", "--data", "no/such/file.txt", "--out", "x.safetensors", "--size", "huge"), "unknown size 'huge'"),
    (("train", "--data", "no/such/file.txt", "--out", "x.safetensors"), "unknown corpus"),
    (("generate", "--checkpoint", "missing.safetensors"), "does not exist"),
])
def test_bad_input_is_one_line_with_the_fix(args, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = aunn(*args)
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split()) and "Traceback" not in result.output


def test_train_reads_a_config_file_and_rejects_unknown_sections(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("abc|" * 50)
    good = tmp_path / "good.yaml"
    good.write_text("model:\n  d_model: 16\n  n_layer: 1\ntrain:\n  steps: 5\n  mode: serial\n")
    result = aunn("train", "--data", text, "--out", tmp_path / "a.safetensors", "--config", good, "--train-lr", "0.01")
    assert result.exit_code == 0, result.output
    from forgetless.aunn.use import load_learner
    learner, meta = load_learner(tmp_path / "a.safetensors")
    assert learner.model.config.d_model == 16 and learner.cfg.mode == "serial" and learner.cfg.lr == 0.01
    assert meta["data_bytes"] == 200 and learner.position == 200
    bad = tmp_path / "bad.yaml"
    bad.write_text("optim:\n  lr: 1\n")
    result = aunn("train", "--data", text, "--out", tmp_path / "b.safetensors", "--config", bad)
    assert result.exit_code == 2 and "unknown config section 'optim'; valid: model, train" in result.output


def test_generate_rejects_bad_length_and_temperature(checkpoint):
    for args, message in ((("--length", 0), "--length must be positive"), (("--temperature", -1), "temperature")):
        result = aunn("generate", "--checkpoint", checkpoint, *args)
        assert result.exit_code == 2 and message in result.output


def test_ctrl_c_says_resume_only_where_a_command_resumes(monkeypatch, tmp_path):
    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("forgetless.aunn.train.fit", interrupt)
    monkeypatch.setattr("forgetless.aunn.experiments.run_experiment", interrupt)
    text = tmp_path / "t.txt"
    text.write_text("abc|" * 50)
    result = aunn("train", "--data", text, "--out", tmp_path / "a.safetensors", "--size", "tiny")
    assert result.exit_code == 130 and result.output.strip() == "interrupted"
    result = aunn("bench", "toy", "--out", tmp_path)
    assert result.exit_code == 130 and "run the same command again to resume from the finished seeds" in result.output


def test_digits_without_scikit_learn_names_the_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "sklearn", None)
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    result = aunn("bench", "digits", "--seeds", 1, "--out", tmp_path)
    assert result.exit_code == 2
    assert "pip install 'forgetless[aunn]'" in " ".join(result.output.split())


SMOKE = {
    "toy": ["patterns=ac", "arms=batch,anneal+fast,serial+fourier", "length=100", "batch_steps=30", "anneal_steps=30",
            "serial_epochs=1", "far=256", "change_steps=2", "size=tiny"],
    "shakespeare": ["train_bytes=3000", "eval_bytes=48", "aunn_steps=20", "aunn_layers=1", "gpt_preset=smoke",
                    "aunn_batch=32"],
    "digits": ["tasks=2", "train_per_task=6", "test_per_task=4", "curve_at=0,3,6", "early=3", "size=tiny",
               "baseline_hidden=16"],
}


@pytest.mark.parametrize("name", list(SMOKE))
def test_each_experiment_runs_and_reports(name, tmp_path):
    sets = [a for s in SMOKE[name] for a in ("--set", s)]
    result = aunn("bench", name, "--seeds", 2, "--out", tmp_path, *sets)
    assert result.exit_code == 0, result.output
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["experiment"] == name and results["seeds"] == [0, 1] and results["threads"] == 1
    assert (tmp_path / "results.md").read_text().startswith("# AUNN")
    assert len(list(tmp_path.glob("*.png"))) >= 1 and len(list((tmp_path / "seeds").glob("seed*.json"))) == 2
    if name == "shakespeare":
        for model in ("aunn", "gpt"):
            assert 0 < results[model]["bpb_dynamic"]["mean"] < 12 and results[model]["cpu_s"]["mean"] > 0
        assert abs(results["aunn"]["params"]["mean"] / results["gpt"]["params"]["mean"] - 1) < 0.2
    if name == "digits":
        assert set(results["methods"]) == {"aunn", "aunn+fast", "mlp"}
        for m in results["methods"].values():
            assert len(m["r_matrix"]) == 2 and all(0 <= v <= 100 for row in m["r_matrix"] for v in row)
            assert [len(c) for c in m["curves"]] == [3, 3] and all(0 <= v <= 100 for c in m["curves"] for v in c)
            assert 0 <= m["online_acc"]["mean"] <= 100 and len(m["early_by_task"]) == 2
    if name == "toy":
        assert results["edges"] == [0, 16, 64, 256]
        arms = results["patterns"]["ac"]
        assert set(arms) == {"batch", "anneal+fast", "serial+fourier"}
        for m in arms.values():
            stats = [m["train_acc"], m["generated_acc"], *m["extrapolation"], *[v for c in m["change"] for v in c.values()]]
            assert len(m["extrapolation"]) == 3 and len(m["change"]) == 3
            assert all(0 <= s["mean"] <= 1 for s in stats)
            assert [s["truth"] for s in m["samples"]] == ["|ccc|aaa|ccc|aaa"] * 2  # bytes 100..115
            assert all(len(s["after_change"]) == 3 and s["generated"] for s in m["samples"])


def test_rerun_reuses_finished_seeds(tmp_path, monkeypatch):
    sets = [a for s in SMOKE["toy"] for a in ("--set", s)]
    assert aunn("bench", "toy", "--seeds", 1, "--out", tmp_path, *sets).exit_code == 0

    def rerun(cfg, seed):
        raise AssertionError(f"seed {seed} ran again")

    monkeypatch.setattr("forgetless.aunn.toy.run", rerun)
    result = aunn("bench", "toy", "--seeds", 1, "--out", tmp_path, *sets)
    assert result.exit_code == 0, result.exception
    result = aunn("bench", "toy", "--seeds", 2, "--out", tmp_path, *sets)  # seed 1 is new: it runs
    assert isinstance(result.exception, AssertionError) and "seed 1 ran again" in str(result.exception)


def test_experiments_are_listed_with_their_options():
    result = aunn("experiments")
    assert result.exit_code == 0 and all(name in result.output for name in SMOKE) and "train_per_task" in result.output


def test_module_entry_point_has_the_aunn_commands():
    out = subprocess.run([sys.executable, "-m", "forgetless", "aunn", "--help"], capture_output=True, text=True,
                         check=True).stdout
    assert all(cmd in out for cmd in ("train", "condition", "generate", "bench"))
