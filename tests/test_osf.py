"""osf, PEFT's orthogonal subspace fine-tuning, over a task sequence: the frozen share grows per task as PEFT's
example does, each task's delta is merged before the next SVD (peft's unload would drop it), a task's updates
leave its frozen singular directions alone, and two tasks save, reload, export and train under Trainer."""
import pytest
import torch
from peft.tuners.osf.layer import OSFLayer

import forgetless
from forgetless.errors import ForgetlessError
from forgetless.methods import build_method
from forgetless.models.gpt import logits_of
from tiny_models import bpe_tokenizer, gguf_llama, hf_llama, ours

X = torch.randint(0, 256, (4, 13), generator=torch.Generator().manual_seed(1))  # (B, T+1) windows


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def steps(adapted, n: int = 2, opt_cls=torch.optim.AdamW, lr: float = 1e-2, x: torch.Tensor = X):
    opt = opt_cls([p for _, p in adapted.trainable_parameters()], lr=lr)
    adapted.train()
    for _ in range(n):
        adapted.loss(x).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return adapted.eval()


def layers(adapted) -> dict[str, OSFLayer]:
    return {n: m for n, m in adapted.model.named_modules() if isinstance(m, OSFLayer)}


@torch.no_grad()
def logits(model) -> torch.Tensor:
    return logits_of(model.eval(), X[:, :-1])


def test_the_frozen_share_grows_per_task_as_in_pefts_example():
    osf = build_method("osf")
    assert [osf.preserved(t) for t in (1, 2, 3, 4, 5)] == pytest.approx([0.3, 0.5, 0.7, 0.9, 0.95])
    counts = build_method("osf", {"effective_rank": "8", "rank_step": "4"})  # PEFT's guide: r = 8, then r += 4
    assert [counts.preserved(t) for t in (1, 2, 3)] == [8, 12, 16] and isinstance(counts.preserved(2), int)
    adapted = forgetless.attach(hf_llama(), "osf")
    q = layers(adapted)["model.layers.0.self_attn.q_proj"]          # 32 x 32: 0.3 -> int(9.6) = 9 frozen
    assert q.effective_rank["default"] == 9 and q.osf_svd_params["default"]["S_low"].shape == (23,)
    adapted.start_task(2)
    q = layers(adapted)["model.layers.0.self_attn.q_proj"]
    assert q.effective_rank["default"] == 16 and q.osf_svd_params["default"]["S_low"].shape == (16,)
    for bad in ({"effective_rank": "0"}, {"rank_step": "-0.1"}, {"rank_step": "2"}, {"effective_rank": "8.5"}):
        with pytest.raises(ForgetlessError, match="osf: effective_rank"):
            build_method("osf", bad)


@pytest.mark.parametrize("model", [ours, hf_llama], ids=["gpt", "llama"])
def test_a_new_task_keeps_what_the_last_one_learned_and_starts_from_it(model):
    """peft's unload() between tasks would drop task 1's delta; osf merges it: the function is unchanged at the
    switch (up to rounding), and task 2 trains new factors of the merged weights' SVD."""
    adapted = steps(forgetless.attach(model(), "osf"))
    after_1 = logits(adapted)
    assert (after_1 - logits(model())).abs().max() > 1e-3             # task 1 learned something
    first = {n: p for n, p in adapted.trainable_parameters()}
    adapted.start_task(2)
    torch.testing.assert_close(logits(adapted), after_1, rtol=0, atol=1e-5)
    second = dict(adapted.trainable_parameters())
    assert second.keys() == first.keys() and all(second[n] is not first[n] for n in first)
    assert all(getattr(m.get_base_layer(), "forgetless_merged", False) for m in layers(adapted).values())


def test_a_tasks_updates_leave_its_frozen_directions_alone():
    """With plain SGD (the update is the projected gradient) the top singular directions of each weight at the
    task's start carry what they carried: U_high^T dW = 0 and dW V_high^T = 0, up to float32 rounding (relative
    1e-4 here; without peft's projection hooks, 1e-2 to 6e-2)."""
    adapted = steps(forgetless.attach(hf_llama(), "osf"))             # task 1 (AdamW)
    adapted.start_task(2)
    before = {n: effective_weight(m) for n, m in layers(adapted).items()}
    steps(adapted, n=3, opt_cls=torch.optim.SGD, lr=0.5, x=torch.randint(0, 256, (4, 13), generator=torch.Generator().manual_seed(5)))
    for name, m in layers(adapted).items():
        k = m.effective_rank["default"]
        U, _, Vh = torch.linalg.svd(before[name].double(), full_matrices=False)
        dW = effective_weight(m).double() - before[name].double()
        assert dW.norm() > 1e-4, name                                 # the low directions moved
        assert (U[:, :k].T @ dW).norm() < 1e-3 * dW.norm(), name
        assert (dW @ Vh[:k].T).norm() < 1e-3 * dW.norm(), name


@torch.no_grad()
def effective_weight(layer: OSFLayer) -> torch.Tensor:
    return layer.get_base_layer().weight + layer.get_delta_weight("default")


def test_two_tasks_reload_and_export_merged(tmp_path):
    """After two tasks: from_pretrained on a fresh base gives the same logits (the merged weights and peft's
    frozen factors are saved: the SVD is not redone); the export is the merged model transformers loads."""
    from transformers import AutoModelForCausalLM
    tok = bpe_tokenizer()
    gguf_llama(len(tok)).save_pretrained(tmp_path / "base")
    tok.save_pretrained(tmp_path / "base")
    x = torch.randint(0, len(tok), (4, 13), generator=torch.Generator().manual_seed(2))
    adapted = steps(forgetless.attach(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), "osf"), x=x)
    adapted.start_task(2)
    adapted = steps(adapted, x=x.flip(0))
    expected = logits_of(adapted, x[:, :-1])
    adapted.save_pretrained(tmp_path / "saved")
    again = forgetless.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), tmp_path / "saved")
    assert again.task == 2
    with torch.no_grad():
        torch.testing.assert_close(logits_of(again.eval(), x[:, :-1]), expected, rtol=0, atol=0)
    assert again.export(tmp_path / "export", tok) == ("merged", tmp_path / "export")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    assert not any("osf" in n for n, _ in merged.named_parameters())
    with torch.no_grad():
        torch.testing.assert_close(merged(x[:, :-1]).logits, expected, rtol=0, atol=1e-5)


def test_trainer_trains_the_factors_a_new_task_makes(tmp_path):
    """Trainer builds its optimizer before the callback starts the task; task 2's re-decomposition makes new
    parameters, which the callback puts in that optimizer: they train (they would stay at their SVD init)."""
    from transformers import Trainer, TrainingArguments
    tok = bpe_tokenizer()
    rows = [{"input_ids": ids, "labels": ids} for ids in torch.randint(1, len(tok), (16, 12)).tolist()]
    adapted = forgetless.attach(gguf_llama(len(tok)), "osf")
    for task in (1, 2):
        args = TrainingArguments(output_dir=str(tmp_path / str(task)), max_steps=3, per_device_train_batch_size=4,
                                 save_strategy="no", report_to=[], learning_rate=1e-2, use_cpu=True, seed=0,
                                 disable_tqdm=True)
        trainer = Trainer(model=adapted, args=args, train_dataset=rows, data_collator=forgetless.data.Collator(tok),
                          callbacks=[forgetless.ForgetlessCallback(adapted)])
        before = logits_of(adapted.eval(), torch.tensor([rows[0]["input_ids"]]))
        trainer.train()
        assert adapted.task == task
        in_optimizer = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
        assert all(id(p) in in_optimizer for _, p in adapted.trainable_parameters())
        for m in layers(adapted).values():
            assert not torch.equal(m.osf_svd_params["default"]["U_low"], m._osf_U_low_init["default"])
        assert not torch.allclose(logits_of(adapted.eval(), torch.tensor([rows[0]["input_ids"]])), before)
