"""MoRAM, MoE-LoRA and the two LoRA flavours as methods over a task sequence."""
import pytest
import torch

from forgetless import attach
from forgetless.checkpoint import load_checkpoint, save_checkpoint
from forgetless.continual.arm import adapt_task
from forgetless.data.domains import Domain
from forgetless.errors import ForgetlessError
from forgetless.methods import method_names
from forgetless.models.gpt import logits_of
from forgetless.presets import AdaptConfig
from forgetless.report.diagnostics import method_figures
from tiny_models import hf_gpt2, ours
from tiny_results import run_result



def domain(seed: int) -> Domain:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 256, (3000,), generator=g)
    return Domain(f"d{seed}", tokens, tokens, tokens[:17 * 8].view(8, 17), [], f"fp{seed}")


CFG = AdaptConfig(steps=6, batch_size=4, lr=1e-2, warmup=1, eval_every=100, ckpt_every=100)


def run_tasks(adapted, n_tasks: int):
    tasks = [domain(i) for i in range(n_tasks + 1)]
    for t in range(1, n_tasks + 1):
        adapt_task(adapted, tasks[t], tasks[0], CFG, task_index=t, sampler_seed=t)
    return adapted


def atoms(adapted) -> dict:
    return {k: v.clone() for k, v in adapted.method_state().items()}


def attached(name: str, make):
    """The method attached to a fresh model, an input and the model's logits on it."""
    model = make()
    x = torch.randint(0, 256, (2, 12))
    before = logits_of(model.eval(), x)
    return attach(model, name), x, before


@pytest.mark.parametrize("make", [ours, hf_gpt2], ids=["ours", "hf-gpt2"])
@pytest.mark.parametrize("name", ["moram", "moe-lora"])
def test_old_task_tensors_stay_bit_identical(make, name):
    adapted, x, before = attached(name, make)
    model = adapted.model
    run_tasks(adapted, 1)
    after_one = atoms(adapted)
    assert any(v.abs().sum() > 0 for k, v in after_one.items() if ".values." in k or ".up." in k)  # it trained
    assert not torch.allclose(logits_of(model.eval(), x), before)
    adapt_task(adapted, domain(2), domain(0), CFG, task_index=2, sampler_seed=2)
    after_two = atoms(adapted)
    first_task = [k for k in after_one if k.endswith(".0") and ".router." not in k]
    assert first_task and all(torch.equal(after_one[k], after_two[k]) for k in first_task)
    second_values = [k for k in after_two if k.endswith(".1") and (".values." in k or ".up." in k)]
    assert second_values and any(after_two[k].abs().sum() > 0 for k in second_values)


@pytest.mark.parametrize("make", [ours, hf_gpt2], ids=["ours", "hf-gpt2"])
@pytest.mark.parametrize("name", ["moram", "moe-lora"])
def test_new_task_starts_neutral(make, name):
    adapted, x, before = attached(name, make)
    assert adapted.trainable_parameters()  # task 1's bank comes with attach
    assert torch.allclose(logits_of(adapted.eval(), x), before, atol=1e-6)  # values / expert B start at zero
    adapted.start_task(2)  # task 2's values / expert B start at zero too (routing over the union changes)
    new = [p for n, p in adapted.trainable_parameters() if n.endswith((".values.1", ".up.1"))]
    assert new and all(p.abs().sum() == 0 for p in new)


def test_moe_lora_router_keeps_training_over_all_experts():
    adapted = run_tasks(attach(ours(), "moe-lora"), 2)
    names = [n for n, _ in adapted.trainable_parameters()]
    assert any(n.endswith("router.0") for n in names) and any(n.endswith("router.1") for n in names)
    assert not any(n.endswith("down.0") or n.endswith("up.0") for n in names)


def test_three_task_bank_saves_and_rebuilds_any_prefix(tmp_path):
    adapted = attach(ours(), "moram")
    x = torch.randint(0, 256, (2, 12))
    tasks = [domain(i) for i in range(4)]
    outputs = []
    for t in range(1, 4):
        adapt_task(adapted, tasks[t], tasks[0], CFG, task_index=t, sampler_seed=t)
        outputs.append(logits_of(adapted.eval(), x))
    save_checkpoint(tmp_path / "bank.safetensors", adapted.method_state(), {"kind": "method"})
    tensors, _ = load_checkpoint(tmp_path / "bank.safetensors")
    assert {k.rsplit(".", 1)[1] for k in tensors} == {"0", "1", "2"}  # one tensor per task and layer
    for n_tasks in (3, 2, 1):
        prefix = {k: v for k, v in tensors.items() if int(k.rsplit(".", 1)[1]) < n_tasks}
        rebuilt = attach(ours(), "moram")
        rebuilt.method.load_state_dict(rebuilt.model, prefix)
        assert torch.equal(logits_of(rebuilt.eval(), x), outputs[n_tasks - 1])
    with pytest.raises(ForgetlessError, match="more tasks than the saved state"):
        adapted.method.load_state_dict(adapted.model, {k: v for k, v in tensors.items() if k.endswith(".0")})


def test_moram_needs_linear_targets():
    with pytest.raises(ForgetlessError, match="wraps linear layers, but transformer.h.0.mlp is a"):
        attach(ours(), "moram", target_modules="mlp")


def test_lora_merges_per_task_and_seq_lora_keeps_one_adapter(tmp_path):
    x = torch.randint(0, 256, (2, 12))
    a, b = run_tasks(attach(ours(), "lora"), 1), run_tasks(attach(ours(), "seq-lora"), 1)
    assert torch.equal(logits_of(a.eval(), x), logits_of(b.eval(), x))  # one task: the same method
    before = logits_of(a.eval(), x)
    a.start_task(2)   # merges: same function, adapter reset (B = 0), base weights moved
    assert torch.allclose(logits_of(a.eval(), x), before, atol=1e-5)
    assert all(p.abs().sum() == 0 for n, p in a.named_parameters() if "lora_B" in n)
    a.save_pretrained(tmp_path / "lora")  # the merged base weights are part of the method's state
    from forgetless import from_pretrained
    assert torch.equal(logits_of(from_pretrained(ours(), tmp_path / "lora").eval(), x), logits_of(a.eval(), x))
    kept = {n: p.clone() for n, p in b.named_parameters() if "lora_B" in n}
    b.start_task(2)
    assert all(torch.equal(p, kept[n]) for n, p in b.named_parameters() if "lora_B" in n)


def test_default_sets_per_protocol():
    assert "seq-lora" in method_names("sequence") and "seq-lora" not in method_names("two-domain")
    assert "apn" in method_names("two-domain") and "apn" not in method_names("sequence")
    assert {"moram", "moe-lora", "lora", "full"} <= set(method_names("sequence"))
    assert "moram" not in method_names("two-domain")


def test_atom_map_report_and_figure(tmp_path):
    adapted = run_tasks(attach(ours(), "moram"), 2)
    windows = [domain(i).windows for i in range(3)]
    report = adapted.method.task_report(adapted.model, windows)
    assert report["atom_task"] == [1] * 8 + [2] * 8
    weights = torch.tensor(report["atom_weights"])             # (inputs, atoms)
    assert weights.shape == (3, 16) and (weights >= 0).all() and (weights.sum(-1) <= 1 + 1e-5).all()
    results = run_result("sequence", {"moram": {"task_reports": [report, report]}, "full": {}})
    assert method_figures(results, tmp_path) == [tmp_path / "atom_map.png"]
    assert (tmp_path / "atom_map.png").stat().st_size > 1000
    assert method_figures(run_result("sequence", {"full": {}}), tmp_path / "none") == []


def test_olora_keeps_each_task_in_an_orthogonal_subspace_and_merges_exactly():
    def overlap(lam):
        adapted = run_tasks(attach(ours(), "o-lora", lam=lam, lr=3e-2), 2)
        banks = adapted.method.banks(adapted.model)
        return adapted, sum((b.down[0] @ b.down[1].T).square().sum().item() for _, b in banks)
    adapted, with_loss = overlap(5.0)
    assert with_loss < 0.5 * overlap(0.0)[1]  # the penalty pushes A_2 away from A_1
    assert [n for n, _ in adapted.trainable_parameters()][0].endswith("down.1")  # task 1's LoRA is frozen
    x = torch.randint(0, 256, (2, 12))
    before = logits_of(adapted.eval(), x)
    merged = adapted.merge_and_unload()
    assert not adapted.method.banks(merged) and torch.allclose(logits_of(merged.eval(), x), before, atol=1e-5)
