"""Models at their real size: a hub id through transformers' cache, a dtype, 4-bit and 8-bit (bitsandbytes) bases
that every method not training the base weights attaches to, trains, saves, reloads and exports on (the others
refuse in one line), and gradient checkpointing in forgetless's loop and under Trainer (both variants)."""
import copy
import json
import os
import subprocess
import sys
import warnings
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch
from tiny_models import SENTENCES, bpe_tokenizer, quantizable_llama

import forgetless
from forgetless.errors import ForgetlessError
from forgetless.methods import build_method, method_names
from forgetless.methods.base import MODULES, quantized
from forgetless.models import hf
from forgetless.models.hf import LoadConfig, load_model

needs_bnb = pytest.mark.skipif(find_spec("bitsandbytes") is None,
                               reason="bitsandbytes is not installed (pip install 'forgetless[quant]')")
SRC = str(Path(forgetless.__file__).parents[1])


@pytest.fixture(scope="module")
def tok():
    return bpe_tokenizer()


@pytest.fixture(scope="module")
def folder(tmp_path_factory, tok):
    """A saved tiny Llama (linears bitsandbytes runs on a CPU) with its tokenizer."""
    root = tmp_path_factory.mktemp("llama") / "model"
    quantizable_llama(len(tok)).save_pretrained(root)
    tok.save_pretrained(root)
    return root


@pytest.fixture(scope="module")
def bases(folder):
    """{bits: the quantized base, never run}: each test takes copies (a load takes seconds; a copy, milliseconds)."""
    return {bits: quiet(load_model, f"hf:{folder}", "cpu", LoadConfig(quantize=bits))[0] for bits in ("4bit", "8bit")}


def windows(n: int = 4, seed: int = 0):
    return torch.randint(1, 250, (n, 17), generator=torch.Generator().manual_seed(seed))  # (N, T+1)


def quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():  # bitsandbytes' 8-bit matmul warns on every call that it casts to fp16
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


# ---- 4-bit and 8-bit bases ------------------------------------------------------------------
@needs_bnb
@pytest.mark.parametrize("bits", ["4bit", "8bit"])
@pytest.mark.parametrize("name", method_names())
def test_every_method_runs_on_a_quantized_base_or_refuses_in_one_line(bases, tmp_path, bits, name):
    """A method that trains only its own modules attaches, trains (its weights move), saves, reloads onto a fresh
    quantized base (the same logits) and exports without merging into packed weights; one that trains the model's
    own weights refuses in one line naming a method that runs there."""
    model = copy.deepcopy(bases[bits])
    assert quantized(model) == bits
    method = build_method(name)
    if method.trains != MODULES:
        with pytest.raises(ForgetlessError, match=f"{bits}-quantized.*e.g. lora") as e:
            forgetless.attach(model, method)
        assert "\n" not in str(e.value)
        return
    torch.manual_seed(0)  # the modules' initialisation, whatever ran before
    adapted = quiet(forgetless.attach, model, method)
    adapted.start_task(1, windows(seed=1) if method.needs_previous else None)
    ids = windows(2, seed=2)[:, :-1]
    start = {n: p.detach().clone() for n, p in adapted.trainable_parameters()}
    opt = torch.optim.AdamW([p for _, p in adapted.trainable_parameters()], lr=1e-2)
    adapted.train()
    for _ in range(2):
        quiet(adapted.loss, windows()).backward()
        opt.step()
        opt.zero_grad()
    adapted.end_task(1)
    after = quiet(adapted.eval(), input_ids=ids).logits
    assert any(not torch.equal(p, start[n]) for n, p in adapted.trainable_parameters())  # it trained
    adapted.save_pretrained(tmp_path / "saved")
    again = quiet(forgetless.from_pretrained, copy.deepcopy(bases[bits]), tmp_path / "saved")
    torch.testing.assert_close(quiet(again.eval(), input_ids=ids).logits, after, rtol=0, atol=1e-5)
    form, out = adapted.export(tmp_path / "export")
    assert form in ("peft", "forgetless") and not (out / "model.safetensors").exists()  # no merged weights
    assert quantized(adapted.model) == bits  # nothing was merged into the packed weights


@needs_bnb
def test_a_task_stream_on_a_4bit_base_runs_seq_lora_and_refuses_lora_merges(bases):
    model = copy.deepcopy(bases["4bit"])
    from peft.tuners.lora import LoraLayer
    adapted = forgetless.attach(model, "seq-lora")
    outputs = []
    for task in (1, 2, 3):
        adapted.start_task(task)
        opt = torch.optim.AdamW([p for _, p in adapted.trainable_parameters()], lr=1e-2)
        for _ in range(2):
            adapted.loss(windows(seed=task)).backward()
            opt.step()
            opt.zero_grad()
        adapted.end_task(task)
        outputs.append(adapted.eval()(input_ids=windows(1)[:, :-1]).logits)
        adapted.train()
    assert not torch.equal(outputs[0], outputs[2])
    layers = [m for m in adapted.model.modules() if isinstance(m, LoraLayer)]
    assert layers and not any(m.merged or getattr(m, "forgetless_merged", False) for m in layers)  # never merged
    assert quantized(adapted.model) == "4bit"
    lora = forgetless.attach(copy.deepcopy(bases["4bit"]), "lora")
    lora.start_task(1)
    with pytest.raises(ForgetlessError, match="use seq-lora"):
        lora.start_task(2)


def test_quantize_without_bitsandbytes_says_how_to_install(folder, monkeypatch):
    monkeypatch.setattr(hf, "find_spec", lambda name: None if name == "bitsandbytes" else find_spec(name))
    with pytest.raises(ForgetlessError, match=r"pip install bitsandbytes .*forgetless\[quant\]"):
        load_model(f"hf:{folder}", "cpu", LoadConfig(quantize="4bit"))


@needs_bnb
def test_adapt_refuses_a_base_training_method_on_a_quantized_base_before_loading(folder, tmp_path, monkeypatch):
    from forgetless.cli import app
    from typer.testing import CliRunner
    loads = []
    monkeypatch.setattr(hf, "load_folder", lambda *a: loads.append(a))
    data = tmp_path / "new.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Q{i}", "answer": s}) + "\n" for i, s in enumerate(SENTENCES * 10)))
    r = CliRunner().invoke(app, ["adapt", "--model", f"hf:{folder}", "--data", str(data), "--method", "full",
                                 "--quantize", "4bit", "--out", str(tmp_path / "out")])
    assert r.exit_code == 2 and "full trains the model's own weights" in r.output and not loads


# ---- dtype and the hub -----------------------------------------------------------------------
def test_dtype_loads_the_weights_in_it_and_auto_follows_the_device(folder, monkeypatch):
    import forgetless.device as devices
    assert next(load_model(f"hf:{folder}", "cpu", LoadConfig(dtype="bf16"))[0].parameters()).dtype == torch.bfloat16
    cpu = torch.device("cpu")
    monkeypatch.setattr(devices, "cpu_bf16", lambda: "AMX")
    assert hf.resolve_dtype("auto", "bfloat16", cpu) == torch.bfloat16
    assert hf.resolve_dtype("auto", None, cpu) == torch.bfloat16  # no dtype saved: bf16 where it is native
    assert hf.resolve_dtype("auto", "float32", cpu) == torch.float32  # the checkpoint's
    assert hf.resolve_dtype("auto", "float16", cpu) == torch.float32  # fp16 is native on CUDA only
    monkeypatch.setattr(devices, "cpu_bf16", lambda: None)
    assert hf.resolve_dtype("auto", "bfloat16", cpu) == torch.float32
    with pytest.raises(ForgetlessError, match="load.dtype 'int4' is not one of auto, fp32, bf16, fp16"):
        LoadConfig(dtype="int4")


def test_full_weight_training_in_bf16_says_small_updates_are_lost(folder):
    model, _ = load_model(f"hf:{folder}", "cpu", LoadConfig(dtype="bf16"))
    with pytest.warns(forgetless.ForgetlessWarning, match="no float32 master copy"):
        forgetless.attach(model, "full")
    with warnings.catch_warnings():
        warnings.simplefilter("error", forgetless.ForgetlessWarning)
        forgetless.attach(load_model(f"hf:{folder}", "cpu", LoadConfig(dtype="bf16"))[0], "lora")  # adapters: silent


def hub_cache(root: Path, folder: Path, repo: str) -> Path:
    """`folder` laid out as huggingface_hub caches `repo`: models--ORG--NAME/{refs/main, snapshots/REV/...}."""
    rev = "0123456789abcdef0123456789abcdef01234567"
    entry = root / f"models--{repo.replace('/', '--')}"
    (entry / "refs").mkdir(parents=True)
    (entry / "refs" / "main").write_text(rev)
    snapshot = entry / "snapshots" / rev
    snapshot.mkdir(parents=True)
    for f in folder.iterdir():
        (snapshot / f.name).write_bytes(f.read_bytes())
    return root


def test_a_hub_id_loads_from_the_hub_cache_offline_and_a_missing_one_names_the_download(folder, tmp_path):
    """In a fresh process (huggingface_hub reads its environment at import): HF_HUB_OFFLINE=1, a hub cache holding
    tiny/llama; hf:tiny/llama loads through transformers as the folder does, hf:tiny/absent is one line naming
    the command that fetches it."""
    cache = hub_cache(tmp_path / "hub", folder, "tiny/llama")
    script = f"""
import json, torch
from forgetless.errors import ForgetlessError
from forgetless.models.hf import load_model
model, tok = load_model("hf:tiny/llama", "cpu")
local, _ = load_model("hf:{folder}", "cpu")
same = all(torch.equal(a, b) for a, b in zip(model.parameters(), local.parameters()))
try:
    load_model("hf:tiny/absent", "cpu")
    error = None
except ForgetlessError as e:
    error = str(e)
print(json.dumps({{"same": same, "vocab": tok.vocab_size, "error": error}}))
"""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "HF_HOME": str(tmp_path / "home"),
           "PYTHONPATH": SRC}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["same"] and result["vocab"] > 0
    assert "`hf download tiny/absent`" in result["error"] and "\n" not in result["error"]


# ---- gradient checkpointing ------------------------------------------------------------------
def grads(model, method: str):
    torch.manual_seed(0)  # the same LoRA initialisation
    adapted = forgetless.attach(model, method)
    adapted.loss(windows()).backward()
    return {n: p.grad.clone() for n, p in adapted.trainable_parameters()}


@pytest.mark.parametrize("variant", ["on", "reentrant"])
def test_gradient_checkpointing_gives_the_same_gradients_in_our_loop(folder, variant):
    """LoRA on a checkpointed model (both variants; the reentrant one needs the embedding's output to require
    grad) gets the gradients it gets without checkpointing."""
    plain = grads(load_model(f"hf:{folder}", "cpu")[0], "lora")
    model, _ = load_model(f"hf:{folder}", "cpu", LoadConfig(gradient_checkpointing=variant))
    assert model.is_gradient_checkpointing
    checkpointed = grads(model, "lora")
    assert plain.keys() == checkpointed.keys()
    assert all(g.abs().sum() > 0 for n, g in plain.items() if "lora_B" in n)  # (A's are zero while B is)
    for n, g in plain.items():
        torch.testing.assert_close(checkpointed[n], g, rtol=1e-5, atol=1e-7, msg=n)


@pytest.mark.parametrize("variant", ["on", "reentrant"])
def test_the_ewc_fisher_pass_keeps_gradient_checkpointing_and_its_values(folder, variant):
    """EWC's Fisher pass runs in eval mode (no dropout), where transformers would not checkpoint: with the
    non-reentrant variant its layers stay checkpointed (each runs again in the backward, so it holds one layer's
    activations, not every layer's); the reentrant one cannot give torch.autograd.grad's gradients and is left
    off there. The Fisher is the one computed without checkpointing."""
    from forgetless.methods.ewc import empirical_fisher
    rows = [(w[:-1], w[1:]) for w in windows()]
    plain = empirical_fisher(load_model(f"hf:{folder}", "cpu")[0], rows)
    model, _ = load_model(f"hf:{folder}", "cpu", LoadConfig(gradient_checkpointing=variant))
    calls, mode = [], model.training
    model.model.layers[0].input_layernorm.register_forward_hook(lambda *_: calls.append(1))  # the layer's first step
    checkpointed = empirical_fisher(model, rows)
    assert len(calls) == (2 if variant == "on" else 1) * len(rows)  # each row's forward (and its recomputation)
    assert model.training == model.model.layers[0].training == mode  # put back as it was
    for n, f in plain.items():
        torch.testing.assert_close(checkpointed[n], f, rtol=1e-5, atol=1e-9, msg=n)


@pytest.mark.parametrize("reentrant,bits", [(True, "none"), (False, "none"), (True, "4bit")])
def test_trainer_with_gradient_checkpointing_trains_lora(folder, tmp_path, tok, reentrant, bits):
    """Trainer(gradient_checkpointing=True) on the Adapted: LoRA trains with either variant (reentrant: the
    'does not require grad' failure of transformers 4's default), on an NF4 base too (QLoRA: Trainer takes the
    method's modules as the adapters a quantized model needs)."""
    from transformers import Trainer, TrainingArguments
    if bits != "none" and find_spec("bitsandbytes") is None:
        pytest.skip("bitsandbytes is not installed (pip install 'forgetless[quant]')")
    new = forgetless.data.load([{"prompt": f"Q{i}: {s}", "answer": s} for i, s in enumerate(SENTENCES * 2)], tok, 32)
    adapted = forgetless.attach(load_model(f"hf:{folder}", "cpu", LoadConfig(quantize=bits))[0], "lora")
    start = {n: p.detach().clone() for n, p in adapted.trainable_parameters()}
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, report_to=[],
                             learning_rate=1e-2, use_cpu=True, save_strategy="no", disable_tqdm=True,
                             gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    Trainer(model=adapted, args=args, train_dataset=new, data_collator=forgetless.data.Collator(tok),
            callbacks=[forgetless.ForgetlessCallback(adapted)]).train()
    assert adapted.model.is_gradient_checkpointing
    assert any(not torch.equal(p, start[n]) for n, p in adapted.trainable_parameters())


# ---- checks before the load ------------------------------------------------------------------
def adapt(monkeypatch, *args):
    """`forgetless adapt` in this process; the model's load is recorded (refusals must come before it)."""
    from typer.testing import CliRunner

    from forgetless.cli import app
    loads = []
    real = hf.load_folder
    monkeypatch.setattr(hf, "load_folder", lambda *a: loads.append(a) or real(*a))
    return CliRunner().invoke(app, ["adapt", *map(str, args)]), loads


def records(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("case", ["missing", "missing-retain", "one-record", "fields", "empty-text"])
def test_adapt_checks_its_data_before_loading_the_model(folder, tmp_path, monkeypatch, case):
    """A missing file (no minutes spent trying it as a hub dataset), too few records, unknown fields or an empty
    text file: one line, exit 2, and the model never loaded."""
    good = records(tmp_path / "new.jsonl", [{"prompt": f"Q{i}", "answer": s} for i, s in enumerate(SENTENCES * 3)])
    data, retain, said = {
        "missing": (tmp_path / "nope.jsonl", None, "nope.jsonl: no such file or folder"),
        "missing-retain": (good, "./old.txt", "--retain ./old.txt: no such file"),
        "one-record": (records(tmp_path / "one.jsonl", [{"text": "a"}]), None, "has 1 record(s); give at least 2"),
        "fields": (records(tmp_path / "odd.jsonl", [{"question": "a"}] * 4), None, "has fields question; give records"),
        "empty-text": (good, tmp_path / "old.txt", "old.txt is empty"),
    }[case]
    (tmp_path / "old.txt").write_text("  \n")
    r, loads = adapt(monkeypatch, "--model", f"hf:{folder}", "--data", data, *(["--retain", retain] if retain else []),
                     "--method", "lora", "--out", tmp_path / "out")
    assert r.exit_code == 2 and said in r.output and not loads, r.output


def test_forgetless_data_load_refuses_a_missing_file_without_trying_the_hub(tok, tmp_path):
    with pytest.raises(ForgetlessError, match="no such file or folder"):
        forgetless.data.load(tmp_path / "typo.jsonl", tok)


@pytest.mark.parametrize("case", ["few", "repeats"])
def test_a_report_on_thin_held_out_rows_says_so(folder, tmp_path, monkeypatch, case):
    """Five records hold one row out (fewer than 20); records that repeat put training rows among the held-out
    ones. The report says so (report.json notes, report.md, the terminal); 300 distinct records say nothing."""
    rows = {"few": [{"prompt": f"Q{i}", "answer": s} for i, s in enumerate(SENTENCES + SENTENCES[:1])],
            "repeats": [{"prompt": "Q", "answer": s} for s in SENTENCES * 60]}[case]
    r, _ = adapt(monkeypatch, "--model", f"hf:{folder}", "--data", records(tmp_path / "new.jsonl", rows),
                 "--method", "lora", "--preset", "smoke", "--max-length", 24, "--adapt-steps", 1,
                 "--out", tmp_path / "out")
    assert r.exit_code == 0, r.output
    notes = json.loads((tmp_path / "out" / "report.json").read_text())["notes"]
    expect = {"few": "only 1 held-out row(s) scored", "repeats": "24 of 24 held-out rows repeat training rows"}[case]
    assert [n for n in notes if expect in n] and expect in (tmp_path / "out" / "report.md").read_text()
    assert expect in " ".join(r.output.split())


def test_a_report_on_enough_distinct_rows_has_no_notes(tok):
    from forgetless.continual.user_adapt import held_out, thin
    data = forgetless.data.load([{"prompt": f"Q{i}", "answer": f"A{i}"} for i in range(300)], tok, 24)
    assert thin(*held_out(data, "--data"), "--data") == []
    assert len(thin(*held_out(data.select([0] * 300), "--data"), "--data")) == 1  # 30 held out, all repeats


@needs_bnb
def test_adapt_trains_lora_on_a_4bit_base_with_gradient_checkpointing(folder, tmp_path, monkeypatch):
    """`forgetless adapt --quantize 4bit --gradient-checkpointing`: forgetless's own loop trains LoRA on the NF4 base
    with checkpointed layers; the report records how the model was loaded; the export is a PEFT adapter."""
    rows = [{"prompt": f"Q{i}: {s}", "answer": s} for i, s in enumerate(SENTENCES * 6)]
    r, _ = adapt(monkeypatch, "--model", f"hf:{folder}", "--data", records(tmp_path / "new.jsonl", rows),
                 "--method", "lora", "--preset", "smoke", "--max-length", 24, "--adapt-steps", 2, "--quantize", "4bit",
                 "--gradient-checkpointing", "--out", tmp_path / "out")
    assert r.exit_code == 0, r.output
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["load"] == {"dtype": "fp32", "quantize": "4bit", "gradient_checkpointing": "on", "dtype_used": "float32"}
    assert report["export"]["form"] == "peft" and all(torch.isfinite(torch.tensor(loss)) for _, loss in report["loss"])


def test_loading_options_without_a_pretrained_model_refuse(tmp_path):
    from typer.testing import CliRunner

    from forgetless.cli import app
    r = CliRunner().invoke(app, ["bench", "--preset", "smoke", "--quantize", "4bit", "--out", str(tmp_path / "b")])
    assert r.exit_code == 2 and "--quantize and --gradient-checkpointing load a pretrained --model" in r.output


def test_adapt_data_with_fsdp_refuses_what_does_not_shard_before_loading(folder, tmp_path, monkeypatch):
    """(tests/test_fsdp.py runs `adapt --data --fsdp` in 2 processes.)"""
    data = records(tmp_path / "new.jsonl", [{"prompt": f"Q{i}", "answer": s} for i, s in enumerate(SENTENCES * 3)])
    r, loads = adapt(monkeypatch, "--model", f"hf:{folder}", "--data", data, "--fsdp", "--out", tmp_path / "out")
    assert r.exit_code == 2 and "this is one; launch with torchrun --nproc_per_node N" in r.output and not loads
    r, loads = adapt(monkeypatch, "--model", f"hf:{folder}", "--data", data, "--method", "osf", "--fsdp",
                     "--out", tmp_path / "out")
    assert r.exit_code == 2 and "method osf does not shard under --fsdp: it splits" in r.output and not loads
