"""AUNN: encodings, training schedules, conditioning, generation, checkpoints."""
from itertools import pairwise

import pytest
import torch

import forgetless.train

from forgetless.aunn import shakespeare, toy
from forgetless.aunn.encoding import build_encoding
from forgetless.aunn.model import AUNN, AUNNConfig, count_params, match_width
from forgetless.aunn.train import Learner, AUNNTrainConfig, build_learner, fit, schedule
from forgetless.aunn.use import condition, generate, load_learner, prequential, save_learner
from forgetless.checkpoint import save_checkpoint
from forgetless.loss import training_loss
from forgetless.data.splits import Sampler
from forgetless.errors import ForgetlessError
from forgetless.models.gpt import GPT, GPTConfig
from forgetless.train import PretrainConfig

TINY = {"d_model": 32, "n_layer": 2}


@pytest.fixture(autouse=True)
def one_thread():
    """Small MLP steps are fastest (and steadiest on a busy machine) on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def trained(mode="batch", steps=60, n=96, **model) -> tuple[Learner, torch.Tensor]:
    data = torch.tensor(list(b"|aaa|ccc" * (n // 8)))
    learner = build_learner(AUNNConfig(**{**TINY, **model}), AUNNTrainConfig(mode=mode, steps=steps, batch_size=32,
                                                                        lr=3e-3, warmup=5))
    fit(learner, data)
    return learner, data


@pytest.mark.parametrize("kind", ["binary", "fourier"])
def test_encodings_are_distinct_for_distinct_indices(kind):
    enc = build_encoding(kind, bits=38, features=64, seed=0)
    idx = torch.cat([torch.arange(4096), torch.tensor([2 ** 20, 2 ** 20 + 1, 2 ** 37, 2 ** 38 - 2, 2 ** 38 - 1])])
    codes = enc(idx)
    assert codes.shape == (len(idx), enc.dim) and torch.isfinite(codes).all()
    assert len(torch.unique(codes, dim=0)) == len(idx)
    gaps = torch.cdist(codes, codes) + torch.eye(len(idx)) * 1e9
    assert gaps.min() > 1e-3  # not just different bits: separable by the network


def test_binary_encoding_is_the_index_in_bits():
    code = build_encoding("binary", bits=8, features=0, seed=0)(torch.tensor([5]))
    assert code.tolist() == [[1, -1, 1, -1, -1, -1, -1, -1]]


def test_encoding_errors_name_the_fix():
    with pytest.raises(ForgetlessError, match="raise --model-bits"):
        build_encoding("binary", bits=8, features=0, seed=0)(torch.tensor([256]))
    with pytest.raises(ForgetlessError, match="valid: binary, fourier"):
        AUNNConfig(encoding="onehot")
    with pytest.raises(ForgetlessError, match="even"):
        AUNNConfig(encoding="fourier", fourier_features=7)
    with pytest.raises(ForgetlessError, match=r"model.bits must be in \[1, 62\]"):
        AUNNConfig(bits=0)
    AUNNConfig(fourier_features=0)  # unused by the binary code
    with pytest.raises(ForgetlessError, match="model.output"):
        AUNNConfig(output="pixels")
    with pytest.raises(ForgetlessError, match="train.mode"):
        AUNNTrainConfig(mode="rnn")


def test_serial_mode_visits_indices_in_order_exactly_once_per_epoch():
    n = 17
    steps = list(schedule(n, AUNNTrainConfig(mode="serial", steps=3 * n), torch.Generator().manual_seed(0)))
    assert all(len(s) == 1 for s in steps)
    assert torch.cat(steps).tolist() == list(range(n)) * 3


def test_batch_mode_covers_every_index_once_per_epoch():
    n = 50
    steps = list(schedule(n, AUNNTrainConfig(mode="batch", steps=5, batch_size=10), torch.Generator().manual_seed(0)))
    assert sorted(torch.cat(steps).tolist()) == list(range(n))
    assert torch.cat(steps).tolist() != list(range(n))  # random order


def test_anneal_goes_from_batches_to_serial_and_ends_on_the_last_index():
    n, cfg = 40, AUNNTrainConfig(mode="anneal", steps=200, batch_size=8)
    steps = list(schedule(n, cfg, torch.Generator().manual_seed(0)))
    serial = [i for i, s in enumerate(steps) if len(s) == 1]
    assert len(serial) == cfg.steps // 2
    assert sum(i < 100 for i in serial) < sum(i >= 100 for i in serial) / 2  # ever more serial steps
    assert sum(i in serial for i in range(180, 200)) >= 18
    visited = torch.cat([steps[i] for i in serial]).tolist()
    assert visited[-1] == n - 1
    assert all((b - a) % n == 1 for a, b in pairwise(visited))  # in order, wrapping


def test_loss_curve_reaches_the_last_step():
    learner = build_learner(AUNNConfig(**TINY), AUNNTrainConfig(mode="batch", steps=403, batch_size=8, warmup=5))
    curve = fit(learner, torch.tensor(list(b"|aaa|ccc" * 4)))
    assert curve["step"][-1] == 403 and curve["step"][:2] == [2, 4]
    assert len(curve["loss"]) == len(curve["cpu_s"]) == 202


def test_training_memorises_and_moves_the_position():
    learner, data = trained(steps=150)
    assert learner.position == len(data)
    acc = (learner.predict(torch.arange(len(data))).argmax(-1) == data).float().mean()
    assert acc > 0.9


def test_conditioning_changes_the_prediction_at_the_conditioned_index():
    learner, _ = trained()
    i = torch.tensor([learner.position])
    before = learner.predict(i).softmax(-1)[0]
    new = int(before.topk(2).indices[1])  # the byte it finds second most likely there
    idx = condition(learner, torch.tensor([new]), steps=8)
    after = learner.predict(i).softmax(-1)[0]
    assert idx.tolist() == i.tolist() and learner.position == i.item() + 1
    assert after[new] > 2 * before[new]
    assert after.argmax() == new != before.argmax()


def test_generation_is_reproducible_under_a_seed(tmp_path):
    learner, _ = trained()
    save_learner(tmp_path / "a.safetensors", learner)
    runs = []
    for seed in (3, 3, 4):
        again, _ = load_learner(tmp_path / "a.safetensors")
        runs.append(generate(again, 24, temperature=1.0, seed=seed).tolist())
        assert again.position == learner.position + 24
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_checkpoint_round_trip_keeps_predictions_optimizer_and_position(tmp_path):
    learner, _ = trained(encoding="fourier", bits=12, fast_units=4)
    save_learner(tmp_path / "a.safetensors", learner, data="toy")
    loaded, meta = load_learner(tmp_path / "a.safetensors")
    idx = torch.arange(200)
    assert torch.equal(loaded.predict(idx), learner.predict(idx))
    assert loaded.position == learner.position and meta["data"] == "toy"
    assert loaded.steps_done == learner.steps_done
    x, y = torch.tensor([7]), torch.tensor([3])
    learner.step(x, y)
    loaded.step(x, y)
    assert torch.allclose(loaded.predict(idx), learner.predict(idx), atol=1e-6)  # same Adam state


def test_load_learner_rejects_other_checkpoints(tmp_path):
    save_checkpoint(tmp_path / "gpt.safetensors", {"w": torch.zeros(1)}, {"kind": "base"})
    with pytest.raises(ForgetlessError, match="not an AUNN checkpoint"):
        load_learner(tmp_path / "gpt.safetensors")


def test_snapshot_restore_undoes_steps():
    learner, _ = trained()
    snap = learner.snapshot()
    idx = torch.arange(64)
    before = learner.predict(idx)
    condition(learner, torch.tensor([1, 2, 3]), steps=3)
    assert not torch.equal(learner.predict(idx), before)
    learner.restore(snap)
    assert torch.equal(learner.predict(idx), before) and learner.position == snap["position"]
    condition(learner, torch.tensor([1, 2, 3]), steps=3)  # the optimizer state came back too: same result
    again = learner.predict(idx)
    learner.restore(snap)
    condition(learner, torch.tensor([1, 2, 3]), steps=3)
    assert torch.equal(learner.predict(idx), again)


def test_prequential_scores_before_learning():
    learner, data = trained()
    start = learner.position
    frozen = prequential(learner, data[:16], learn=False)
    assert learner.position == start and frozen.shape == (16,)
    online = prequential(learner, data[:16])
    assert learner.position == start + 16
    assert online[0] == pytest.approx(frozen[0].item(), rel=1e-4)  # the first is predicted before any step


def test_fast_units_get_the_higher_learning_rate():
    learner, _ = trained(fast_units=4)
    fast = {id(p) for p in learner.model.fast_parameters()}
    assert len(fast) == 2
    lrs = {id(p): g["lr"] for g in learner.opt.param_groups for p in g["params"]}
    assert [lrs[i] for i in fast] == [pytest.approx(10 * 3e-3)] * 2
    assert max(v for k, v in lrs.items() if k not in fast) == pytest.approx(3e-3)


def test_value_output_regresses_a_number():
    data = torch.arange(64).float() % 8 / 8
    learner = build_learner(AUNNConfig(output="value", **TINY), AUNNTrainConfig(mode="batch", steps=200, batch_size=64,
                                                                           lr=3e-3, warmup=5))
    curve = fit(learner, data)
    assert curve["loss"][-1] < 0.1 * curve["loss"][0]
    with pytest.raises(ForgetlessError, match="predicts values"):
        generate(learner, 4)


def test_param_count_and_width_matching():
    for cfg in (AUNNConfig(**TINY), AUNNConfig(encoding="fourier", fast_units=8, output="value", n_layer=2, d_model=40)):
        assert count_params(cfg) == AUNN(cfg).num_params()
    matched = match_width(AUNNConfig(n_layer=4), 842_496)
    assert abs(count_params(matched) / 842_496 - 1) < 0.05


def test_gpt_prequential_scores_in_eval_mode_and_needs_the_context():
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, n_layer=1, n_head=2, d_model=16, dropout=0.5))
    tokens = torch.randint(256, (64,))
    static = shakespeare.gpt_prequential(model, tokens, 32, 16, segment=8, lr=0.0)
    dynamic = shakespeare.gpt_prequential(model, tokens, 32, 16, segment=8, lr=1e-2)
    assert torch.equal(dynamic[:8], static[:8])  # scored before any step, and without dropout
    assert not torch.equal(dynamic[8:], static[8:])
    with pytest.raises(ForgetlessError, match="context"):
        shakespeare.gpt_prequential(model, tokens, 14, 2, segment=8, lr=0.0)  # 16 bytes before the end < 17


def test_gpt_step_budget_leaves_out_the_warm_up(monkeypatch):
    clock = [0.0]

    def fake_train(model, params, sampler, cfg, loss_fn, desc):
        for _ in range(cfg.steps):
            clock[0] += 5.0 if clock[0] == 0 else 0.1  # a slow first step, then 0.1 CPU s per step

    monkeypatch.setattr(forgetless.train, "train", fake_train)
    monkeypatch.setattr(forgetless.train.time, "process_time", lambda: clock[0])
    model = GPT(GPTConfig(block_size=8, n_layer=1, n_head=1, d_model=8))
    sampler = Sampler(torch.zeros(64, dtype=torch.long), 2, 8, seed=0)
    assert forgetless.train.steps_for_seconds(10.0, model, sampler, PretrainConfig(batch_size=2), training_loss) == 100


def test_an_under_trained_toy_run_reports_whatever_bytes_it_predicts():
    cfg = toy.Config(patterns=["ac"], arms=["batch"], length=64, batch_steps=5, batch_size=32, far=64, change_steps=1)
    arm = toy.run(cfg, seed=0)["ac"]["batch"]  # seed 0 predicts bytes that are not UTF-8
    assert arm["truth_next"] == "|aaa|ccc|aaa|ccc"
    assert all(isinstance(arm[k], str) and arm[k] for k in ("pred_next", "generated"))
    assert len(arm["extrapolation"]) == 2 and all(0 <= v <= 1 for v in [arm["train_acc"], *arm["extrapolation"]])
    assert [c["steps"] for c in arm["change"]] == [0, 1] and all(0 <= c["p_new_rest"] <= 1 for c in arm["change"])
