"""Which device a run uses and in what precision: `--device` and `--precision` resolved here, once, where a command
starts (presets.resolve_run); the torch.device and the resolved precision are passed down."""
from __future__ import annotations

import os
import platform
from contextlib import contextmanager
from pathlib import Path

import torch

from forgetless import distributed
from forgetless.errors import ForgetlessError


def resolve_device(name: str | torch.device = "auto") -> torch.device:
    """auto (CUDA when available, else CPU), cpu, cuda[:N] or mps; an unavailable device is an error.
    Under torchrun, auto and cuda mean this process's GPU (cuda:LOCAL_RANK). A torch.device is resolved already:
    it is returned as it is (the API functions that take either resolve nothing twice)."""
    if isinstance(name, torch.device):
        return name
    if name in ("auto", "cuda") and distributed.world_size() > 1 and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    kind = name.split(":")[0]
    if kind not in ("cpu", "cuda", "mps"):
        raise ForgetlessError(f"unknown device {name!r}; valid: auto, cpu, cuda, cuda:N, mps")
    if kind == "cuda" and not torch.cuda.is_available() or kind == "mps" and not torch.backends.mps.is_available():
        raise ForgetlessError(f"device {name} is not available on this machine; use --device cpu (or auto)")
    return torch.device(name)


PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
EAGER_BYTES = 1 << 30  # the most attention weights eager attention may keep for a backward (eager_attention_bytes)


def autocast(device: torch.device, precision: str):
    """Autocast context for `precision` on `device` (a no-op for fp32; auto: `resolve_precision`)."""
    precision = resolve_precision(precision, device)[0]
    if precision == "fp16" and device.type != "cuda":
        raise ForgetlessError(f"precision fp16 needs a CUDA device, not {device.type}; use bf16 or fp32")
    return torch.autocast(device.type, dtype=PRECISIONS[precision], enabled=precision != "fp32")


@contextmanager
def training_attention(model, device: torch.device, precision: str, rows: torch.Tensor):
    """A training forward of `rows` (B, T) in bf16 on a CPU (`eager_training`), on a transformers model whose
    attention is SDPA and that switches it: eager attention while what it keeps for the backward stays under
    EAGER_BYTES, SDPA after. PyTorch's CPU flash attention is slow in bf16's backward: SmolLM2-135M LoRA steps on the
    real preset's dbpedia batches took 1.17-1.20x as long with SDPA as eagerly (benchmarks/bench_arm.py --attention
    32, docs/results/speed.md); fp32 steps and forwards without gradients were no faster eagerly (checks not kept).
    Not with gradient checkpointing (its backward reruns the forward, after this context) nor on a model with
    sub-models (each has its own attention setting)."""
    config = getattr(model, "config", None)
    heads, layers = getattr(config, "num_attention_heads", None), getattr(config, "num_hidden_layers", None)
    swap = (eager_training(device, precision) and model.training and torch.is_grad_enabled() and heads and layers
            and getattr(config, "_attn_implementation", None) == "sdpa" and not getattr(config, "sub_configs", None)
            and eager_attention_bytes(*rows.shape, heads, layers) <= EAGER_BYTES
            and getattr(model, "_can_set_attn_implementation", lambda: False)()
            and not checkpointed(model))
    if swap:
        model.set_attn_implementation("eager")
    try:
        yield
    finally:
        if swap:
            model.set_attn_implementation("sdpa")


def checkpointed(model: torch.nn.Module) -> bool:
    """Whether some module of `model` runs under gradient checkpointing (transformers' flag): its backward reruns
    the forward."""
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


def eager_training(device: torch.device, precision: str) -> bool:
    """Whether training on `device` in `precision` runs short rows' attention eagerly (`training_attention`): bf16
    on a CPU (measured where the CPU has AVX-512 BF16; where bf16 is emulated, not measured)."""
    return device.type == "cpu" and resolve_precision(precision, device)[0] == "bf16"


def eager_attention_bytes(rows: int, tokens: int, heads: int, layers: int) -> int:
    """What eager attention keeps for the backward: per query head and (query, key) pair of every layer, the fp32
    softmax and its bf16 copy (6 bytes; 9 with attention dropout) and room for the keys and values it repeats per
    head: 8 bytes."""
    return rows * heads * tokens ** 2 * 8 * layers


def resolve_precision(precision: str, device: torch.device) -> tuple[str, str]:
    """(the precision `precision` means on `device`, why). auto: bf16 where the hardware runs it natively (a CUDA
    device with bf16, a CPU with AMX or AVX-512 BF16), else fp32 (elsewhere bf16 is emulated: many times slower)."""
    if precision != "auto":
        return precision, "asked for"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return ("bf16", f"auto: {name} runs bf16 natively") if torch.cuda.is_bf16_supported() else \
            ("fp32", f"auto: {name} has no bf16")
    if device.type == "cpu":
        native = cpu_bf16()
        return ("bf16", f"auto: the CPU has {native}") if native else \
            ("fp32", "auto: the CPU has no native bf16 (AVX-512 BF16 or AMX), where bf16 is emulated and many times slower")
    return "fp32", f"auto: fp32 on {device.type}"


def emulated_bf16(precision: str, device: torch.device) -> bool:
    """True when bf16 would run on a CPU without native bf16 (emulated: many times slower than fp32 there)."""
    return precision == "bf16" and device.type == "cpu" and cpu_bf16() is None


CPU_BF16 = (("AMX", "_is_amx_tile_supported", "amx_bf16"), ("AVX-512 BF16", "_is_avx512_bf16_supported", "avx512_bf16"))
# (name, torch.cpu probe, /proc/cpuinfo flag) of the instruction sets that run bf16 matrix products natively


def cpu_bf16() -> str | None:
    """The instruction set this CPU runs bf16 matrix products with (AMX, AVX-512 BF16), or None: torch's probes,
    else the flags of /proc/cpuinfo."""
    for name, probe, flag in CPU_BF16:
        try:
            found = getattr(torch.cpu, probe)()
        except (AttributeError, RuntimeError):  # a torch without the probe
            found = flag in cpu_flags()
        if found:
            return name
    return None


def cpu_flags() -> set[str]:
    """The CPU's feature flags in /proc/cpuinfo (none where it does not exist)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return set()
    return {flag for line in lines if line.startswith("flags") for flag in line.partition(":")[2].split()}


def machine_text() -> str:
    """This machine in one line, for a result's provenance: CPU model, cores, how it runs bf16, OS."""
    try:
        names = [line.partition(":")[2].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")]
    except OSError:
        names = []
    cpu = names[0] if names else platform.processor() or platform.machine()
    bf16 = cpu_bf16() or "emulated (no AVX-512 BF16 or AMX)"
    return f"{cpu} ({platform.machine()}), {os.cpu_count()} cores, bf16 {bf16}, {platform.system()}"
