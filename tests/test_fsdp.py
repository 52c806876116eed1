"""FSDP for transformers models (issue 20): 2 gloo processes under torchrun shard a tiny random Llama, against
1 process on the same global batch.

Tolerances, measured on CPU: LoRA through `forgetless adapt` gives the same recorded losses, and PPLs within
1e-6 relative (float reduction order of the sharded evaluation), adapter tensors within ~5e-8; we allow
1e-5 relative and 1e-6. Full fine-tuning under FSDP ends within ~1e-7 per element of one process (also when
resumed from a 1-process checkpoint at step 2), the same recorded losses and eval losses within 1e-7 relative;
we allow 1e-4 (AdamW's normalisation can magnify noise in near-zero gradients, see tests/test_ddp.py) and 1e-5.
"""
import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import forgetless
from forgetless import distributed
from forgetless.adapted import check_fsdp
from forgetless.checkpoint import load_checkpoint
from forgetless.data.splits import Sampler
from forgetless.errors import ForgetlessError
from forgetless.methods import build_method
from forgetless.methods.base import TERMS, method_names
from forgetless.models.hf import load_model
from forgetless.train import TrainConfig, train
import fsdp_worker
from test_cli import invoke
from test_ddp import run, torchrun
from tiny_models import bpe_tokenizer, gguf_llama, ours


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = bpe_tokenizer()
    gguf_llama(len(tokenizer)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture
def adapt_args(tmp_path, llama_folder, text_file):
    other = tmp_path / "other.txt"
    other.write_text("A completely different register of text, with numbers 12345. " * 300)
    return ["adapt", "--model", f"hf:{llama_folder}", "--method", "lora", "--preset", "smoke",
            "--domain-a", str(text_file), "--domain-b", str(other)]


def test_fsdp_adapt_matches_one_process_and_saves_a_whole_adapter(tmp_path, adapt_args, llama_folder):
    """`torchrun -m forgetless adapt --fsdp`: the curves of one process, and rank 0 saves every LoRA
    tensor whole, which `eval` loads in one process to the PPL the 2-process run measured (to 4 decimals of
    the table and the float rounding of the sharded evaluation)."""
    one = invoke(*adapt_args, "--out", tmp_path / "one")
    assert one.exit_code == 0, one.output
    two = subprocess.run([*torchrun(), "-m", "forgetless", *adapt_args, "--fsdp",
                          "--out", str(tmp_path / "two")],
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert two.returncode == 0, two.stderr[-3000:]
    assert two.stdout.count("wrote") == 1
    a, b = (forgetless_metrics(tmp_path / name) for name in ("one", "two"))
    assert [s for s, _ in a["loss"]] == [s for s, _ in b["loss"]]
    assert [l for _, l in b["loss"]] == pytest.approx([l for _, l in a["loss"]], rel=1e-5)
    for x, y in zip(a["curve"], b["curve"], strict=True):
        assert y["step"] == x["step"] and y["acc_b"] == x["acc_b"]
        assert (y["ppl_a"], y["ppl_b"]) == pytest.approx((x["ppl_a"], x["ppl_b"]), rel=1e-5)
    assert b["trainable_params"] == a["trainable_params"] and b["total_params"] == a["total_params"]
    saved, _ = load_checkpoint(tmp_path / "two" / "seed0" / "adapter_model.safetensors")
    reference, _ = load_checkpoint(tmp_path / "one" / "seed0" / "adapter_model.safetensors")
    assert saved.keys() == reference.keys() and len(saved) == 8  # lora_A and lora_B of q_proj, v_proj in 2 layers
    for k in saved:
        assert saved[k].shape == reference[k].shape and saved[k].numel() > 0, k
        assert torch.allclose(saved[k], reference[k], rtol=0, atol=1e-6), k
    model, _ = load_model(f"hf:{llama_folder}")
    loaded = forgetless.from_pretrained(model, tmp_path / "two" / "seed0")
    for name, t in loaded.method_state().items():
        assert torch.equal(t, saved[name]), name
    shown = invoke("eval", "--model", f"hf:{llama_folder}", "--corpus", adapt_args[-1], "--block-size", 32,
                   "--windows", 8, "--method-state", tmp_path / "two" / "seed0")
    assert shown.exit_code == 0, shown.output
    ppl = float(re.search(r"│ ([0-9.]+) +│ [0-9.]+ +│ [0-9.]+ +│", shown.output).group(1))
    assert ppl == pytest.approx(b["ppl_b_after"], rel=1e-5)


def forgetless_metrics(out: Path) -> dict:
    return json.loads((out / "metrics.json").read_text())


def test_fsdp_full_finetuning_resumes_a_one_process_checkpoint(tmp_path):
    """Every weight trains (the tied embeddings and head too): a 1-process checkpoint resumes sharded over 2
    processes (model and AdamW state split by `shard_as`), whose last checkpoint is whole again (`full`)."""
    fsdp_worker.main([str(tmp_path / "one.st"), "--ckpt", str(tmp_path / "one.ckpt")])
    ckpt = tmp_path / "ckpt.st"
    with pytest.raises(fsdp_worker.Stopped):
        fsdp_worker.main([str(tmp_path / "two.st"), "--ckpt", str(ckpt), "--stop-at", "3"])
    assert load_checkpoint(ckpt)[1]["step"] == 2
    run(tmp_path / "two.st", "--ckpt", str(ckpt), "--fsdp", procs=2, worker=fsdp_worker.__file__)
    a, meta_a = load_checkpoint(tmp_path / "one.st")
    b, meta_b = load_checkpoint(tmp_path / "two.st")
    assert meta_b["world_size"] == 2
    assert [l for _, l in meta_b["loss"]] == pytest.approx([l for _, l in meta_a["loss"]], rel=1e-5)
    assert [e["loss"] for e in meta_b["evals"]] == pytest.approx([e["loss"] for e in meta_a["evals"]], rel=1e-5)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=0, atol=1e-4), (k, (a[k] - b[k]).abs().max().item())
    whole, meta = load_checkpoint(ckpt)  # written by the FSDP run at its last step
    reference, _ = load_checkpoint(tmp_path / "one.ckpt")
    assert meta["step"] == 6 and whole.keys() == reference.keys()
    for k in reference:
        assert whole[k].shape == reference[k].shape, k
        assert torch.allclose(whole[k].float(), reference[k].float(), rtol=0, atol=1e-4), k


def test_fsdp_bad_combinations_are_one_line_errors(tmp_path, adapt_args, monkeypatch):
    r = invoke(*adapt_args, "--fsdp", "--out", tmp_path / "arm")
    assert r.exit_code == 2 and "this is one; launch with torchrun --nproc_per_node N" in r.output, r.output
    osf = [a if a != "lora" else "osf" for a in adapt_args]
    r = invoke(*osf, "--fsdp", "--out", tmp_path / "arm")
    assert r.exit_code == 2 and "method osf does not shard under --fsdp: it splits every whole weight" in r.output, r.output
    assert not (tmp_path / "arm" / "metrics.json").exists()
    with pytest.raises(ForgetlessError, match="GPT names none; use --model hf:PATH"):
        check_fsdp(ours(), build_method("lora"))
    monkeypatch.setattr(distributed, "sharded", lambda params: True)  # as under torchrun with --fsdp
    model = ours()
    sampler = Sampler(torch.arange(200) % 7, 4, 16, seed=0)
    with pytest.raises(ForgetlessError, match="adamw optimizer in fp32 or bf16 only, not muon"):
        train(model, list(model.named_parameters()), sampler, TrainConfig(steps=1, optimizer="muon"), None)


STREAMS = ["full", "mtl", "ffn", "lora", "seq-lora", "adapter", "moram", "moe-lora", "o-lora", "neutral", "ewc", "distill",
           "ewc-distill", "wise-ft", "dynamic-eval", "lora+ewc", "lora+distill", "moram+ewc"]  # every shardable method


def test_every_method_shards_or_names_why_and_what_does(monkeypatch):
    """`unshardable` on every registered method: one that shards is in STREAMS (tested below), one that does not
    refuses --fsdp in one line with its reason and a method that shards; every term is tested composed."""
    monkeypatch.setattr(distributed, "world_size", lambda: 2)  # as under torchrun
    model = gguf_llama(256)
    for name in method_names():
        method = build_method(name)
        if not method.unshardable:
            assert name in STREAMS, name
            check_fsdp(model, method)
            continue
        with pytest.raises(ForgetlessError) as refused:
            check_fsdp(model, method)
        said = re.fullmatch(rf"method {name} does not shard under --fsdp: (.+); use (\S+), or drop --fsdp to run it "
                            "with data parallelism", str(refused.value))
        assert said and said.group(1) == method.unshardable and said.group(2) in STREAMS, refused.value
    assert {f"lora+{term}" for term in TERMS} <= set(STREAMS)
    assert build_method("osf+ewc").unshardable == build_method("osf").unshardable


def test_fsdp_task_streams_match_one_process(tmp_path):
    """Every shardable method learns two tasks in turn (LoRA merging task 1, banks growing whole entries beside
    sharded ones, EWC's Fisher through FSDP's backward, the teacher of distill) sharded over 2 gloo processes as in
    one: the recorded losses to 1e-5 relative, the trained tensors and the method's state within 1e-4 (measured:
    up to ~1e-5, full fine-tuning's AdamW on near-zero gradients)."""
    args = ["--streams", ",".join(STREAMS), "--steps", "2"]
    fsdp_worker.main([str(tmp_path / "one"), *args])
    run(tmp_path / "two", *args, "--fsdp", procs=2, worker=fsdp_worker.__file__)
    for name in STREAMS:
        a, b = compare_streams(tmp_path / "one", tmp_path / "two", name, rel=1e-5)
        for k in a:
            assert torch.allclose(a[k].float(), b[k].float(), rtol=0, atol=1e-4), (name, k)
        check_rank1_built_on_meta(tmp_path / "two", name)


def compare_streams(one: Path, two: Path, name: str, rel: float) -> tuple[dict, dict]:
    """The tensors of `name`'s stream in one process and in two, once their recorded losses agree to `rel`."""
    a, meta_a = load_checkpoint(one / f"{name}.safetensors")
    b, meta_b = load_checkpoint(two / f"{name}.safetensors")
    assert meta_b["world_size"] == 2 and len(meta_b["loss"]) == 4, name
    assert [l for _, l in meta_b["loss"]] == pytest.approx([l for _, l in meta_a["loss"]], rel=rel), name
    assert a.keys() == b.keys(), name
    return a, b


def check_rank1_built_on_meta(two: Path, name: str):
    """Rank 1 built its model on the meta device (no weights loaded) and then held only its shards: half the
    elements (the 2 ranks' shards differ by at most a row per tensor)."""
    zero, one = (json.loads((two / f"{name}.rank{r}.json").read_text()) for r in (0, 1))
    assert one["meta"] and not zero["meta"], name
    assert zero["total"] == one["total"] and abs(one["held"] - one["total"] / 2) <= 0.05 * one["total"], (name, one)


def test_fsdp_bf16_mixed_precision_on_cpu(tmp_path):
    """--precision bf16 under --fsdp: FSDP2's MixedPrecisionPolicy (bf16 weights in forward and backward,
    gradients reduced in fp32, fp32 shards and AdamW) runs with gloo on CPU. It is not bit-comparable with one
    process's bf16 autocast (which keeps some ops in fp32): measured, losses within 1.5e-4 relative and trained
    tensors within 0.013 after 4 steps at lr 3e-3; we allow 1e-3 and 0.03, and check the policy acted (the losses
    differ from the fp32 run's)."""
    args = ["--streams", "lora,full", "--steps", "2"]
    fsdp_worker.main([str(tmp_path / "one"), *args, "--precision", "bf16"])
    fsdp_worker.main([str(tmp_path / "fp32"), *args])
    run(tmp_path / "two", *args, "--precision", "bf16", "--fsdp", procs=2, worker=fsdp_worker.__file__)
    for name in ("lora", "full"):
        a, b = compare_streams(tmp_path / "one", tmp_path / "two", name, rel=1e-3)
        for k in a:
            assert a[k].dtype == b[k].dtype == torch.float32 and torch.allclose(a[k], b[k], rtol=0, atol=0.03), k
        losses = [load_checkpoint(tmp_path / run_ / f"{name}.safetensors")[1]["loss"] for run_ in ("two", "fp32")]
        assert losses[0] != losses[1], name


def test_fsdp_adapt_data_matches_one_process(tmp_path, llama_folder):
    """`torchrun -m forgetless adapt --data --fsdp`: the report's scores before and after and its losses are one
    process's (to 1e-5 relative), and rank 0 exports the same PEFT adapter (tensors within 1e-6)."""
    rows = [{"prompt": f"Question {i}: what is {i} plus {i}?", "answer": f"It is {2 * i}."} for i in range(40)]
    data = tmp_path / "new.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["adapt", "--model", f"hf:{llama_folder}", "--data", str(data), "--method", "lora", "--preset", "smoke",
            "--precision", "fp32"]
    one = invoke(*args, "--out", tmp_path / "one")
    assert one.exit_code == 0, one.output
    two = subprocess.run([*torchrun(), "-m", "forgetless", *args, "--fsdp", "--out", str(tmp_path / "two")],
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300,
                         check=False)
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = (json.loads((tmp_path / name / "report.json").read_text()) for name in ("one", "two"))
    for when in ("before", "after"):
        assert b[when] == pytest.approx(a[when], rel=1e-5), when
    assert [l for _, l in b["loss"]] == pytest.approx([l for _, l in a["loss"]], rel=1e-5)
    assert a["export"]["form"] == b["export"]["form"] == "peft"
    x, y = (load_file(tmp_path / name / "model" / "adapter_model.safetensors") for name in ("one", "two"))  # PEFT's
    assert x.keys() == y.keys() and x
    for k in x:
        assert torch.allclose(x[k], y[k], rtol=0, atol=1e-6), k


def test_ranks_other_than_0_load_a_transformers_folder_without_weights(llama_folder):
    """`adapt --fsdp` on ranks other than 0: load_model(meta=True) builds the folder's model from its config on the
    meta device (the shapes, no weights; `shard_model` fills the shards), with the folder's tokenizer."""
    model, tokenizer = load_model(f"hf:{llama_folder}", "cpu", meta=True)
    whole, _ = load_model(f"hf:{llama_folder}", "cpu")
    shapes = {n: (p.shape, p.dtype) for n, p in whole.state_dict().items()}
    assert all(t.is_meta for t in model.state_dict().values())
    assert {n: (p.shape, p.dtype) for n, p in model.state_dict().items()} == shapes
    assert tokenizer.encode("hello") == load_model(f"hf:{llama_folder}", "cpu")[1].encode("hello")
