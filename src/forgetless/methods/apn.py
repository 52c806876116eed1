"""APN arms (docs/DESIGN.md §2.1): patch-only adaptation of an APN base, its continual knobs, the
parameter-matched base, and the retrofit of APN into a trained dense model.

Knobs (all in APNMethodConfig, each switchable, e.g. `--methods 'apn[local=true]'`):
  local            update only patches active in the batch (inactive ones stay bit-identical)
  decoders_only    train only the decoders (U_i, or the offsets of a shared decoder)
  norm_cap         per-patch cap on ||theta_i - theta_i(start)|| / ||theta_i(start)||
  update_rule      adamw, or gain: theta_i -= lr * clip(g_i, grad_cap) (plain SGD on clipped patch gradients)
  gate_on          none | router (train on tokens whose router confidence is in [gate_min, gate_max])
                   | entropy (tokens whose predictive entropy, in nats, is in that range)
  allocate         novelty allocation: when mean router confidence stays below novelty_threshold
                   for novelty_window steps, re-seed the least-used patch (EMA usage) at the least
                   confident token, decoder zero, then wait `cooldown` steps

Source: Attractor Patch Networks: Reducing Catastrophic Forgetting with Routed Low-Rank Patch Experts.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from forgetless import distributed
from forgetless.config import from_dict
from forgetless.errors import ForgetlessError
from forgetless.methods.base import Method, MethodConfig, find_ffns, put_beside, register_method
from forgetless.models.gpt import GPT, GPTConfig
from forgetless.nn.adapter import input_width, n_params, width_for
from forgetless.nn.apn import APN, APNConfig, patch_usage, routing_report
from forgetless.progress import console

PER_PATCH = ("prototypes", "gate_a", "gate_b", "decoders", "offset_in", "offset_out")  # first dim = K
DECODERS = ("decoders", "offset_in", "offset_out")
DENSE_PER_ACTIVE = 4  # dispatch=auto: dense up to this many patches per active one (beside SmolLM2, 1 CPU thread,
                      # 1,600 tokens, r 32: dense took 0.57x sparse's fwd+bwd at K = 11, top 4; 1.8x at K = 32)


@dataclass
class APNMethodConfig(MethodConfig):
    target_modules: list[str] = field(default_factory=list, metadata={
        "help": "retrofits: the FFNs to put an APN beside (empty: every "
                "decoder layer's MLP, found from the model's structure)"})
    apn: dict = field(default_factory=dict, metadata={"help": "APNConfig options of the APN base / retrofit modules"})
    train_prototypes: bool = field(default=True, metadata={"help": "prototypes (routing) train too, as in the source"})
    local: bool = field(default=False, metadata={"help": "update only patches active in the batch"})
    decoders_only: bool = field(default=False, metadata={"help": "train only the patch decoders"})
    norm_cap: float = field(default=0.0, metadata={"help": "cap on each patch's relative change (0 = off)"})
    update_rule: str = field(default="adamw", metadata={"help": "adamw, or gain: SGD on per-patch clipped gradients"})
    grad_cap: float = field(default=1.0, metadata={"help": "per-patch gradient norm cap of update_rule=gain"})
    gate_on: str = field(default="none", metadata={"help": "none, router (confidence) or entropy (nats)"})
    gate_min: float = field(default=-1.0, metadata={"help": "lowest confidence / entropy that still trains"})
    gate_max: float = field(default=1e9, metadata={"help": "highest confidence / entropy that still trains"})
    allocate: bool = field(default=False, metadata={"help": "novelty-driven re-seeding of the least-used patch"})
    novelty_threshold: float = field(default=0.25, metadata={"help": "mean router confidence below this is novel"})
    novelty_window: int = field(default=5, metadata={"help": "steps of novelty before a patch is re-seeded"})
    cooldown: int = field(default=20, metadata={"help": "steps between two re-seedings of one layer"})
    usage_decay: float = field(default=0.95, metadata={"help": "EMA decay of the patch usage counters"})
    param_matched: bool = field(default=False, metadata={"help": "choose n_patches so the base matches the dense one (within 5%)"})
    retrofit: bool = field(default=False, metadata={"help": "put APN beside the FFNs of the trained dense base"})
    retrofit_size: float = field(default=0.05, metadata={
        "help": "on transformers models: the APNs' parameters as a fraction of the model's (sets apn.n_patches "
                "unless given)"})
    dispatch: str = field(default="auto", metadata={
        "help": "how tokens reach their patches, same values: sparse (pairs sorted and packed), dense (every patch "
                f"on every token, weight 0 off the top k), auto (dense on a transformers model when n_patches <= "
                f"{DENSE_PER_ACTIVE} top_k, as its retrofit's few patches, else sparse)"})

    def __post_init__(self):
        super().__post_init__()
        if self.update_rule not in ("adamw", "gain"):
            raise ForgetlessError(f"update_rule must be adamw or gain, got {self.update_rule!r}")
        if self.gate_on not in ("none", "router", "entropy"):
            raise ForgetlessError(f"gate_on must be none, router or entropy, got {self.gate_on!r}")
        if self.norm_cap < 0 or self.grad_cap <= 0 or self.novelty_window <= 0 or self.cooldown < 0:
            raise ForgetlessError("norm_cap >= 0, grad_cap > 0, novelty_window > 0 and cooldown >= 0 are required")
        from_dict(APNConfig, self.apn, "apn")  # validate early
        if not self.retrofit_size > 0:
            raise ForgetlessError(f"retrofit_size must be positive, got {self.retrofit_size}")
        if self.dispatch not in ("auto", "sparse", "dense"):
            raise ForgetlessError(f"dispatch must be auto, sparse or dense, got {self.dispatch!r}")


def apn_modules(model: nn.Module) -> list[APN]:
    return [m for m in model.modules() if isinstance(m, APN)]


def matched_patches(model_cfg: GPTConfig, apn_cfg: APNConfig) -> int:
    """n_patches whose APN has as many parameters as the dense FFN (4x, biases) it replaces."""
    d, hidden = model_cfg.d_model, model_cfg.ffn_mult * model_cfg.d_model
    return patches_for(d, apn_cfg, 2 * d * hidden + hidden + d)


def patches_for(d: int, apn_cfg: APNConfig, budget: float) -> int:
    """n_patches (at least top_k) whose APN at width d has about `budget` parameters."""
    return width_for(lambda K: n_params(APN(d, dataclasses.replace(apn_cfg, n_patches=K, top_k=1))), budget,
                     least=apn_cfg.top_k)


@register_method("apn")
class APNMethod(Method):
    """APN base (APN FFNs pretrained on A); adapt only the patches, as in the source."""
    Config = APNMethodConfig
    order = 50
    unshardable = ("its step hooks mask the gradients and AdamW moments of single patches and allocate patches "
                   "between steps, on whole tensors")
    default_for = ("two-domain",)  # APN bases are costly; run them in a sequence with --methods apn,...

    def __init__(self, cfg: APNMethodConfig):
        super().__init__(cfg)
        self.apn_cfg = from_dict(APNConfig, cfg.apn, "apn")
        self.start: dict[str, torch.Tensor] = {}      # per-patch weights when the task started (norm caps)
        self.usage: dict[int, torch.Tensor] = {}      # layer -> EMA usage (K,)
        self.novel_steps: dict[int, int] = {}
        self.last_alloc: dict[int, int] = {}
        self.allocations = 0
        self.apns: list[APN] = []                     # the model's APN layers (set by attach)

    def base_config(self, model_cfg: GPTConfig) -> GPTConfig:
        if self.cfg.retrofit:
            return model_cfg
        apn_cfg = self.apn_cfg
        if self.cfg.param_matched:
            apn_cfg = dataclasses.replace(apn_cfg, n_patches=matched_patches(model_cfg, apn_cfg))
        return dataclasses.replace(model_cfg, ffn="apn", ffn_options=dataclasses.asdict(apn_cfg))

    def check_base(self, model):
        if isinstance(model, GPT):  # other models (transformers) get APN beside their MLPs
            super().check_base(model)

    def attach(self, model):
        if self.cfg.retrofit or not isinstance(model, GPT):
            if self.cfg.param_matched and not isinstance(model, GPT):
                console.print(f"[yellow]warning:[/yellow] {self.name}: param_matched sizes forgetless's own APN base; "
                              "on this model the APNs are retrofits sized by retrofit_size, as with apn")
            targets = find_ffns(model, self.cfg.target_modules, self.cfg.exclude_modules)
            apn_cfg = self.retrofit_config(model, targets)
            for name, module in targets:
                put_beside(model, name, module, APN(input_width(module), apn_cfg, out_std=0.0))
        if not apn_modules(model):
            raise ForgetlessError(f"method {self.name} found no APN module: it needs an APN base (or retrofit=true)")
        needs_routing = self.cfg.local or self.cfg.allocate
        self.apns = apn_modules(model)
        for m in apn_modules(model):
            m.record = needs_routing or self.cfg.gate_on == "router"
            m.update_gate = (self.cfg.gate_min, self.cfg.gate_max) if self.cfg.gate_on == "router" else None
            m.dense = self.dense(model, m)
        return model

    def dense(self, model, m: APN) -> bool:
        """Whether `m` runs every patch on every token (option dispatch); auto: a transformers retrofit with few
        patches (forgetless's own APN bases keep the sparse dispatch they were measured with)."""
        if self.cfg.dispatch != "auto":
            return self.cfg.dispatch == "dense"
        return not isinstance(model, GPT) and m.cfg.n_patches <= DENSE_PER_ACTIVE * m.cfg.top_k

    def retrofit_config(self, model, targets) -> APNConfig:
        """The APN options beside `targets`: on a transformers model, n_patches (unless given) sized so all
        the APNs have `retrofit_size` times the model's parameters (the byte-GPT defaults, K = 256 of rank
        32, would outweigh a 135M model)."""
        if isinstance(model, GPT) or "n_patches" in self.cfg.apn or not targets:
            return self.apn_cfg
        budget = self.cfg.retrofit_size * n_params(model) / len(targets)
        return dataclasses.replace(self.apn_cfg, n_patches=patches_for(input_width(targets[0][1]), self.apn_cfg, budget))

    def trainable_parameters(self, model):
        return [(f"{prefix}.{name}", p) for prefix, m in model.named_modules() if isinstance(m, APN)
                for name, p in m.named_parameters() if self.trains_tensor(name)]

    def trains_tensor(self, name: str) -> bool:
        if self.cfg.decoders_only and name not in DECODERS:
            return False
        if name in ("prototypes", "route_proj.weight") and not self.cfg.train_prototypes:
            return False
        return not (self.cfg.local and name not in PER_PATCH)  # shared code would move every patch

    # ---- loop hooks -------------------------------------------------------------------
    def make_optimizer(self, params, cfg):
        if distributed.world_size() > 1 and (self.cfg.local or self.cfg.allocate or self.cfg.gate_on == "entropy"):
            raise ForgetlessError(f"{self.name}: local, allocate and gate_on=entropy act on the routing of the batch, "
                                  "which each process sees only a shard of; run this method in one process")
        if self.cfg.update_rule == "gain":
            return torch.optim.SGD([p for _, p in params], lr=cfg.lr)
        return None

    def on_task_start(self, model, task):
        self.start = {f"{i}.{n}": p.detach().clone() for i, m in enumerate(apn_modules(model))
                      for n, p in m.named_parameters() if n in PER_PATCH}

    def before_step(self, model, optimizer, step, last):
        if self.cfg.gate_on != "none":  # nothing got through the gate: no step at all (no weight decay either)
            for p in (p for m in apn_modules(model) for p in m.parameters()):
                if p.grad is not None and not p.grad.any():
                    p.grad = None
        self.snapshot = {}
        for i, m in enumerate(apn_modules(model)):
            per_patch = [(n, p) for n, p in m.named_parameters() if n in PER_PATCH and p.grad is not None]
            if self.cfg.update_rule == "gain" and per_patch:
                norms = torch.stack([p.grad.flatten(1).norm(dim=1) ** 2 for _, p in per_patch]).sum(0).sqrt()  # (K,)
                scale = (self.cfg.grad_cap / norms.clamp_min(1e-12)).clamp(max=1.0)
                for _, p in per_patch:
                    p.grad.mul_(scale.view(-1, *[1] * (p.dim() - 1)))
            if self.cfg.local:
                active = self.active(m)
                for n, p in per_patch:
                    p.grad[~active] = 0
                    self.snapshot[f"{i}.{n}"] = (p.detach()[~active].clone(), ~active)

    def after_step(self, model, optimizer, step, last):
        for i, m in enumerate(apn_modules(model)):
            with torch.no_grad():
                for n, p in m.named_parameters():
                    key = f"{i}.{n}"
                    if key in self.snapshot:  # inactive patches: undo momentum and weight decay
                        rows, inactive = self.snapshot[key]
                        p[inactive] = rows
                    if self.cfg.norm_cap > 0 and key in self.start and p.requires_grad:
                        self.cap(p, self.start[key])
            if self.cfg.allocate:
                self.maybe_allocate(i, m, optimizer, step)

    def active(self, m: APN) -> torch.Tensor:
        mask = torch.zeros(m.cfg.n_patches, dtype=torch.bool, device=m.prototypes.device)
        mask[m.last_routing.index.reshape(-1)] = True
        return mask

    def cap(self, p: torch.Tensor, start: torch.Tensor):
        """Project each patch back so ||p_i - start_i|| <= norm_cap * ||start_i||."""
        delta = (p - start).flatten(1)
        limit = self.cfg.norm_cap * start.flatten(1).norm(dim=1).clamp_min(1e-6)
        scale = (limit / delta.norm(dim=1).clamp_min(1e-12)).clamp(max=1.0)
        p.copy_(start + (delta * scale[:, None]).view_as(p))

    def maybe_allocate(self, layer: int, m: APN, optimizer, step: int):
        r = m.last_routing
        K = m.cfg.n_patches
        counts = torch.bincount(r.index.reshape(-1), minlength=K).float() / r.index.numel()
        usage = self.usage.get(layer, torch.full((K,), 1.0 / K, device=counts.device))
        self.usage[layer] = usage = self.cfg.usage_decay * usage + (1 - self.cfg.usage_decay) * counts
        novel = r.confidence.mean().item() < self.cfg.novelty_threshold
        self.novel_steps[layer] = self.novel_steps.get(layer, 0) + 1 if novel else 0
        cooled = step - self.last_alloc.get(layer, -10**9) >= self.cfg.cooldown
        if self.novel_steps[layer] < self.cfg.novelty_window or not cooled:
            return
        i, t = int(usage.argmin()), int(r.confidence.argmin())
        with torch.no_grad():
            m.prototypes[i] = r.z[t] * m.prototypes.norm(dim=1).mean()
            for name in ("gate_a", "gate_b", "decoders", "offset_out"):
                if hasattr(m, name):
                    getattr(m, name)[i] = 0
        for p in (m.prototypes, m.gate_a, m.gate_b, getattr(m, "decoders", None), getattr(m, "offset_out", None)):
            for v in optimizer.state.get(p, {}).values() if p is not None else ():
                if torch.is_tensor(v) and v.dim() > 0 and v.shape[0] == K:
                    v[i] = 0
        usage[i] = 1.0 / K
        self.last_alloc[layer], self.novel_steps[layer] = step, 0
        self.allocations += 1

    def hook_state(self):
        """EMA usage per layer, plus [layer, novel steps, last allocation step] rows."""
        rows = [[k, self.novel_steps.get(k, 0), self.last_alloc.get(k, -10**9)] for k in self.usage]
        return {**{f"usage.{k}": v for k, v in self.usage.items()},
                "alloc": torch.tensor(rows, dtype=torch.long).reshape(-1, 3),
                "allocations": torch.tensor(self.allocations)}

    def load_hook_state(self, tensors):
        self.usage = {int(k.split(".")[1]): v for k, v in tensors.items() if k.startswith("usage.")}
        for layer, novel, last in tensors["alloc"].tolist() if "alloc" in tensors else []:
            self.novel_steps[layer], self.last_alloc[layer] = novel, last
        self.allocations = int(tensors.get("allocations", torch.tensor(0)))

    # ---- loss and diagnostics -------------------------------------------------------------
    @property
    def token_weights(self):
        """`entropy_weights` under gate_on=entropy, else None: the loss then needs only the scored positions'
        logits (training_loss skips the output head elsewhere: a fifth of apn-retrofit's SmolLM2 step,
        docs/results/speed.md)."""
        return self.entropy_weights if self.cfg.gate_on == "entropy" else None

    def entropy_weights(self, logits, batch):
        """Train only on tokens whose predictive entropy (nats) is in range; the routing regularizer of every
        APN layer is then taken over those tokens only."""
        with torch.no_grad():
            logp = logits.log_softmax(-1)
            entropy = -(logp.exp() * logp).sum(-1)                                   # (B, T) nats
            trains = (entropy >= self.cfg.gate_min) & (entropy <= self.cfg.gate_max)
        for m in self.apns:
            if m.train_route is not None:
                m.aux_loss = m.regularizer(*m.train_route, trains.flatten())
        return trains.float()

    def report(self, model, windows_a, windows_b):
        return {**routing_report(model, windows_a, windows_b), "allocations": self.allocations}

    def live_stats(self, model, windows):
        return {"usage": patch_usage(model, windows)}


def arm(name: str, order: int, doc: str, **defaults):
    """Register an APN arm: the same method with other defaults, at `order` in tables."""
    fields_ = [(k, type(v), field(default=v)) for k, v in defaults.items()]
    config = dataclasses.make_dataclass(f"{name.title().replace('-', '')}Config", fields_, bases=(APNMethodConfig,))
    cls = type(name.title().replace("-", ""), (APNMethod,), {"Config": config, "__doc__": doc, "order": order})
    return register_method(name)(cls)


arm("apn-local", 51, "APN base; only active patches update, with per-patch norm caps and router-confidence gating",
    local=True, norm_cap=0.5, gate_on="router", gate_min=0.3)
arm("apn-param-matched", 52, "APN base with n_patches chosen so its parameters match the dense base",
    param_matched=True)
arm("apn-retrofit", 53, "APN beside every FFN of the trained dense base; only routing and patches train",
    retrofit=True, lr=1e-3)
