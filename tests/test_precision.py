"""--precision auto: bf16 where the hardware runs it natively (CUDA with bf16, a CPU with AVX-512 BF16 or AMX),
fp32 elsewhere; resolved once per run, said in one line, recorded in results.json, and used for scoring as
for training. The detectors are monkeypatched: these tests do not depend on the machine they run on."""
import pytest
import torch

import forgetless.device as devices
from forgetless import train
from forgetless.continual import evaluate as evaluate_module
from forgetless.continual.instruct import run_on
from forgetless.continual.learner import Learner
from forgetless.continual.two_domain import run_two_domain
from forgetless.errors import ForgetlessError
from forgetless.methods import build_method
from forgetless.presets import PRESETS, AdaptConfig, build_config, resolve_run
from tiny_lm import tiny_llama, tiny_tokenizer
from transformers import PreTrainedModel

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.fixture
def cpu_probes(monkeypatch):
    """Set what torch's CPU probes answer: cpu_probes(avx512_bf16=..., amx=...)."""
    def set_probes(avx512_bf16: bool = False, amx: bool = False):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    return set_probes


def test_auto_is_bf16_on_a_cuda_device_with_bf16_else_fp32(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Test GPU")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    used, why = devices.resolve_precision("auto", CUDA)
    assert used == "bf16" and "Test GPU" in why
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert devices.resolve_precision("auto", CUDA) == ("fp32", "auto: Test GPU has no bf16")


def test_auto_on_a_cpu_follows_its_bf16_instructions(cpu_probes):
    cpu_probes(avx512_bf16=True)
    assert devices.resolve_precision("auto", CPU) == ("bf16", "auto: the CPU has AVX-512 BF16")
    cpu_probes(amx=True)
    assert devices.resolve_precision("auto", CPU) == ("bf16", "auto: the CPU has AMX")
    cpu_probes()
    used, why = devices.resolve_precision("auto", CPU)
    assert used == "fp32" and "no native bf16" in why
    assert devices.resolve_precision("auto", torch.device("mps"))[0] == "fp32"


def test_without_torchs_probes_the_cpu_flags_decide(monkeypatch):
    for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        monkeypatch.delattr(torch.cpu, probe)
    monkeypatch.setattr(devices, "cpu_flags", lambda: {"avx2", "avx512f", "avx512_bf16"})
    assert devices.resolve_precision("auto", CPU) == ("bf16", "auto: the CPU has AVX-512 BF16")
    monkeypatch.setattr(devices, "cpu_flags", lambda: {"avx2", "amx_tile", "amx_bf16"})
    assert devices.resolve_precision("auto", CPU)[1] == "auto: the CPU has AMX"
    monkeypatch.setattr(devices, "cpu_flags", lambda: {"avx2", "fma"})
    assert devices.resolve_precision("auto", CPU)[0] == "fp32"


def test_an_explicit_precision_is_kept_and_auto_runs_in_autocast(cpu_probes):
    cpu_probes()
    for precision in ("fp32", "bf16", "fp16"):
        assert devices.resolve_precision(precision, CPU) == (precision, "asked for")
    with devices.autocast(CPU, "auto"):
        assert not torch.is_autocast_enabled("cpu")
    cpu_probes(avx512_bf16=True)
    with devices.autocast(CPU, "auto"):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    with pytest.raises(ForgetlessError, match="unknown precision 'bf32'; valid: auto, fp32"):
        train.TrainConfig(precision="bf32")


def test_a_run_resolves_its_device_and_auto_once_and_says_why(cpu_probes, capsys):
    cpu_probes()
    device, cfg, record = resolve_run(build_config("real"), "cpu")  # the device and the precisions, in one call
    assert device == CPU and (cfg.adapt.precision, cfg.pretrain.precision) == ("fp32", "fp32")
    assert record["used"] == "fp32" and record["requested"] == "auto" and "no native bf16" in record["why"]
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("precision fp32 (auto: the CPU has no native bf16")
    cpu_probes(avx512_bf16=True)
    _, cfg, record = resolve_run(build_config("real"), CPU)
    assert cfg.adapt.precision == "bf16" and record["why"] == "auto: the CPU has AVX-512 BF16"
    assert capsys.readouterr().err == "precision bf16 (auto: the CPU has AVX-512 BF16)\n"


def test_bf16_asked_for_on_a_cpu_without_it_warns_in_one_line(cpu_probes, capsys):
    cpu_probes()
    _, cfg, record = resolve_run(build_config("smoke", {"adapt": {"precision": "bf16"}}), CPU)
    assert cfg.adapt.precision == "bf16" and record == {"used": "bf16", "requested": "bf16", "why": "asked for"}
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "warning:" in err and "emulated" in err and "use --precision fp32 or auto" in err
    cpu_probes(avx512_bf16=True)
    resolve_run(build_config("smoke", {"adapt": {"precision": "bf16"}}), CPU)
    resolve_run(build_config("smoke"), CPU)  # fp32 asked for: nothing to say
    assert capsys.readouterr().err == ""
    with pytest.raises(ForgetlessError, match="fp16 needs a CUDA device"):
        resolve_run(build_config("smoke", {"adapt": {"precision": "fp16"}}), CPU)


def test_auto_is_the_default_for_pretrained_models_and_fp32_for_the_byte_gpt():
    for preset in PRESETS:
        expected = "auto" if preset.startswith("real") else "fp32"
        assert build_config(preset).adapt.precision == expected, preset
        assert build_config(preset).pretrain.precision == "fp32", preset


def autocast_states(monkeypatch) -> list:
    """Every forward through evaluate/training_loss's `logits_of` records the CPU autocast dtype (None: off)."""
    states, logits_of = [], evaluate_module.logits_of

    def spy(model, *args, **kwargs):
        states.append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None)
        return logits_of(model, *args, **kwargs)
    monkeypatch.setattr(evaluate_module, "logits_of", spy)
    return states


@pytest.mark.parametrize("precision", ["fp32", "auto"])
def test_two_domain_trains_and_scores_in_the_resolved_precision(precision, cpu_probes, monkeypatch, text_file,
                                                                tmp_path, one_thread):
    cpu_probes(avx512_bf16=True)  # auto -> bf16 (emulated here: a tiny model, seconds)
    states = autocast_states(monkeypatch)
    cfg = build_config("smoke", {"data": {"domain_a": str(text_file), "domain_b": f"renamed:{text_file}",
                                          "eval_windows": 2},
                                 "pretrain": {"steps": 2}, "adapt": {"steps": 2, "precision": precision}})
    results = run_two_domain(cfg, ["lora"], [0], tmp_path, "smoke", device="cpu")
    used = "fp32" if precision == "fp32" else "bf16"
    assert results["precision"]["used"] == results["config"]["adapt"]["precision"] == used
    assert results["precision"]["requested"] == precision
    if used == "fp32":
        assert set(states) == {None}
    else:  # the plan's timing and the base's pretraining in fp32, then every forward of the arms in bf16
        first = states.index(torch.bfloat16)
        assert set(states[:first]) == {None} and set(states[first:]) == {torch.bfloat16}, states
        assert len(states) - first > 2 * cfg.adapt.steps  # scoring before, during and after, not training alone


def test_instruction_scores_run_under_the_training_precision(cpu_probes, tmp_path, one_thread):
    cpu_probes(avx512_bf16=True)
    tok = tiny_tokenizer()
    lm = tiny_llama(tok.vocab_size)
    states = []
    lm.register_forward_pre_hook(lambda module, args: states.append(torch.is_autocast_enabled("cpu")))
    cfg = build_config("real", {"data": {"tasks": ["dbpedia"], "train_examples": 8, "test_rows": 4, "eval_windows": 2},
                                "adapt": {"steps": 2, "batch_size": 4, "ckpt_every": 2}})
    results = run_on(lm, tok, cfg, ["lora"], [0], tmp_path, "real", "tiny-llama")
    assert results["precision"] == {"used": "bf16", "requested": "auto", "why": "auto: the CPU has AVX-512 BF16"}
    assert results["config"]["adapt"]["precision"] == "bf16"
    assert states and all(states), f"{states.count(False)} of {len(states)} forwards ran without bf16 autocast"


def attention_seen(model) -> list:
    """(attention implementation, gradients on) at every forward of `model`."""
    seen = []
    model.register_forward_pre_hook(lambda module, args: seen.append(
        (module.config._attn_implementation, torch.is_grad_enabled())))
    return seen


switches_attention = pytest.mark.skipif(not hasattr(PreTrainedModel, "set_attn_implementation"),
                                        reason="this transformers cannot switch a model's attention")


@switches_attention
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_bf16_training_on_a_cpu_runs_attention_eagerly_and_scoring_keeps_sdpa(precision, tmp_path, one_thread):
    tok = tiny_tokenizer()
    lm = tiny_llama(tok.vocab_size)
    seen = attention_seen(lm)
    cfg = build_config("real", {"data": {"tasks": ["dbpedia"], "train_examples": 8, "test_rows": 4, "eval_windows": 2},
                                "adapt": {"steps": 2, "batch_size": 4, "precision": precision}})
    run_on(lm, tok, cfg, ["lora"], [0], tmp_path, "real", "tiny-llama")
    training = {impl for impl, grad in seen if grad}
    assert training == ({"eager"} if precision == "bf16" else {"sdpa"}), seen
    assert {impl for impl, grad in seen if not grad} == {"sdpa"}  # scoring: no backward, SDPA is as fast there
    assert lm.config._attn_implementation == "sdpa"


@switches_attention
def test_eager_attention_only_where_it_helps_within_its_budget_and_sdpa_back_after_an_error(monkeypatch):
    lm = tiny_llama(64).train()
    rows = torch.zeros(4, 32, dtype=torch.long)

    def inside(precision="bf16", limit=1 << 30):
        monkeypatch.setattr(devices, "EAGER_BYTES", limit)
        with devices.training_attention(lm, CPU, precision, rows):
            return lm.config._attn_implementation
    assert inside() == "eager" and lm.config._attn_implementation == "sdpa"
    assert devices.eager_attention_bytes(4, 32, 2, 2) == 4 * 2 * 32 * 32 * 8 * 2  # the tiny Llama: 2 heads, 2 layers
    assert inside(limit=devices.eager_attention_bytes(4, 32, 2, 2)) == "eager"
    assert inside(limit=devices.eager_attention_bytes(4, 32, 2, 2) - 1) == "sdpa"
    assert inside("fp32") == "sdpa"
    with torch.no_grad():
        assert inside() == "sdpa"  # no backward: nothing to gain
    lm.eval()
    assert inside() == "sdpa"
    lm.train()
    lm.gradient_checkpointing_enable()  # its backward reruns the forward after the context: it would differ
    assert inside() == "sdpa"
    lm.gradient_checkpointing_disable()
    with pytest.raises(RuntimeError), devices.training_attention(lm, CPU, "bf16", rows):
        assert lm.config._attn_implementation == "eager"
        raise RuntimeError("a failed step")
    assert lm.config._attn_implementation == "sdpa"
    lm.set_attn_implementation("eager")  # a model set to eager stays so
    assert inside() == "eager" and lm.config._attn_implementation == "eager"


@switches_attention
def test_the_online_learner_trains_bf16_on_a_cpu_with_eager_attention():
    lm = tiny_llama(64)
    seen = attention_seen(lm)
    learner = Learner(lm, build_method("lora", {}), AdaptConfig(precision="bf16", warmup=0))
    learner.learn(torch.randint(3, 64, (2, 17)), 1)  # windows (W, T + 1)
    assert [impl for impl, grad in seen if grad] == ["eager"] and lm.config._attn_implementation == "sdpa"
