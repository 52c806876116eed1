"""What every protocol shares (docs/DESIGN.md §3): one shape, `Protocol.run(ctx, methods) -> RunResult`, over a
run context resolved once where the run starts (the device, with the precision and workers it can take), the
registry `bench --protocol` reads, the arms built from method specs, and the provenance of a results file.

    ctx = run_context(cfg, seeds=[0, 1], out=Path("runs/x"), preset="smoke")   # device "auto" resolved here
    results = PROTOCOLS["two-domain"].run(ctx, ["full", "lora"])               # results.json (§6), a RunResult
"""
from __future__ import annotations

import datetime
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from forgetless import __version__
from forgetless.config import code_fingerprint, git_commit
from forgetless.continual.workers import check_workers
from forgetless.errors import ForgetlessError
from forgetless.methods import MethodSpec, build_method
from forgetless.methods.base import as_specs
from forgetless.presets import RunConfig, resolve_run
from forgetless.report.results import RunResult


@dataclass(frozen=True)
class RunContext:
    """A run's settings, resolved and checked once: what each protocol runs over."""
    cfg: RunConfig
    seeds: list[int]
    out: Path                                         # the output folder: arms/ and results files
    preset: str
    model: str = "byte-gpt"                           # forgetless's own GPTs, or a pretrained model's spec
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    base_seeds: int = 1                               # forgetless bases pretrained per run (seed s: base s mod N)
    workers: int | None = 1                           # processes side by side (CPU); None: auto (plan.make_plan)
    precision: dict = field(default_factory=dict)     # results.json's record: {used, requested, why} (resolve_run)


def run_context(cfg: RunConfig, seeds: list[int], out: Path, preset: str, device: str | torch.device = "auto",
                model: str = "byte-gpt", base_seeds: int = 1, workers: int | None = 1, pretrains: bool = True) -> RunContext:
    """The context of a run, checked before any work: `device` resolved (auto: CUDA when there is one), a
    precision it lacks refused (the pretraining's too where the protocol `pretrains` bases), and `workers`."""
    device, cfg, precision = resolve_run(cfg, device)  # auto resolved; a device or precision it lacks refused
    if pretrains:
        check_workers(workers, device)
    return RunContext(cfg, list(seeds), Path(out), preset, model, device, base_seeds, workers, precision)


class Protocol:
    """A protocol: `run(ctx, methods)` runs every (method spec, seed) arm (saved under ctx.out/arms/ as it
    finishes, reused when its config matches) and returns its results (docs/DESIGN.md §6.3, report/results.py)."""
    name = ""
    pretrains = True  # pretrains forgetless bases on byte-gpt (else it runs on a pretrained model only)

    def run(self, ctx: RunContext, methods: list[MethodSpec | str]) -> RunResult:
        raise NotImplementedError

    def __call__(self, cfg: RunConfig, methods: list[MethodSpec | str], seeds: list[int], out: Path, preset: str,
                 device: str = "auto", model: str = "byte-gpt", base_seeds: int = 1, workers: int | None = 1) -> RunResult:
        """The protocol over a context made from these settings (the Python API: run_two_domain(cfg, ...))."""
        ctx = run_context(cfg, seeds, out, preset, device, model, base_seeds, workers, self.pretrains)
        return self.run(ctx, methods)


PROTOCOLS: dict[str, Protocol] = {}


def register_protocol(cls: type[Protocol]) -> type[Protocol]:
    """Class decorator: the protocol `cls.name` for `bench --protocol`."""
    PROTOCOLS[cls.name] = cls()
    return cls


def build_arms(cfg: RunConfig, methods: list[MethodSpec | str], sequence: bool = False) -> dict:
    """Label -> fresh Method for every spec in `methods` (validates cfg.methods too); joint arms (mtl,
    METHOD[joint=true]) only in a task sequence (`sequence`)."""
    for name, options in cfg.methods.items():  # fail fast on bad names and options
        build_method(name, options)
    built = {spec.label: spec.build(cfg.methods.get(spec.name)) for spec in as_specs(methods)}
    if not sequence:
        for label, method in built.items():
            refuse_joint(label, method, "run it with --protocol sequence, or drop it here")
    return built


def refuse_joint(label: str, method, fix: str):
    """A joint arm (mtl, METHOD[joint=true]) learns all tasks of a sequence at once: elsewhere it cannot act."""
    if method.cfg.joint:
        raise ForgetlessError(f"{label} learns all tasks of a sequence at once (joint), which acts only in the "
                              f"task-sequence protocol; {fix} (here it would be plain fine-tuning)")


def fresh(method):
    """A new instance of the same method and options (no state carried between arms)."""
    return build_method(method.name, method.options())


def load_pretrained(model: str, device, load=None) -> tuple | None:
    """(model, tokenizer) of a pretrained `model` spec loaded as `load` (a LoadConfig) says, or None for byte-gpt
    (forgetless pretrains its own)."""
    if model == "byte-gpt":
        return None
    from forgetless.models.hf import load_model
    return load_model(model, device, load)


def opening(ctx: RunContext, protocol: str, a, b) -> dict:
    """The keys a two-domain or online results file opens with (docs/DESIGN.md §6.3): the run, its provenance,
    and the domains `a`, `b` with their held-out works and fingerprints."""
    return {"protocol": protocol, "preset": ctx.preset, "seeds": list(ctx.seeds), "base_seeds": ctx.base_seeds,
            **provenance(ctx.device), "model": ctx.model, "precision": ctx.precision, "load": asdict(ctx.cfg.load),
            "domains": {"a": ctx.cfg.data.domain_a, "b": ctx.cfg.data.domain_b},
            "held_out": {"a": a.val_keys, "b": b.val_keys},
            "data_fingerprints": {"a": a.fingerprint, "b": b.fingerprint},
            "date": datetime.date.today().isoformat()}


def provenance(device) -> dict:
    """What made a results file: the package version, its code fingerprint and git commit (None outside a
    checkout), the Python and torch versions, the device."""
    return {"forgetless_version": __version__, "code": code_fingerprint(), "git_commit": git_commit(),
            "python": platform.python_version(), "torch": torch.__version__, "device": str(device)}
