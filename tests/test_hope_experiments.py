"""`forgetless hope bench lm|needle`: the needle data, matched arms, both experiments end to end, bad options."""
import json

import pytest
import torch
from typer.testing import CliRunner

from forgetless.cli import app
from forgetless.hope import ARMS, arm_config
from forgetless.hope.needle import Config, by_distance, needles
from forgetless.models.gpt import GPT, GPTConfig

runner = CliRunner()


@pytest.fixture(autouse=True)
def keep_threads():
    """The hope CLI sets torch's thread count; give the rest of the suite its own back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_each_fact_is_planted_before_its_query_and_only_answers_are_scored():
    cfg = Config(block_size=32, pairs=3, keys=8, values=8)
    batch, asks, distances = needles(cfg, 16, torch.Generator().manual_seed(0))
    assert batch.x.shape == batch.y.shape == (16, 32)
    assert ((batch.y != -100).sum(1) == 3).all()                              # one answer per fact
    for x, y, ask, d in zip(batch.x, batch.y, asks, distances):
        put = ask - d
        assert (put >= 0).all() and (put < 16).all() and (ask >= 16).all() and (ask + 1 < 32).all()
        assert torch.equal(x[put], x[ask]) and (x[ask] < 8).all()              # the key, asked again
        assert torch.equal(y[ask], x[put + 1]) and torch.equal(y[ask], x[ask + 1])  # its value is the answer
        assert ((y[ask] >= 8) & (y[ask] < 16)).all()
        filler = torch.ones(32, dtype=torch.bool)
        filler[torch.cat([put, put + 1, ask, ask + 1])] = False
        assert (x[filler] >= 128).all()                                        # filler never looks like a fact
    assert by_distance(torch.tensor([[True, False]]), torch.tensor([[3, 20]]), [2, 10, 30]) == [1.0, 0.0]


def test_the_gpt_arm_is_matched_to_hope_in_parameters():
    model = GPTConfig(n_layer=2, n_head=4, d_model=64, block_size=32, vocab_size=256)
    params = {arm: GPT(arm_config(arm, model)).num_params() for arm in ARMS}
    assert params["titans"] == params["hope"]                                 # self-modification adds no weights
    assert abs(params["gpt"] - params["hope"]) / params["hope"] < 0.05
    assert params["hope-noattn"] < params["hope"]                             # no attention


def hope(*args):
    return runner.invoke(app, ["hope", *map(str, args)])


@pytest.mark.parametrize("name, sets, row", [
    ("needle", ["arms=gpt,titans", "n_layer=1", "d_model=32", "block_size=32", "eval_sequences=16", "bins=2,16,32",
                "scan=sequential"], "| titans |"),
    ("lm", ["preset=smoke", "domain=tinyshakespeare", "arms=gpt,hope"], "| hope |")])
def test_each_experiment_runs_and_reports(name, sets, row, tmp_path):
    out = tmp_path / name
    args = [f"--set={s}" for s in [*sets, "budget_s=0.5"]]
    result = hope("bench", name, "--seeds", 1, "--out", out, *args)
    assert result.exit_code == 0, result.output
    assert row in result.output and (out / f"hope_{name}.png").stat().st_size > 1000
    arms = json.loads((out / "results.json").read_text())["arms"]
    memory_arm = "titans" if name == "needle" else "hope"
    assert arms["gpt"]["steps"]["mean"] >= 1 and arms[memory_arm]["params"]["mean"] > 0
    if name == "needle":
        assert 0 <= arms["titans"]["accuracy_no_writes"]["mean"] <= 1 and arms["gpt"]["accuracy_no_writes"]["mean"] is None
    else:
        assert abs(arms["hope"]["memory_gain"]["mean"]) < 5 and arms["gpt"]["memory_gain"]["mean"] is None


@pytest.mark.parametrize("args, message", [
    (["bench", "needle", "--set", "arms=gpt,mamba"], "unknown arm 'mamba'; valid: gpt, titans, hope, hope-noattn"),
    (["bench", "needle", "--set", "keys=100"], "keys + values must be at most 128"),
    (["bench", "lm", "--set", "budget_s=0"], "budget_s and lm.memory_windows must be positive"),
    (["bench", "lm", "--set", "scan=serial"], "lm scan must be one of parallel, sequential, got 'serial'"),
    (["bench", "mamba"], "unknown experiment 'mamba'; valid: lm, needle"),
    (["bench", "lm", "--seeds", "0"], "--seeds must be positive")])
def test_bad_options_are_one_line_errors(args, message, tmp_path):
    result = hope(*args, "--out", tmp_path / "x")
    assert result.exit_code != 0 and message in result.output
    assert not (tmp_path / "x").exists()


def test_experiments_lists_every_option():
    result = hope("experiments")
    assert result.exit_code == 0, result.output
    assert all(word in result.output for word in ("lm:", "needle:", "budget_s", "memory_windows", "pairs"))


def test_tables_show_a_spread_only_with_two_seeds_or_more():
    from forgetless.aunn.experiments import pm
    from forgetless.stats import mean_std
    assert pm(mean_std([0.297])) == "29.7"                                    # one seed: no "± 0.0"
    assert pm(mean_std([0.29, 0.31])) == "30.0 ± 1.4"
