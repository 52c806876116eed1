"""mtl and METHOD[joint=true]: the multi-task ceiling of the sequence protocols, learned once on every task's
training rows for the steps the sequential arms take in all, its R rows 1..T the one state after it (so
bwt_tasks is 0 and FWT does not exist), on the byte GPT's corpus sequence and the instruction stream."""
import json

import forgetless

import pytest
from typer.testing import CliRunner

from forgetless.cli import app
from forgetless.continual import instruct
from forgetless.continual.metrics import sequence_metrics
from forgetless.continual.protocol import build_arms
from forgetless.errors import ForgetlessError
from forgetless.presets import build_config
from test_instruct import SMALL
from tiny_lm import tiny_llama, tiny_tokenizer


def check_joint(arm: dict, sequential: dict, T: int):
    R = arm["r_matrix"]
    assert len(R) == T + 1 and all(row == R[1] for row in R[1:])      # one state after joint training
    assert R[0] == sequential["r_matrix"][0]                          # the same model before
    assert arm["bwt_tasks"]["mean"] == 0 and arm["forgetting_tasks"]["mean"] == 0
    assert arm["fwt"]["mean"] is None and sequential["fwt"]["mean"] is not None
    assert arm["la"]["mean"] == pytest.approx(arm["op_tasks"]["mean"]) == pytest.approx(sum(R[T][1:]) / T)
    assert arm["bwt"]["mean"] == pytest.approx((R[T][0] - R[0][0]) / T)  # column 0 keeps its real change
    assert arm["joint"] and "joint" not in sequential


def test_mtl_learns_the_corpus_sequence_jointly_in_the_same_steps(tmp_path):
    result = CliRunner().invoke(app, [
        "bench", "--preset", "smoke", "--protocol", "sequence", "--domain-a", "tinyshakespeare",
        "--tasks", "renamed:tinyshakespeare,shakespeare-poems", "--methods", "full,mtl", "--seeds", "1",
        "--adapt-steps", "6", "--adapt-lr", "3e-3", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    methods = json.loads((tmp_path / "results.json").read_text())["methods"]
    check_joint(methods["mtl"], methods["full"], 2)
    losses = {label: json.loads((tmp_path / "arms" / label / "seed0.json").read_text())["loss"] for label in methods}
    assert [[t, s] for t, s, _ in losses["full"]] == [[t, s] for t in (1, 2) for s in range(1, 7)]
    assert [[t, s] for t, s, _ in losses["mtl"]] == [[1, s] for s in range(1, 13)]  # one schedule, 2 x 6 steps
    ppl = methods["mtl"]["ppl_matrix"]
    assert ppl[1] == ppl[2] and ppl[1][1] < ppl[0][1] and ppl[1][2] < ppl[0][2]       # it learned both tasks
    assert "rows 1..T = after learning all tasks at once" in (tmp_path / "results.md").read_text()


def test_a_joint_arm_of_the_instruction_stream_trains_once_on_every_tasks_rows(tmp_path, monkeypatch):
    seen = []

    class Recording(instruct.InstructionSampler):
        def __init__(self, rows, batch_size, seed, other=None, p=0.0, group=1):
            seen.append(len(rows))
            groups.add(group)
            super().__init__(rows, batch_size, seed, other, p, group=group)

    groups = set()
    monkeypatch.setattr(instruct, "InstructionSampler", Recording)
    tok = tiny_tokenizer()
    cfg = build_config("real", {**SMALL, "adapt": {**SMALL["adapt"], "group_by_length": 2}})
    results = instruct.run_on(tiny_llama(tok.vocab_size), tok, cfg, ["seq-lora", "seq-lora[joint=true]"], [0],
                              tmp_path, "real", "tiny-llama")
    assert seen == [16, 16, 32]                        # seq-lora: each task's 16 rows; the joint arm: both tasks'
    assert groups == {2}                               # adapt.group_by_length reaches every arm's sampler
    arms = results["methods"]
    joint, sequential = arms["seq-lora[joint=true]"], arms["seq-lora"]
    check_joint(joint, sequential, 2)
    assert joint["general_ppl"][1] == joint["general_ppl"][2] != joint["general_ppl"][0]
    assert joint["held_out"][1] == joint["held_out"][2]
    saved = json.loads((tmp_path / "arms" / "seq-lora[joint=true]" / "seed0.json").read_text())
    assert len(saved["loss"]) == 2 * SMALL["adapt"]["steps"] and {t for t, _, _ in saved["loss"]} == {1}


def test_joint_metrics_and_where_joint_arms_run():
    R = [[50.0, 10.0, 20.0], [40.0, 60.0, 70.0], [40.0, 60.0, 70.0]]
    m = sequence_metrics(R, joint=True)
    assert m["bwt_tasks"] == m["forgetting_tasks"] == m["bwt_drop_clipped"] == 0 and m["fwt"] is None
    assert m["op_tasks"] == m["la"] == 65.0 and m["bwt"] == -5.0       # column 0 fell 10 points, over 2 terms
    assert sequence_metrics(R)["fwt"] == 70.0 - 20.0                   # read as a sequence it would be a gain
    cfg = build_config("smoke")
    assert [m.cfg.joint for m in build_arms(cfg, ["full", "mtl", "lora[joint=true]"], sequence=True).values()] == \
        [False, True, True]
    for spec in ("mtl", "full[joint=true]"):
        with pytest.raises(ForgetlessError, match="learns all tasks of a sequence at once"):
            build_arms(cfg, [spec])                                    # two-domain and online


def test_a_joint_arm_refuses_or_warns_where_it_cannot_act(tmp_path):
    from forgetless.adapted import ForgetlessWarning
    from tiny_models import ours
    with pytest.warns(ForgetlessWarning, match="joint"):
        forgetless.attach(ours(), "mtl")
    data = tmp_path / "new.jsonl"  # valid data: the refusal is the method's, not the data check's
    data.write_text("".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(4)))
    result = CliRunner().invoke(app, ["adapt", "--model", "smollm2-135m", "--data", str(data),
                                      "--method", "mtl", "--out", str(tmp_path / "out")])
    assert result.exit_code != 0 and "task-sequence protocol" in result.output
    assert not (tmp_path / "out").exists()
