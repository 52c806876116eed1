"""The memory estimate (forgetless.memory): its per-layer constants are what autograd saves, it matches a measured
peak, and `adapt --plan`, `methods --memory`, the refusal of a run that does not fit and checkpointing turned on
where only that fits."""
import json

import pytest
import torch
from tiny_models import SENTENCES, bpe_tokenizer, quantizable_llama
from transformers import LlamaConfig, LlamaForCausalLM
from typer.testing import CliRunner

import forgetless
from forgetless.cli import app
from forgetless.device import eager_attention_bytes
from forgetless.memory import ENV, FROZEN, TRAINED, LivePeak, Setting, estimate, meta_model
from forgetless.methods import build_method
from forgetless.models import hf


def llama(layers: int, d: int = 48, ffn: int = 80, heads: int = 4, kv_heads: int = 2, vocab: int = 300):
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=d, intermediate_size=ffn, num_hidden_layers=layers,
                                        num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab))


def saved_bytes(model, tokens: int, amp: bool) -> int:
    """Bytes of the tensors autograd saves in one forward (weights not counted)."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in weights:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", enabled=amp):
        model(input_ids=torch.randint(300, (2, tokens)))
    return sum(seen.values())


@pytest.mark.parametrize("mode", ["fp32", "amp"])
@pytest.mark.parametrize("frozen", [False, True])
def test_activation_constants_are_what_autograd_saves_per_token_and_layer(mode, frozen):
    """A width not used to count them (d 48, FFN 80, 4 heads over 2): one more layer and 16 more tokens."""
    def per(layers, tokens):
        model = llama(layers)
        if frozen:
            model.requires_grad_(False)
            model.enable_input_require_grads()
        return saved_bytes(model, tokens, mode == "amp")
    measured = (per(2, 32) - per(1, 32) - per(2, 16) + per(1, 16)) / (2 * 16)  # bytes per token per layer
    coefficients = (FROZEN if frozen else TRAINED)[mode]
    assert measured == sum(c * x for c, x in zip(coefficients, (48, 80, 24, 4, 1)))


def test_eager_attention_keeps_what_its_estimate_counts():
    """bf16 training on a CPU runs attention eagerly (device.training_attention): what it saves beyond SDPA is
    within the estimate's part for it (8 bytes an entry) and at least the fp32 softmax and its bf16 copy (6)."""
    model = llama(2)
    sdpa = saved_bytes(model, 64, amp=True)
    model.set_attn_implementation("eager")
    extra = saved_bytes(model, 64, amp=True) - sdpa
    counted = eager_attention_bytes(2, 64, 4, 2)  # saved_bytes' 2 rows, 4 query heads, 2 layers
    assert 6 / 8 * counted <= extra <= counted, (extra, counted)
    s = Setting(2, 64, precision="bf16", eager=True)
    with_eager = estimate(meta_model(LlamaConfig(**SHAPE)), build_method("lora"), s).parts
    assert with_eager["eager attention"] == eager_attention_bytes(2, 64, 4, 2)
    assert "eager attention" not in estimate(meta_model(LlamaConfig(**SHAPE)), build_method("lora"),
                                             Setting(2, 64, precision="bf16", eager=True, checkpointing=True)).parts


SHAPE = dict(hidden_size=128, intermediate_size=344, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=4000)


def live_peak(method: str, own_loop: bool) -> int:
    """Peak live tensor bytes of two AdamW steps on a random Llama (fp32, no autocast) of 4 x 64 tokens (answer-only:
    the last quarter scored; one row of old data), the benchmark's way (bench_memory.measure): every tensor storage
    made from the model's construction on counted alive at once (LivePeak). `own_loop`: forgetless's loop
    (Adapted.losses); else the model's own forward, whose output holds every position's logits (as under Trainer)."""
    ids = torch.randint(4000, (4, 64), generator=torch.Generator().manual_seed(0))           # (B, T)
    labels = ids.clone()
    labels[:, :48] = -100
    retained = torch.tensor([True, False, False, False])
    with LivePeak() as live:
        torch.manual_seed(0)
        adapted = forgetless.attach(LlamaForCausalLM(LlamaConfig(**SHAPE)), method)
        adapted.start_task(1, torch.randint(4000, (2, 65)) if adapted.method.needs_previous else None)
        opt = torch.optim.AdamW([p for p in adapted.parameters() if p.requires_grad], lr=1e-4)
        for _ in range(2):
            if own_loop:
                adapted.loss({"input_ids": ids, "labels": labels, "retained": retained}).backward()
            else:
                out = adapted(input_ids=ids, labels=labels, retained=retained)
                out.loss.backward()  # `out` holds the logits through the backward, as most loops' outputs do
            opt.step()
            opt.zero_grad(set_to_none=True)
    return live.peak


@pytest.mark.parametrize("method", ["lora", "full", "lora+ewc", "ewc"])
def test_estimate_is_within_8_percent_of_the_measured_live_peak(method):
    """Through the model's own forward (`every_position`). The goal for the estimate is 15 %; what it leaves out
    (allocator slack, small temporaries, the int64 ids) stays below that here (bench_memory measured 1.00-1.01 for
    lora, full and lora+ewc at its shape s). Full-weight ewc: its penalty's gradients, made before the forward, are
    not counted (made after it, they were one more set of the weights, alive through the backward)."""
    predicted = estimate(meta_model(LlamaConfig(**SHAPE)), build_method(method),
                         Setting(4, 64, mix=0.25, scored=0.25, every_position=True)).total
    peak = live_peak(method, own_loop=False)
    # 8 %, not the goal's 15 %: here the activations are 14-19 % of the estimate, so at 15 % an estimate without them
    # still passed (0.855, a review's finding); the band was set after seeing 1.00-1.03 for lora, full and lora+ewc
    assert 0.92 < predicted / peak < 1.08, (predicted, peak)


@pytest.mark.parametrize("method", ["lora", "full", "ewc-distill", "lora+distill"])
def test_estimate_of_forgetless_loop_is_within_8_percent_of_its_live_peak(monkeypatch, method):
    """Through forgetless's own loop (adapt's: the head and the loss over chunks of the scored positions), with
    chunks of 16 positions, so that the LM loss runs in 4 chunks, each recomputed in the backward."""
    from forgetless import loss
    monkeypatch.setattr(loss, "CHUNK_BYTES", 4 * 4000 * 16)
    predicted = estimate(meta_model(LlamaConfig(**SHAPE)), build_method(method),
                         Setting(4, 64, mix=0.25, scored=0.25)).total
    peak = live_peak(method, own_loop=True)
    assert 0.92 < predicted / peak < 1.08, (predicted, peak)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    tok = bpe_tokenizer()
    root = tmp_path_factory.mktemp("llama") / "model"
    quantizable_llama(len(tok)).save_pretrained(root)
    tok.save_pretrained(root)
    return root


def adapt(monkeypatch, tmp_path, folder, *args):
    """`forgetless adapt --data` on the tiny Llama in this process; its loads are recorded."""
    data = tmp_path / "new.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Q{i}", "answer": s}) + "\n" for i, s in enumerate(SENTENCES * 3)))
    loads = []
    real = hf.load_folder
    monkeypatch.setattr(hf, "load_folder", lambda *a: loads.append(a) or real(*a))
    r = CliRunner().invoke(app, ["adapt", "--model", f"hf:{folder}", "--data", str(data), "--out", str(tmp_path / "out"),
                                 "--preset", "smoke", "--max-length", "24", "--adapt-steps", "1", *map(str, args)])
    return r, loads


def test_adapt_plan_prints_the_run_and_its_alternatives_and_runs_nothing(folder, tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, "1GiB")
    r, loads = adapt(monkeypatch, tmp_path, folder, "--method", "full", "--plan")
    assert r.exit_code == 0, r.output
    assert "memory plan" in r.output and "1.00 GiB ($FORGETLESS_DEVICE_MEMORY)" in r.output
    for flags in ("full --gradient-checkpointing", "full --adapt-batch-size 4", "--method lora --quantize 4bit"):
        assert f"MiB  {flags}" in r.output
    assert not loads and not (tmp_path / "out" / "report.json").exists()


def test_a_run_whose_estimate_is_above_the_device_stops_before_loading(folder, tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, "100KiB")
    r, loads = adapt(monkeypatch, tmp_path, folder, "--method", "full")
    assert r.exit_code == 2 and not loads, r.output
    assert "full needs about" in r.output and "above the 0.1 MiB of cpu ($FORGETLESS_DEVICE_MEMORY)" in r.output
    assert "none of --gradient-checkpointing" in r.output  # 100 KiB: not even LoRA on a 4-bit base fits


def test_checkpointing_turns_on_where_only_it_makes_the_run_fit(folder, tmp_path, monkeypatch):
    from forgetless.memory import alternatives, setting
    from forgetless.presets import build_config, resolve_run
    _, cfg, _ = resolve_run(build_config("smoke", {"adapt": {"steps": 1}}), torch.device("cpu"))
    config, s = setting(f"hf:{folder}", build_method("full"), cfg, torch.device("cpu"), 24)
    (_, plain), (_, checkpointed), *_ = alternatives(config, "full", lambda: build_method("full"), s)
    assert checkpointed.total < plain.total
    monkeypatch.setenv(ENV, str(int((plain.total + checkpointed.total) / 2)))
    r, loads = adapt(monkeypatch, tmp_path, folder, "--method", "full")
    assert r.exit_code == 0 and loads, r.output
    assert "gradient checkpointing on: full needs about" in r.output
    assert json.loads((tmp_path / "out" / "report.json").read_text())["load"]["gradient_checkpointing"] == "on"


def test_methods_memory_lists_every_method_on_a_model(folder):
    r = CliRunner().invoke(app, ["methods", "--memory", f"hf:{folder}", "--device", "cpu"])
    assert r.exit_code == 0, r.output
    assert "Estimated peak training memory" in r.output
    for name in ("lora", "full", "ewc-distill"):
        assert f"│ {name} " in r.output


HEAP_PROBE = """
import sys, torch
from forgetless.monitor import lean_heap, rss_mb
assert lean_heap() is None
torch.empty(4 << 20).fill_(1)  # 16 MiB freed: glibc's own heap raises its mmap threshold above that size
before = rss_mb()
big = torch.empty(4 << 20).fill_(1)  # 16 MiB
small = [torch.empty(1024).fill_(1) for _ in range(64)]  # blocks after it on the heap
del big
print(rss_mb() - before)
"""


@pytest.mark.skipif(__import__("platform").libc_ver()[0] != "glibc", reason="the lean heap sets glibc's heap")
def test_the_lean_heap_gives_a_freed_block_back_where_glibcs_default_keeps_it(monkeypatch):
    """adapt's heap on CPU (monitor.lean_heap): a freed 16 MiB tensor below live heap blocks leaves resident memory
    with the lean heap, and stays resident with glibc's default (the fragmentation that put adapt's peak 1.5x above
    its live tensors)."""
    import subprocess
    import sys
    kept = {}
    for name in [k for k in __import__("os").environ if k.startswith("MALLOC_")] + ["LD_PRELOAD"]:
        monkeypatch.delenv(name, raising=False)  # glibc's heap as it comes
    for heap in ("glibc", "lean"):
        monkeypatch.setenv("FORGETLESS_HEAP", heap)
        out = subprocess.run([sys.executable, "-c", HEAP_PROBE], capture_output=True, text=True, check=True)
        kept[heap] = float(out.stdout)
    assert kept["glibc"] > 12 and kept["lean"] < 4, kept  # MiB still resident after the free


def test_a_bad_heap_setting_is_refused_before_loading(folder, tmp_path, monkeypatch):
    monkeypatch.setenv("FORGETLESS_HEAP", "tcmalloc")
    r, loads = adapt(monkeypatch, tmp_path, folder, "--method", "lora")
    assert r.exit_code == 2 and not loads, r.output
    assert "$FORGETLESS_HEAP is 'tcmalloc'; set it to lean" in " ".join(r.output.split()), r.output


def test_live_peak_counts_no_view_or_in_place_result_of_a_tensor_made_before_it():
    weight = torch.randn(100, 100)
    with LivePeak() as live:
        weight.t()
        weight.view(-1)
        weight.add_(1)
        fresh = weight * 2  # a new storage: 40,000 bytes
    assert live.peak == fresh.untyped_storage().nbytes() == 40_000
