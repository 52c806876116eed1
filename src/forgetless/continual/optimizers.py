"""The optimizer comparison (`forgetless bench --optimizers adamw,muon,delta,deep`):

1. pretraining: a base on domain A per (optimizer, pretraining seed), cached like every base; its
   training-loss and held-out PPL_A curves are compared (results.json `pretraining`);
2. adaptation: the two-domain protocol with one arm per (method, optimizer), all from the default
   base (pretrained with `pretrain.optimizer`), so only the adaptation optimizer differs. The arm
   with the protocol's own optimizer keeps the plain method name; the others are METHOD[optimizer=O]
   (and METHOD[...;lr=LR] for each learning rate of `--lrs` other than the method's own). With
   `base_seeds` N > 1, arm seed s starts from the default optimizer's base of pretraining seed s mod N.
"""
from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass, field

from forgetless.continual.base_model import base_path, cached_base, load_base
from forgetless.continual.protocol import Protocol, Request, RunContext, register_protocol
from forgetless.continual.two_domain import TwoDomain
from forgetless.continual.workers import run_jobs
from forgetless.data.domains import load_domains
from forgetless.errors import ForgetlessError
from forgetless.methods import MethodSpec, build_method
from forgetless.optim import OPTIMIZERS
from forgetless.presets import RunConfig
from forgetless.progress import progress_task
from forgetless.report import TWO_DOMAIN
from forgetless.report.results import RunResult
from forgetless.stats import band, mean_std


@register_protocol
@dataclass
class Optimizers(Protocol):
    """The two-domain protocol with every method adapted by each optimizer (at each of `lrs`, if given: the
    optimizers compared along their retention/adaptation trade-off rather than at one lr), plus each
    optimizer's pretraining curves over `pretrain_seeds` bases (`bench --optimizers`)."""
    optimizers: list[str] = field(default_factory=list)
    pretrain_seeds: int = 1
    lrs: list[str] | None = None
    name = "optimizers"
    report = TWO_DOMAIN
    refines = "two-domain"
    options = ("optimizers", "pretrain_seeds")
    result_keys = (*TwoDomain.result_keys, "optimizers", "pretraining")
    method_keys = TwoDomain.method_keys

    def takes(self, request: Request) -> bool:
        return request.optimizers is not None

    def check(self, request: Request):
        if request.sweep:
            raise ForgetlessError("--sweep does not go with --optimizers; sweep learning rates there with --lrs")
        if not request.optimizers or request.pretrain_seeds <= 0:
            raise ForgetlessError("--optimizers runs the two-domain protocol with --pretrain-seeds >= 1: give "
                                  "--optimizers adamw,muon,... (the optimizers to compare)")
        super().check(request)

    def prepared(self, request: Request) -> Optimizers:
        return Optimizers(request.optimizers.split(","), request.pretrain_seeds,
                          request.lrs.split(",") if request.lrs else None)

    def arms(self, request: Request) -> list[str]:
        """Plain method names (default: full); each gets an arm per optimizer (and lr)."""
        return ["full"] if request.methods in ("all", "default") else request.methods.split(",")

    def configuration(self, request: Request, arms: list[str]) -> dict:
        return {"preset": request.preset, "model": request.model, "methods": arms,
                "optimizers": request.optimizers.split(","), "lrs": request.lrs, "pretrain_seeds": request.pretrain_seeds,
                "base_seeds": request.base_seeds, "config": request.cfg.to_dict()}

    def folder(self, request: Request) -> str:
        return self.name

    def run(self, ctx: RunContext, methods: list[str]) -> RunResult:
        unknown = [o for o in self.optimizers if o not in OPTIMIZERS]
        if unknown or not self.optimizers:
            raise ForgetlessError(f"unknown optimizer {unknown[0] if unknown else '(none)'!r} in --optimizers; "
                                  f"valid: {', '.join(OPTIMIZERS)}")
        if any("[" in m for m in methods):
            raise ForgetlessError("--optimizers makes one arm per method and optimizer: give plain method names, "
                                  "e.g. full,ffn")
        specs = [arm_spec(ctx.cfg, m, o, lr) for m in methods for o in self.optimizers for lr in self.lrs or [None]]
        results = TwoDomain().run(ctx, specs)
        results.extra["optimizers"] = list(self.optimizers)
        results.extra["pretraining"] = pretraining_runs(ctx.cfg, self.optimizers, list(range(self.pretrain_seeds)),
                                                  ctx.device, ctx.workers or 1)
        return results


def arm_spec(cfg: RunConfig, method: str, optimizer: str, lr: str | None) -> MethodSpec:
    """METHOD, or METHOD[optimizer=O;lr=LR] for what differs from the method's defaults in this run."""
    try:
        own_lr = build_method(method, cfg.methods.get(method)).own("lr", cfg.adapt.lr)
        other_lr = lr is not None and float(lr) != own_lr
    except ValueError:
        raise ForgetlessError(f"--lrs takes numbers, e.g. 1e-4,3e-4,1e-3; got {lr!r}") from None
    options = ({"optimizer": optimizer} if optimizer != cfg.adapt.optimizer else {}) | ({"lr": lr} if other_lr else {})
    return MethodSpec(method, options)


def pretraining_runs(cfg: RunConfig, optimizers: list[str], seeds: list[int], device=None, workers: int = 1) -> dict:
    """Per optimizer: mean ± std over seeds of the pretraining loss and held-out PPL_A curves. A is
    loaded beside B, as the protocol does (works in both are split between them), so the base of the
    protocol's own optimizer is the one the adaptation arms start from. The bases not cached yet are
    pretrained `workers` at a time."""
    (a, _), tokenizer = load_domains([cfg.data.domain_a, cfg.data.domain_b], cfg.data.tokenizer, cfg.model.block_size,
                                     cfg.data.val_fraction, cfg.data.eval_windows,
                                     cfg.data.dev_fraction)
    model_cfg = dataclasses.replace(cfg.model, vocab_size=tokenizer.vocab_size)
    configs = [dataclasses.replace(cfg.pretrain, optimizer=name, seed=s) for name in optimizers for s in seeds]
    bases = [(c, base_path(model_cfg, c, a, tokenizer)) for c in configs]  # each base's path once
    todo = [pretrain for pretrain, path in bases if not path.exists()]
    with progress_task("pretraining bases", total=len(todo)) as advance:
        run_jobs([lambda p=p: cached_base(model_cfg, p, a, tokenizer, device) for p in todo], workers,
                 lambda i, _: advance(1))
    out = {}
    for name in optimizers:
        paths = [path for pretrain, path in bases if pretrain.optimizer == name]
        metas = [load_base(path)[2] for path in paths]
        losses = list(zip(*[[v for _, v in m["history"]["loss"]] for m in metas]))
        ppl = list(zip(*[[e["ppl_a"] for e in m["history"]["evals"]] for m in metas]))
        out[name] = {
            "seeds": seeds, "bases": [str(p) for p in paths],
            "loss": {"step": [s for s, _ in metas[0]["history"]["loss"]], **band(losses)},
            "ppl_a": {"step": [e["step"] for e in metas[0]["history"]["evals"]], **band(ppl)},
            "final_ppl_a": mean_std([m["history"]["evals"][-1]["ppl_a"] for m in metas]),
            "final_loss": mean_std([statistics.fmean(v for _, v in m["history"]["loss"][-100:]) for m in metas]),
            "wall_s": mean_std([m["wall_s"] for m in metas]),
        }
    return out
