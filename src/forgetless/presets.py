"""Run configuration (all sections) and the named presets: smoke, first, quick, paper, real, real-full."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from forgetless.config import from_dict, replace
from forgetless.data.tokenizers import TOKENIZERS
from forgetless.device import autocast, emulated_bf16, resolve_device, resolve_precision
from forgetless.errors import ForgetlessError
from forgetless.models.gpt import GPTConfig
from forgetless.models.hf import LoadConfig
from forgetless.progress import console
from forgetless.train import PretrainConfig, TrainConfig


R_CELLS = ("all", "metrics")  # data.r_cells: which R cells an instruction arm scores after each task
DEFAULT_TASKS = ("shakespeare-folio", "shakespeare-poems", "renamed:shakespeare-modern", "python-stdlib")


@dataclass
class DataConfig:
    domain_a: str = field(default="shakespeare-modern", metadata={"help": "corpus the base is pretrained on (domain A)"})
    domain_b: str = field(default="shakespeare-folio", metadata={"help": "corpus adapted to (domain B)"})
    tasks: list[str] = field(default_factory=lambda: list(DEFAULT_TASKS), metadata={
        "help": "sequence protocol: corpora trained after the base, in order"})
    tokenizer: str = field(default="bytes", metadata={"help": "bytes (vocabulary 256) or chars (built from A and B)"})
    val_fraction: float = field(default=0.1, metadata={"help": "held-out share of each corpus (whole plays where it has them)"})
    dev_fraction: float = field(default=0.1, metadata={
        "help": "validation share of each corpus, carved from its training works: every choice (lr, knobs) is made on it"})
    eval_windows: int = field(default=128, metadata={"help": "fixed held-out windows per domain for PPL and accuracy"})
    general: str = field(default="pydoc-topics", metadata={
        "help": "instruction tasks: the corpus whose held-out windows measure general ability (task 0)"})
    held_out_tasks: list[str] = field(default_factory=list, metadata={
        "help": "instruction tasks: tasks never trained on, scored after every task (general ability)"})
    train_examples: int = field(default=0, metadata={"help": "instruction tasks: training examples per task (0: all)"})
    test_rows: int = field(default=0, metadata={"help": "instruction tasks: test rows scored per task (0: all)"})
    dev_rows: int = field(default=0, metadata={
        "help": "instruction tasks: validation rows per task, the last ones of its training file (never trained on), "
                "scored after every task for choices (lr, knobs): the *_dev metrics; 0: none"})
    r_cells: str = field(default="all", metadata={
        "help": "instruction tasks: the R cells scored after each task: all (every task, held-out task and general "
                "text) or metrics (after task t < T task t alone: the cells OP, BWT, LA and the general-PPL change "
                "use; forgetting and FWT are then undefined)"})
    mix_from: str = field(default="earlier", metadata={
        "help": "sequence protocol: where mixed-in rows come from: earlier (the tasks before; on a corpus "
                "sequence from task 0, the base's domain, on) or one task, e.g. Lima or a corpus of the sequence"})

    def __post_init__(self):
        if self.tokenizer not in TOKENIZERS:
            raise ForgetlessError(f"unknown tokenizer {self.tokenizer!r}; valid: {', '.join(TOKENIZERS)}")
        if self.eval_windows <= 0:
            raise ForgetlessError(f"data.eval_windows must be positive, got {self.eval_windows}")
        if self.train_examples < 0 or self.test_rows < 0 or self.dev_rows < 0:
            raise ForgetlessError("data.train_examples, data.test_rows and data.dev_rows must not be negative (0: all/none)")
        if self.r_cells not in R_CELLS:
            raise ForgetlessError(f"unknown data.r_cells {self.r_cells!r}; valid: {', '.join(R_CELLS)}")


@dataclass
class AdaptConfig(TrainConfig):
    mix: float = field(default=0.0, metadata={
        "help": "fraction of every adaptation batch drawn from the original domain (data mixing / replay), "
                "for every method without its own `mix`; also --mix"})
    group_by_length: int = field(default=0, metadata={
        "help": "instruction rows: draw this many batches at once and regroup their rows by length, so a batch pads "
                "less (like transformers' group_by_length): the same rows, each batch with its drawn count of mixed-in "
                "rows; 0: off"})
    aliases: ClassVar[dict] = {"replay": "mix"}  # the knob's earlier name, still read from files and flags

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 <= self.mix <= 1.0:
            raise ForgetlessError(f"adapt.mix must be in [0, 1], got {self.mix}")
        if self.group_by_length < 0:
            raise ForgetlessError(f"adapt.group_by_length must not be negative (0: off), got {self.group_by_length}")


@dataclass
class OnlineConfig:
    chunks: int = field(default=48, metadata={"help": "online protocol: chunks in the stream"})
    chunk_tokens: int = field(default=2048, metadata={
        "help": "online protocol: tokens per chunk, cut into context-length windows"})
    steps_per_chunk: int = field(default=1, metadata={
        "help": "online protocol: updates of the method on each chunk, after the chunk is scored"})
    canary_every: int = field(default=8, metadata={
        "help": "online protocol: score the canary (held-out windows of domain A) every N chunks"})
    canary_windows: int = field(default=32, metadata={
        "help": "online protocol: held-out windows of A in the canary (0: all of data.eval_windows)"})
    switch: float = field(default=0.5, metadata={
        "help": "online protocol: share of the stream's chunks from A's validation text before it switches to B's "
                "training text (0: B only, 1: A only)"})

    def __post_init__(self):
        for name in ("chunks", "chunk_tokens", "steps_per_chunk", "canary_every"):
            if getattr(self, name) <= 0:
                raise ForgetlessError(f"online.{name} must be positive, got {getattr(self, name)}")
        if self.canary_windows < 0 or not 0.0 <= self.switch <= 1.0:
            raise ForgetlessError("online.canary_windows must not be negative and online.switch must be in [0, 1]")


@dataclass
class RunConfig:
    model: GPTConfig
    pretrain: PretrainConfig
    adapt: AdaptConfig
    data: DataConfig
    methods: dict = field(default_factory=dict)  # method name -> its options
    online: OnlineConfig = field(default_factory=OnlineConfig)
    load: LoadConfig = field(default_factory=LoadConfig)  # how a pretrained --model is loaded

    def to_dict(self) -> dict:
        """Every section but `online`, which the online protocol records itself, and `load` where it is the default
        (float32, not quantized: so saved arms keep their config hashes)."""
        out = dataclasses.asdict(self)
        del out["online"]
        if self.load == LoadConfig():
            del out["load"]
        return out


def resolve_run(cfg: RunConfig, device: str | torch.device = "auto") -> tuple[torch.device, RunConfig, dict]:
    """Where and in what precision a run trains, resolved once where it starts: (the torch.device `device` names
    (device.resolve_device), the run's config with its precisions resolved there (auto: device.resolve_precision),
    results.json's `precision` record: {used, requested, why} of the arms' training and scoring). A device or a
    precision the machine lacks is refused before any work; one line says what auto chose, one warns of emulated
    bf16."""
    device = resolve_device(device)
    sections, record = {}, {}
    for name in ("pretrain", "adapt"):
        section = getattr(cfg, name)
        used, why = resolve_precision(section.precision, device)
        autocast(device, used)  # fp16 off CUDA: a one-line error now
        sections[name] = dataclasses.replace(section, precision=used)
        record = {"used": used, "requested": section.precision, "why": why}  # the adapt section's, last
    if record["requested"] == "auto":
        console.print(f"precision {record['used']} ({record['why']})", highlight=False, soft_wrap=True)
    if emulated_bf16(record["used"], device) or emulated_bf16(sections["pretrain"].precision, device):
        console.print("[bold yellow]warning:[/bold yellow] bf16 on this CPU is emulated (no AVX-512 BF16 or AMX) and "
                      "many times slower than fp32 (a SmolLM2 LoRA step ~25x on an AVX2 EPYC); use --precision fp32 "
                      "or auto", highlight=False, soft_wrap=True)
    return device, dataclasses.replace(cfg, **sections), record


SECTIONS = {"model": GPTConfig, "pretrain": PretrainConfig, "adapt": AdaptConfig, "data": DataConfig,
            "online": OnlineConfig, "load": LoadConfig}
BENCH_ONLY = ("online",)  # sections only a bench protocol reads (the online protocol's): not adapt's, study's

PRESETS: dict[str, dict] = {
    "smoke": dict(
        model=dict(n_layer=2, n_head=2, d_model=32, block_size=32),
        pretrain=dict(steps=30, batch_size=8, lr=3e-3, warmup=5, eval_every=15, ckpt_every=10),
        adapt=dict(steps=10, batch_size=8, lr=1e-3, warmup=2, eval_every=5, ckpt_every=5),
        data=dict(eval_windows=8),
        online=dict(chunks=6, chunk_tokens=256, canary_every=2, canary_windows=8)),
    "first": dict(  # `forgetless bench` with no arguments, about 5 min cold on 2 CPU cores: quick's model, a third of its
        # pretraining, half its adaptation steps at half the batch, half its held-out windows
        # (docs/results/first-run.md)
        model=dict(n_layer=4, n_head=4, d_model=128, block_size=128),
        pretrain=dict(steps=400, batch_size=32, lr=2e-3, warmup=40, eval_every=150, ckpt_every=100),
        adapt=dict(steps=100, batch_size=8, lr=3e-4, warmup=5, eval_every=25, ckpt_every=50),
        data=dict(eval_windows=64)),
    "quick": dict(
        model=dict(n_layer=4, n_head=4, d_model=128, block_size=128),
        pretrain=dict(steps=1200, batch_size=32, lr=2e-3, warmup=100, eval_every=200, ckpt_every=100),
        adapt=dict(steps=200, batch_size=16, lr=3e-4, warmup=10, eval_every=20, ckpt_every=50),
        data=dict(eval_windows=128)),
    "paper": dict(  # the APN source's setting (6L/6H/384d); for GPUs
        model=dict(n_layer=6, n_head=6, d_model=384, block_size=256, dropout=0.2),
        pretrain=dict(steps=5000, batch_size=64, lr=1e-3, warmup=200, eval_every=250, ckpt_every=250),
        adapt=dict(steps=500, batch_size=32, lr=1e-4, warmup=20, eval_every=25, ckpt_every=100),
        data=dict(eval_windows=256)),
    # pretrained models (--model smollm2-135m, hf:PATH, a .gguf): the instruction stream of the MoRAM /
    # O-LoRA papers; `model` only sets the context (tokens), `pretrain` is unused; `pretrained`: every method
    # starts from its options on a pretrained model (pretrained_options); precision auto: bf16 where the hardware
    # runs it natively (device.resolve_precision), else fp32
    "real": dict(  # minutes per task on a CPU
        model=dict(block_size=256),
        adapt=dict(steps=32, batch_size=8, lr=5e-4, warmup=3, eval_every=1000, ckpt_every=8, precision="auto"),
        data=dict(domain_a="pydoc-topics", domain_b="python-stdlib", tasks=["dbpedia", "amazon", "yahoo", "agnews"],
                  held_out_tasks=["FOMC"], train_examples=256, test_rows=50, eval_windows=32),
        pretrained=True),
    "real-full": dict(  # every example, more test rows: for GPUs
        model=dict(block_size=512),
        adapt=dict(steps=63, batch_size=8, lr=5e-4, warmup=5, eval_every=1000, ckpt_every=16, precision="auto"),
        data=dict(domain_a="pydoc-topics", domain_b="python-stdlib", tasks=["dbpedia", "amazon", "yahoo", "agnews"],
                  held_out_tasks=["FOMC", "ScienceQA"], train_examples=500, test_rows=0, eval_windows=128),
        pretrained=True),
}



def default_preset(model: str) -> str:
    """`forgetless bench`'s preset when none is given: minutes on a CPU for the byte GPT or a pretrained model."""
    return "first" if model == "byte-gpt" else "real"


def pretrained_options() -> dict:
    """Method name -> its options on a pretrained model, for every registered method that has some
    (Method.pretrained_options: the fine-tuning lr for methods that train the model's own weights, ...)."""
    from forgetless.methods import METHODS, method_names
    return {name: options for name in method_names() if (options := METHODS[name].pretrained_options())}


def build_config(preset: str, overrides: dict | None = None) -> RunConfig:
    """The preset's config with `overrides` ({section: {key: value}}) applied and validated."""
    if preset not in PRESETS:
        raise ForgetlessError(f"unknown preset {preset!r}; valid: {', '.join(PRESETS)}")
    overrides = overrides or {}
    unknown = sorted(set(overrides) - set(SECTIONS) - {"methods"})
    if unknown:
        raise ForgetlessError(f"unknown config section {unknown[0]!r}; valid: {', '.join(SECTIONS)}, methods")
    parts = {}
    for name, cls in SECTIONS.items():
        base = from_dict(cls, PRESETS[preset].get(name, {}), name)
        parts[name] = replace(base, overrides.get(name) or {}, name)
    methods = overrides.get("methods") or {}
    if not isinstance(methods, dict):
        raise ForgetlessError("config section 'methods' must map method names to their options")
    preset_methods = pretrained_options() if PRESETS[preset].get("pretrained") else {}  # given options win
    methods = {name: {**preset_methods.get(name, {}), **(methods.get(name) or {})}
               for name in [*preset_methods, *[n for n in methods if n not in preset_methods]]}
    return RunConfig(methods=methods, **parts)
