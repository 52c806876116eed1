import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from forgetless.checkpoint import load_checkpoint, save_checkpoint
from forgetless.loss import training_loss
from forgetless.data.splits import Sampler
from forgetless.errors import ForgetlessError
from forgetless.models.gpt import GPT, GPTConfig
from forgetless.train import TrainConfig, TrainingDiverged, lr_at, train


def setup(steps=20, **kw):
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, d_model=16, block_size=8))
    sampler = Sampler(torch.arange(2000) % 7, 4, 8, seed=0)  # a learnable pattern
    cfg = TrainConfig(**{**dict(steps=steps, batch_size=4, lr=1e-2, warmup=2, eval_every=5, ckpt_every=5), **kw})
    return model, sampler, cfg


def loss_fn(model, batch):
    return training_loss(model, batch)


def test_lr_schedule():
    cfg = TrainConfig(steps=100, lr=1.0, warmup=10, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(0.1) and lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(99, cfg) == pytest.approx(0.1, abs=1e-3)
    assert lr_at(10, cfg) > lr_at(50, cfg) > lr_at(90, cfg)


def test_loss_goes_down():
    model, sampler, cfg = setup(steps=60)
    history = train(model, list(model.named_parameters()), sampler, cfg, loss_fn)
    first, last = history.loss[0][1], sum(l for _, l in history.loss[-10:]) / 10
    assert last < first - 1.0


def test_gradients_are_freed_before_the_next_forward():
    """The gradients of a step are gone when the next step's forward runs (not alive beside its activations)."""
    model, sampler, cfg = setup(steps=3)
    held = []  # whether any parameter held a gradient at each forward

    def recording(m, batch):
        held.append(any(p.grad is not None for p in m.parameters()))
        return loss_fn(m, batch)

    train(model, list(model.named_parameters()), sampler, cfg, recording)
    assert held == [False, False, False]


def test_checkpoint_resume_in_process_is_exact(tmp_path):
    model, sampler, cfg = setup(steps=20)
    full = train(model, list(model.named_parameters()), sampler, cfg, loss_fn)
    model3, sampler3, _ = setup(steps=20)
    model4, sampler4, cfg4 = setup(steps=20)
    ckpt2 = tmp_path / "ckpt2.safetensors"
    with pytest.raises(KeyboardInterrupt):
        def interrupting(m, b, calls=[0]):
            calls[0] += 1
            if calls[0] == 13:
                raise KeyboardInterrupt
            return loss_fn(m, b)
        train(model4, list(model4.named_parameters()), sampler4, cfg4, interrupting, ckpt_path=ckpt2,
              run_config={"x": 1})
    assert load_checkpoint(ckpt2)[1]["step"] == 10
    history = train(model3, list(model3.named_parameters()), sampler3, cfg4, loss_fn, ckpt_path=ckpt2,
                    run_config={"x": 1})
    assert history.loss == full.loss
    for (n, p), (_, q) in zip(model.named_parameters(), model3.named_parameters()):
        assert torch.equal(p, q), n


def test_resume_with_different_config_is_refused(tmp_path):
    model, sampler, cfg = setup(steps=5)
    ckpt = tmp_path / "c.safetensors"
    train(model, list(model.named_parameters()), sampler, cfg, loss_fn, ckpt_path=ckpt, run_config={"lr": 1})
    before = ckpt.read_bytes()
    with pytest.raises(ForgetlessError, match=r"different config \(lr: 1 -> 2\)"):
        train(model, list(model.named_parameters()), sampler, cfg, loss_fn, ckpt_path=ckpt, run_config={"lr": 2})
    assert ckpt.read_bytes() == before


def test_nan_loss_stops_and_keeps_last_good_checkpoint(tmp_path):
    model, sampler, cfg = setup(steps=20)
    ckpt = tmp_path / "c.safetensors"

    def poisoned(m, b, calls=[0]):
        calls[0] += 1
        loss, lm = loss_fn(m, b)
        return (loss * float("nan"), lm) if calls[0] == 8 else (loss, lm)
    with pytest.raises(TrainingDiverged, match=r"loss is nan at step 8; stopped, the last good checkpoint \(step 5\) is kept"):
        train(model, list(model.named_parameters()), sampler, cfg, poisoned, ckpt_path=ckpt, run_config={})
    tensors, meta = load_checkpoint(ckpt)
    assert meta["step"] == 5 and all(torch.isfinite(t).all() for t in tensors.values() if t.is_floating_point())


def test_corrupt_and_truncated_checkpoints(tmp_path):
    path = tmp_path / "c.safetensors"
    save_checkpoint(path, {"w": torch.ones(1000)}, {"kind": "x"})
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ForgetlessError, match="is corrupt or truncated"):
        load_checkpoint(path)
    path.write_bytes(b"garbage" * 10)
    with pytest.raises(ForgetlessError, match="is corrupt or truncated"):
        load_checkpoint(path)
    with pytest.raises(ForgetlessError, match="does not exist"):
        load_checkpoint(tmp_path / "missing.safetensors")


def test_a_save_killed_inside_safetensors_leaves_only_its_own_folder(tmp_path, monkeypatch):
    """safetensors >= 0.7 writes through a `.tmpXXXXXX` file beside its target; a kill there must leave nothing
    but save_checkpoint's private folder (which the next save, or serve's restart, clears)."""
    import forgetless.checkpoint as checkpoint

    def killed(tensors, filename, metadata=None):
        (Path(filename).parent / ".tmpAb12Cd").write_bytes(b"half")
        raise KeyboardInterrupt  # stands in for the kill
    real = checkpoint.save_file
    monkeypatch.setattr(checkpoint, "save_file", killed)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path / "c.safetensors", {"w": torch.ones(3)}, {})
    host = socket.gethostname()
    assert [p.name for p in tmp_path.iterdir()] == [f".c.safetensors.tmp-{host}-{os.getpid()}"]
    monkeypatch.setattr(checkpoint, "save_file", real)
    save_checkpoint(tmp_path / "c.safetensors", {"w": torch.ones(3)}, {})
    assert [p.name for p in tmp_path.iterdir()] == ["c.safetensors"]
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    for pid in (int(dead.stdout), os.getppid()):  # a killed writer's folder, and a live process's (kept)
        (tmp_path / f".c.safetensors.tmp-{host}-{pid}").mkdir()
        (tmp_path / f".c.safetensors.tmp-{host}-{pid}" / ".tmpAb12Cd").write_bytes(b"half")
    save_checkpoint(tmp_path / "c.safetensors", {"w": torch.ones(3)}, {})
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".c.safetensors.tmp-{host}-{os.getppid()}", "c.safetensors"]


def test_no_trainable_parameters():
    model, sampler, cfg = setup()
    with pytest.raises(ForgetlessError, match="nothing to train"):
        train(model, [], sampler, cfg, loss_fn)


PRETRAIN = [sys.executable, "-m", "forgetless", "pretrain", "--preset", "smoke", "--domain-a", "tinyshakespeare",
            "--model-d-model", "64", "--pretrain-batch-size", "16", "--pretrain-steps", "300",
            "--pretrain-ckpt-every", "10", "--pretrain-eval-every", "50"]


def test_sigkill_mid_run_then_resume_matches_uninterrupted(tmp_path):
    """Kill a pretraining subprocess with SIGKILL, resume it, compare with an uninterrupted run."""
    env = {**os.environ}
    killed = tmp_path / "killed.safetensors"
    ckpt = Path(str(killed) + ".training.safetensors")
    proc = subprocess.Popen(PRETRAIN + ["--out", str(killed)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if ckpt.exists() and load_checkpoint(ckpt)[1]["step"] >= 30:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not killed.exists()
    step_at_kill = load_checkpoint(ckpt)[1]["step"]
    assert 0 < step_at_kill < 300
    refused = subprocess.run(PRETRAIN + ["--out", str(killed)], env=env, capture_output=True, text=True)
    assert refused.returncode == 2 and "pass --resume" in refused.stderr
    subprocess.run(PRETRAIN + ["--out", str(killed), "--resume"], env=env, check=True, capture_output=True)
    clean = tmp_path / "clean.safetensors"
    subprocess.run(PRETRAIN + ["--out", str(clean)], env=env, check=True, capture_output=True)
    (t1, m1), (t2, m2) = load_checkpoint(killed), load_checkpoint(clean)
    assert m1["history"]["evals"] == m2["history"]["evals"]  # same final metrics, same curve
    assert m1["history"]["loss"] == m2["history"]["loss"]
    assert all(torch.equal(t1[k], t2[k]) for k in t2)
    assert not ckpt.exists()


def lora_setup(r: int):
    from tiny_lm import tiny_llama

    import forgetless
    adapted = forgetless.attach(tiny_llama(300), f"lora[r={r}]")
    torch.manual_seed(1)
    sampler = Sampler(torch.arange(3000) % 11 + 3, 4, 16, seed=0)
    cfg = TrainConfig(steps=12, batch_size=4, lr=1e-2, warmup=2, eval_every=100, ckpt_every=4)
    return adapted, sampler, cfg


def test_a_lora_checkpoint_holds_its_adapters_not_the_base_and_resumes_exactly(tmp_path):
    """Frozen base: the checkpoint is the trained tensors and their optimizer state (bytes proportional to the
    trainable parameters, no base weight), and a run stopped after it and resumed ends as an uninterrupted one."""
    def run(r, ckpt=None, stop_at=None):
        adapted, sampler, cfg = lora_setup(r)
        params, calls = adapted.trainable_parameters(), [0]

        def loss(m, batch):
            calls[0] += 1
            if calls[0] == stop_at:
                raise KeyboardInterrupt
            return adapted.losses(batch)
        history = train(adapted.model, params, sampler, cfg, loss, ckpt_path=ckpt, run_config={"r": r})
        return adapted, history
    sizes = {}
    for r in (4, 8):
        ckpt = tmp_path / f"r{r}.safetensors"
        with pytest.raises(KeyboardInterrupt):
            run(r, ckpt, stop_at=7)
        tensors, meta = load_checkpoint(ckpt)
        adapted = lora_setup(r)[0]
        trained = sum(p.numel() for _, p in adapted.trainable_parameters())
        model_part = {k: v for k, v in tensors.items() if k.startswith("model.")}
        assert meta["step"] == 4 and all("lora_" in k for k in model_part), sorted(model_part)[:3]
        assert sum(v.numel() for v in model_part.values()) == trained
        sizes[r] = sum(v.numel() for k, v in tensors.items() if k.startswith(("model.", "optim.")) and v.dim())
        assert sizes[r] == 3 * trained  # the adapters, AdamW's two moments; nothing of the base
    assert sizes[8] == 2 * sizes[4]
    resumed, history = run(8, tmp_path / "r8.safetensors")
    whole, full = run(8)
    assert history.loss == full.loss
    for (n, p), (_, q) in zip(resumed.model.named_parameters(), whole.model.named_parameters()):
        assert torch.equal(p, q), n
