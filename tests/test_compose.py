"""Protecting terms composed with any method (`lora+ewc`, `lora+distill`, ...): state over the trainable
parameters only, the EWC penalty's gradients exact (the chunked KL's: test_loss.py), specs that parse, list, save and
reload, a study arm, and one-line refusals."""
import json

import pytest
import torch
from test_user_training import adapt, hf_batch, nudge, tok, user_files  # noqa: F401 (fixtures)
from tiny_models import tiny

import forgetless
from forgetless.errors import ForgetlessError
from forgetless.methods import build_method
from forgetless.methods.base import parse_method_specs
from forgetless.methods.ewc import Pull

OLD = torch.randint(0, 256, (4, 13), generator=torch.Generator().manual_seed(1))  # (N, T+1) windows of old data


def composed(spec: str, kind: str = "llama"):
    adapted = forgetless.attach(tiny(kind), spec)
    adapted.start_task(1, OLD if adapted.method.needs_previous else None)
    return adapted


@pytest.mark.parametrize("spec", ["lora+ewc", "lora+distill", "lora[r=4]+ewc[lam=50]+distill[beta=2]"])
def test_state_is_over_the_trainable_parameters_only(spec):
    """Fisher and anchor/teacher hold one tensor per trainable (LoRA) parameter, of its shape and dtype, and no
    copy of a base weight; the terms act (the loss is above the LM loss once the adapter moved)."""
    adapted = composed(spec)
    trainable = dict(adapted.trainable_parameters())
    state = adapted.method.hook_state()
    names = {k.split(".", 1)[1] for k in state}
    assert names == set(trainable) and all("lora_" in n for n in names)
    for key, t in state.items():
        p = trainable[key.split(".", 1)[1]]
        assert t.shape == p.shape and t.dtype == p.dtype and t.data_ptr() != p.data_ptr()
    assert sum(t.numel() for t in state.values()) <= 2 * sum(p.numel() for p in trainable.values())
    assert ("ewc" in spec) == any(k.startswith("fisher.") for k in state)
    nudge(adapted)
    adapted.train()
    total, lm = adapted.losses(hf_batch())
    assert total.item() > lm.item() + 1e-6


def test_the_fisher_is_accumulated_in_fp32_and_kept_in_the_models_dtype():
    adapted = forgetless.attach(tiny("llama").to(torch.bfloat16), "lora+ewc")
    adapted.start_task(1, OLD)
    fisher = adapted.method.terms[0].fisher
    assert fisher and all(f.dtype == torch.bfloat16 for f in fisher.values())
    assert any(f.float().sum() > 0 for f in fisher.values())


def test_the_penalty_gradient_is_autograds_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    p = torch.randn(5, 7, generator=g, requires_grad=True)
    f, a = torch.rand(5, 7, generator=g), torch.randn(5, 7, generator=g)
    (0.5 * 30.0 * Pull.apply(p, f, a)).backward()
    ours, p.grad = p.grad, None
    (0.5 * 30.0 * (f * (p - a).square()).sum()).backward()
    assert torch.equal(ours, p.grad) and ours.abs().sum() > 0


def test_lora_distill_teacher_is_the_model_at_the_task_start_without_a_weight_copy():
    """At task 1 (LoRA's B is zero) the teacher's logits are the base's; the KL is 0 until the adapter moves."""
    model = tiny("llama")
    batch = hf_batch()
    with torch.no_grad():
        base_logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    adapted = composed("lora+distill")
    adapted.model.load_state_dict(model.state_dict(), strict=False)
    adapted.train()
    assert adapted.method.extra_loss(adapted.model, forgetless.data.splits.Batch.of(batch)).item() == 0.0
    from torch.func import functional_call
    with torch.no_grad():
        teacher = functional_call(adapted.model, adapted.method.start, (batch["input_ids"],),
                                  {"attention_mask": batch["attention_mask"]}).logits
    torch.testing.assert_close(teacher, base_logits)


@pytest.mark.parametrize("spec", ["lora[r=4]+ewc[lam=50]", "lora+distill[beta=2]", "neutral+distill", "moram+ewc"])
def test_composed_specs_save_and_reload_with_the_same_loss(tmp_path, spec):
    (parsed,) = parse_method_specs(spec)
    assert parsed.label == spec and "+" in parsed.name
    adapted = composed(spec)
    nudge(adapted)
    adapted.train()
    adapted.save_pretrained(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "forgetless_config.json").read_text())
    assert saved["method"] == parsed.name
    again = forgetless.from_pretrained(tiny("llama"), tmp_path / "saved").train()
    assert again.method.options() == adapted.method.options()
    torch.testing.assert_close(again.losses(hf_batch())[0], adapted.losses(hf_batch())[0], rtol=1e-6, atol=1e-7)
    again.eval(), adapted.eval()
    ids = hf_batch()["input_ids"]
    torch.testing.assert_close(again(input_ids=ids).logits, adapted(input_ids=ids).logits)


def test_a_composition_takes_the_methods_traits_and_the_terms_needs():
    m = build_method("lora+distill")
    assert m.name == "lora+distill" and m.merges and m.injects and not m.needs_previous and m.cfg.mix == 0.1
    assert m.start_copies == ()  # LoRA's start values are not the base's: they are saved
    assert not m.unshardable and build_method("osf+distill").unshardable == build_method("osf").unshardable
    assert build_method("lora+ewc").needs_previous and parse_method_specs("lora[mix=0.3]+distill")[0].build().cfg.mix == 0.3
    assert build_method("full+ewc").start_copies == ("start.",)


@pytest.mark.parametrize("spec, message", [
    ("ewc+distill", "ewc cannot take terms"), ("lora+l2", "unknown term 'l2'"), ("lorra+ewc", "unknown method 'lorra'"),
    ("lora+ewc+ewc", "each term once"), ("lora+ewc[beta=1]", "beta"), ("lora[mix=0]+distill", "mix=0"),
    ("dynamic-eval+ewc", "dynamic-eval cannot take terms")])
def test_bad_combinations_are_one_line_errors(spec, message):
    with pytest.raises(ForgetlessError, match=message) as err:
        parse_method_specs(spec)[0].build()
    assert "\n" not in str(err.value)


def test_the_methods_command_lists_the_terms():
    from typer.testing import CliRunner

    from forgetless.cli import app
    r = CliRunner().invoke(app, ["methods"], env={"COLUMNS": "200"})
    assert r.exit_code == 0 and "lora+ewc" in r.output and "fisher_samples" in r.output


def test_adapt_and_trainer_run_a_composition(user_files, tmp_path, tok):  # noqa: F811
    from transformers import Trainer, TrainingArguments

    from tiny_models import gguf_llama
    r = adapt("--model", f"hf:{user_files / 'model'}", "--data", user_files / "new.jsonl", "--retain",
              user_files / "old.txt", "--method", "lora[r=4]+ewc[lam=100]+distill", "--preset", "smoke",
              "--max-length", 32, "--out", tmp_path / "out")
    assert r.exit_code == 0, r.output
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["method"] == "lora+ewc+distill" and report["mix"] == 0.1 and report["export"]["form"] == "peft"
    adapted = forgetless.attach(gguf_llama(len(tok)), "lora+distill")
    new, old = forgetless.data.load(user_files / "new.jsonl", tok, 32), forgetless.data.load(user_files / "old.txt", tok, 32)
    trainer = Trainer(model=adapted, args=TrainingArguments(output_dir=str(tmp_path / "t"), max_steps=2, report_to=[],
                                                            use_cpu=True, disable_tqdm=True, learning_rate=1e-3),
                      train_dataset=forgetless.data.mix(new, old, 0.5), data_collator=forgetless.data.Collator(tok),
                      callbacks=[forgetless.ForgetlessCallback(adapted)])
    trainer.train()
    assert adapted.method.start and all("lora_" in n for n in adapted.method.start)


def test_a_study_arm_at_another_lr_keeps_a_spec_that_parses_back():
    """`forgetless study` sets each arm's lr (at_lr): the lr goes to the method, the label parses back to the arm."""
    from forgetless.continual.study import at_lr
    arm = at_lr(parse_method_specs("lora[r=16]+ewc[lam=1e3]")[0], 1e-3)
    assert arm.label == "lora[r=16;lr=0.001]+ewc[lam=1e3]" and parse_method_specs(arm.label) == [arm]
    assert arm.build().cfg.lr == 1e-3 and arm.build().terms[0].cfg.lam == 1e3
