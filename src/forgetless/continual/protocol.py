"""What every protocol shares (docs/DESIGN.md §3): one shape, `Protocol.run(ctx, methods) -> RunResult`, over a
run context resolved once where the run starts (the device, with the precision and workers it can take), the
registry `bench --protocol` reads, the arms built from method specs, and the provenance of a results file.

A protocol declares itself as a method does (§1.3): its name, the bench options it reads (`options`), what it
refuses (`check`), its default arms, the keys of its results (`result_keys`, `method_keys`) and the report that
writes them (`report`: files and terminal rows, report/kinds.py); `bench` and `report` look it up by name
(`choose`) or by results file (`Report`).

    ctx = run_context(cfg, seeds=[0, 1], out=Path("runs/x"), preset="smoke")   # device "auto" resolved here
    results = PROTOCOLS["two-domain"].run(ctx, ["full", "lora"])               # results.json (§6), a RunResult
"""
from __future__ import annotations

import datetime
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import ClassVar

import torch

from forgetless import __version__
from forgetless.config import code_fingerprint, git_commit
from forgetless.continual.workers import check_workers
from forgetless.errors import ForgetlessError
from forgetless.methods import MethodSpec, build_method
from forgetless.methods.base import as_specs, method_names, parse_method_specs, sweep_specs
from forgetless.presets import RunConfig, resolve_run
from forgetless.report.kinds import Report
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


@dataclass(frozen=True)
class Request:
    """What `forgetless bench` was asked, before a protocol is chosen: the settings protocols read and refuse."""
    protocol: str                       # --protocol as given
    cfg: RunConfig
    preset: str
    model: str = "byte-gpt"
    methods: str = "default"            # --methods: spec text, all or default
    base_seeds: int = 1
    workers: int | None = 1
    sweep: tuple[str, ...] = ()         # --sweep entries
    lrs: str | None = None              # --lrs
    optimizers: str | None = None       # --optimizers (the optimizers protocol's)
    pretrain_seeds: int = 1             # --pretrain-seeds (the optimizers protocol's)


OWNED = {"optimizers": "--optimizers", "pretrain_seeds": "--pretrain-seeds"}  # Request fields one protocol reads


class Protocol:
    """A protocol: `run(ctx, methods)` runs every (method spec, seed) arm (saved under ctx.out/arms/ as it
    finishes, reused when its config matches) and returns its results (docs/DESIGN.md §6.3, report/results.py).
    The class declares the rest: how bench picks it, what it refuses, its arms, its results' keys and report."""
    name = ""
    pretrains = True  # pretrains forgetless bases on byte-gpt (else it runs on a pretrained model only)
    report: Report    # writes its results (report/kinds.py: files, terminal tables, frontier)
    refines = ""      # a protocol it runs in place of, for the requests it `takes` (e.g. sequence's instruction tasks)
    options: tuple[str, ...] = ()              # the OWNED Request fields it reads
    instruction_rows = False                   # trains on instruction rows of many lengths (else equal windows)
    method_set = ""                            # whose set `--methods all` runs (Method.default_for; "": its name)
    default_methods: ClassVar[dict[str, str]] = {}  # preset ("*": any) -> what `--methods default` runs (else `all`)
    result_keys: tuple[str, ...] = ()          # top-level keys of its results.json beyond every protocol's (§6.3)
    method_keys: tuple[str, ...] = ()          # stats in every method entry of its results (§6.3)

    def run(self, ctx: RunContext, methods: list[MethodSpec | str]) -> RunResult:
        raise NotImplementedError

    def takes(self, request: Request) -> bool:
        """Whether it runs in place of `refines` for this request."""
        return False

    def check(self, request: Request):
        """One-line refusals of a request it cannot run, before any work."""
        if request.base_seeds < 1 or request.base_seeds > 1 and request.model != "byte-gpt":
            raise ForgetlessError(f"--base-seeds {request.base_seeds}: give N >= 1 bases to pretrain; a pretrained "
                                  "--model has one base (its variance is not sampled)")

    def config_defaults(self, tasks: list[str]) -> dict:
        """{section: {key: value}} it sets over the preset's (a config file and flags still win)."""
        return {}

    def prepared(self, request: Request) -> Protocol:
        """The protocol set up with its options from the request (itself where it has none)."""
        return self

    def arms(self, request: Request) -> list:
        """The arms of `--methods` (default: this preset's list, else all; all: its method set) with sweeps."""
        defaults = self.default_methods
        text = defaults.get(request.preset, defaults.get("*", "all")) if request.methods == "default" else request.methods
        every = method_names(self.method_set or self.name)
        specs = [MethodSpec(n) for n in every] if text == "all" else parse_method_specs(text)
        return sweep_specs(specs, list(request.sweep), request.lrs)

    def folder(self, request: Request) -> str:
        """The default --out folder's name before the preset (runs/<this>-<preset>)."""
        return request.protocol

    def configuration(self, request: Request, arms: list) -> dict:
        """What run.json keeps of a run (a folder of another configuration is refused without --force)."""
        return {"protocol": request.protocol, "preset": request.preset, "model": request.model,
                "methods": sorted(spec.label for spec in arms), "base_seeds": request.base_seeds,
                "config": request.cfg.to_dict(), "online": None}

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


def choose(registry: dict[str, Protocol], request: Request) -> Protocol:
    """The protocol that runs `request`: --protocol's, or one that `refines` it and `takes` the request; set up
    with its options, after its refusals and those of options no other protocol reads."""
    if request.protocol not in registry:
        raise ForgetlessError(f"unknown protocol {request.protocol!r}; valid: {', '.join(registry)}")
    chosen = next((p for p in registry.values() if p.refines == request.protocol and p.takes(request)),
                  registry[request.protocol])
    for field_name, flag in OWNED.items():
        if getattr(request, field_name) != getattr(Request, field_name) and field_name not in chosen.options:
            owner = next(p for p in registry.values() if field_name in p.options)
            raise ForgetlessError(f"{flag} runs the {owner.refines or owner.name} protocol ({owner.name}); give "
                                  f"--protocol {owner.refines or owner.name}, or drop {flag}")
    if request.cfg.adapt.group_by_length > 1 and not chosen.instruction_rows:
        raise ForgetlessError(f"adapt.group_by_length acts on instruction rows only; the {chosen.name} protocol trains "
                              "on windows of one length: drop it, or give instruction --tasks")
    chosen.check(request)
    return chosen.prepared(request)


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
