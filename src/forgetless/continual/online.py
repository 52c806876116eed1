"""The online protocol (docs/DESIGN.md §3.5): learn from a stream of text while scoring it.

The stream is `online.chunks` chunks of `online.chunk_tokens` tokens: the first `switch` share from
A's validation text (never pretrained on), the rest from B's training text. Each chunk is scored first
(its prequential loss: the model has not seen it), then learned by `online.steps_per_chunk` updates of
the method (continual.learner). Every `online.canary_every` chunks the canary, held-out windows of A,
is scored: the retention curve. Two baseline arms run beside the methods: `frozen` (no updates) and
`dynamic-eval` (plain SGD on each chunk, decaying toward the original weights); every arm's gain is its
mean prequential loss below theirs (`frozen` on the arm's own base: APN, CMS and HOPE methods start from
bases of their own).
"""
from __future__ import annotations

import dataclasses
import math
import statistics
import time

import torch
import torch.nn as nn

from forgetless.continual.evaluate import evaluate
from forgetless.continual.learner import Learner, chunk_windows
from forgetless.continual.plan import run_arms
from forgetless.continual.protocol import (PROTOCOLS, Protocol, Request, RunContext, build_arms, fresh,
                                           load_pretrained, opening, register_protocol)
from forgetless.continual.two_domain import TwoDomain
from forgetless.data.domains import Domain, load_domains
from forgetless.errors import ForgetlessError
from forgetless.methods import Method, MethodSpec
from forgetless.methods.base import as_specs
from forgetless.monitor import PeakRSS
from forgetless.presets import AdaptConfig, OnlineConfig
from forgetless.report.online import ONLINE
from forgetless.report.results import RunResult
from forgetless.stats import band, mean_std

FROZEN, DYNAMIC = "frozen", "dynamic-eval"
METRICS = ["prequential_loss", "prequential_loss_a", "prequential_loss_b", "canary_loss_before", "canary_loss_after",
           "canary_ppl_before", "canary_ppl_after", "forgetting", "gain_vs_frozen", "gain_vs_dynamic_eval",
           "updates_per_s", "wall_s"]


class Frozen(Method):
    """The no-update baseline: the stream scored by the base's own weights (not registered: it learns nothing)."""
    name = FROZEN

    def trainable_parameters(self, model):
        return []


def stream(a: Domain, b: Domain, cfg: OnlineConfig, block_size: int) -> tuple[list[torch.Tensor], int]:
    """(the chunks' windows, each (W, T+1); the index of the first chunk from B)."""
    n_a = round(cfg.switch * cfg.chunks)
    parts = []
    for tokens, n, where in ((a.dev, n_a, f"{a.spec} validation text"), (b.train, cfg.chunks - n_a, f"{b.spec} training text")):
        if n and (tokens is None or len(tokens) < n * cfg.chunk_tokens):
            have = 0 if tokens is None else len(tokens)
            raise ForgetlessError(f"the stream needs {n} chunks of {cfg.chunk_tokens} tokens from {where}, which holds "
                                  f"{have}; lower --online-chunks or --online-chunk-tokens")
        parts += [chunk_windows(tokens[i * cfg.chunk_tokens:(i + 1) * cfg.chunk_tokens], block_size) for i in range(n)]
    return parts, n_a


def run_online_arm(model: nn.Module, method: Method, chunks: list[torch.Tensor], canary: torch.Tensor,
                   original: Domain, cfg: AdaptConfig, online: OnlineConfig, seed: int) -> dict:
    """One arm over the stream: score each chunk, then learn it; the canary every `canary_every` chunks.
    `frozen` never learns. Returns per-chunk prequential losses and the canary curve (chunks seen, loss)."""
    torch.manual_seed(seed)
    learner = None
    if not isinstance(method, Frozen):
        learner = Learner(model, method, cfg, original, original.train, seed, cfg.mix)
        model = learner.model
    prequential, canary_curve, learn_s = [], [(0, evaluate(model, canary, precision=cfg.precision)["loss"])], 0.0
    with PeakRSS() as memory:
        t0 = time.perf_counter()
        for k, windows in enumerate(chunks, start=1):
            prequential.append(evaluate(model, windows, precision=cfg.precision)["loss"])  # scored before it is learned
            if learner is not None:
                t = time.perf_counter()
                learner.learn(windows, online.steps_per_chunk)
                learn_s += time.perf_counter() - t
            if k % online.canary_every == 0 or k == len(chunks):
                canary_curve.append((k, evaluate(model, canary, precision=cfg.precision)["loss"]))
        wall = time.perf_counter() - t0
    updates = learner.steps if learner else 0
    return {"method": method.name, "seed": seed, "prequential": prequential, "canary": canary_curve,
            "updates": updates, "learn_s": learn_s, "updates_per_s": updates / learn_s if learn_s > 0 else None,
            "wall_s": wall, "trainable_params": sum(p.numel() for _, p in learner.params) if learner else 0,
            "total_params": sum(p.numel() for p in model.parameters()), "peak_rss_mb": memory.peak_mb}


@register_protocol
class Online(Protocol):
    """One stream from A to B, each chunk scored, then learned; a canary of A's held-out windows."""
    name = "online"
    report = ONLINE
    method_set, default_methods = "two-domain", TwoDomain.default_methods  # two-domain's arms
    result_keys = ("domains", "held_out", "data_fingerprints", "stream", "config", "bases")
    method_keys = tuple(METRICS)

    def configuration(self, request: Request, arms: list) -> dict:
        return {**super().configuration(request, arms), "online": dataclasses.asdict(request.cfg.online)}

    def run(self, ctx: RunContext, methods: list[MethodSpec | str]) -> RunResult:
        """The `frozen` and `dynamic-eval` arms plus every (method, seed) arm over one stream (bases as in the
        two-domain protocol); its results (docs/DESIGN.md §6.3)."""
        cfg, device = ctx.cfg, ctx.device
        specs = [s for s in as_specs(methods) if s.name not in (FROZEN, DYNAMIC) or s.options]
        built = {FROZEN: Frozen(Method.Config()), **build_arms(cfg, [DYNAMIC]), **build_arms(cfg, specs)}
        pretrained = load_pretrained(ctx.model, device, ctx.cfg.load)
        (a, b), tokenizer = load_domains([cfg.data.domain_a, cfg.data.domain_b],
                                         pretrained[1] if pretrained else cfg.data.tokenizer, cfg.model.block_size,
                                         cfg.data.val_fraction, cfg.data.eval_windows, cfg.data.dev_fraction)
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=tokenizer.vocab_size))
        ctx = dataclasses.replace(ctx, cfg=cfg)
        chunks, switch = stream(a, b, cfg.online, cfg.model.block_size)
        canary = a.windows[:cfg.online.canary_windows or None]
        n_canary = 1 + math.ceil(cfg.online.chunks / cfg.online.canary_every)

        def arm_config(label, method, base_name):
            return {"protocol": "online", "config": cfg.to_dict(), "online": dataclasses.asdict(cfg.online),
                    "method": method.name, "options": method.options(), "base": base_name,
                    "domains": [a.fingerprint, b.fingerprint]}

        def arm_seconds(calibration, method, base_cfg):
            windows = sum(len(c) for c in chunks)
            score = (windows + n_canary * len(canary)) * calibration.window(base_cfg)
            if isinstance(method, Frozen):
                return score
            return score + cfg.online.chunks * cfg.online.steps_per_chunk * \
                calibration.step(base_cfg, method, len(chunks[0]))

        frozen: dict[str, list[float]] = {}  # base name -> its prequential losses without updates, shared by its arms

        def run(label, method, seed, base_name, load, arm_dir):
            model = load()
            if base_name not in frozen:
                frozen[base_name] = [evaluate(model, c, precision=cfg.adapt.precision)["loss"] for c in chunks]
            method = method if isinstance(method, Frozen) else fresh(method)
            return {**run_online_arm(model, method, chunks, canary, a, cfg.adapt, cfg.online, seed),
                    "frozen_prequential": frozen[base_name]}

        arms, summary = run_arms(ctx, built, a, tokenizer, pretrained, arm_config, run, arm_seconds)
        positions = [k * cfg.online.chunk_tokens for k in range(1, len(chunks) + 1)]
        return RunResult.from_json({
            **opening(ctx, self.name, a, b),
            "config": {**cfg.to_dict(), "online": dataclasses.asdict(cfg.online)},
            "stream": {"chunks": len(chunks), "chunk_tokens": cfg.online.chunk_tokens,
                       "windows_per_chunk": len(chunks[0]), "switch_chunk": switch, "positions": positions,
                       "a": f"{cfg.data.domain_a}: " + (f"validation works {', '.join(a.dev_keys)}" if a.dev_keys
                                                        else "validation text (the tail of its training text)"),
                       "b": f"{cfg.data.domain_b}: training text", "canary_windows": len(canary)},
            "bases": summary,
            "methods": {label: summarize(runs, arms[FROZEN], arms[DYNAMIC], built[label], switch, cfg.online)
                        for label, runs in arms.items()},
        })


run_online = PROTOCOLS["online"]  # run_online(cfg, methods, seeds, out, preset, device, model, ...)


def arm_metrics(run: dict, frozen: dict, dynamic: dict, switch: int) -> dict:
    """One seed's scalars: mean prequential loss (all chunks, A's, B's), canary before/after, forgetting
    (canary PPL rise), gains over the baselines (their mean prequential loss minus this arm's, nats/token):
    over the arm's own base without updates (an APN, CMS or HOPE base for those methods) and over
    dynamic-eval (on the dense base)."""
    mean = statistics.fmean(run["prequential"])
    before, after = run["canary"][0][1], run["canary"][-1][1]
    part_a, part_b = run["prequential"][:switch], run["prequential"][switch:]
    return {"prequential_loss": mean, "prequential_loss_a": statistics.fmean(part_a) if part_a else None,
            "prequential_loss_b": statistics.fmean(part_b) if part_b else None,
            "canary_loss_before": before, "canary_loss_after": after, "canary_ppl_before": math.exp(before),
            "canary_ppl_after": math.exp(after), "forgetting": math.exp(after - before) - 1,
            "gain_vs_frozen": statistics.fmean(run.get("frozen_prequential", frozen["prequential"])) - mean,
            "gain_vs_dynamic_eval": statistics.fmean(dynamic["prequential"]) - mean,
            "updates_per_s": run["updates_per_s"], "wall_s": run["wall_s"]}


def summarize(runs: list[dict], frozen: list[dict], dynamic: list[dict], method: Method, switch: int,
              online: OnlineConfig) -> dict:
    frozen_by, dynamic_by = {r["seed"]: r for r in frozen}, {r["seed"]: r for r in dynamic}
    per_seed = [arm_metrics(r, frozen_by[r["seed"]], dynamic_by[r["seed"]], switch) for r in runs]
    out = {m: mean_std([s[m] for s in per_seed]) for m in METRICS}
    out.update(method=method.name, options=method.options(), trainable_params=runs[0]["trainable_params"],
               total_params=runs[0]["total_params"], peak_rss_mb=max(r["peak_rss_mb"] for r in runs),
               updates=runs[0]["updates"],
               curves={"position": [k * online.chunk_tokens for k in range(1, len(runs[0]["prequential"]) + 1)],
                       "prequential_loss": band(list(zip(*[r["prequential"] for r in runs]))),
                       "canary_position": [k * online.chunk_tokens for k, _ in runs[0]["canary"]],
                       "canary_loss": band(list(zip(*[[l for _, l in r["canary"]] for r in runs])))})
    return out
