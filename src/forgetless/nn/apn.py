"""Attractor Patch Network (APN): a drop-in FFN of routed low-rank patch experts (docs/DESIGN.md §2.1).

    z   = x / ||x||                          routing input (optionally R x: contextual prototypes)
    s_i = <z, p_i / ||p_i||> / tau           cosine routing score of patch i
    S   = TopK(s, k),  w = softmax_S(s)
    u   = V^T x                              shared code, r dims
    phi_i = u * sigmoid(a_i * u + b_i)       patch gate (vector or scalar a_i, b_i)
    APN(x) = gamma * sum_{i in S} w_i U_i phi_i

Tokens are dispatched sparsely: (token, patch) pairs are sorted by patch and packed into a
(K, capacity, r) buffer, so every decoder runs as one batched matmul and no per-token copy of
U is ever made. With few patches (a retrofit's K = 11 beside SmolLM2's MLPs) `dense = True` runs every
patch on every token instead, weights 0 off the top k: one plain matmul, no sorting or packing.

Source: Attractor Patch Networks: Reducing Catastrophic Forgetting with Routed Low-Rank Patch Experts.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from forgetless import distributed
from forgetless.config import from_dict
from forgetless.errors import ForgetlessError
from forgetless.models.gpt import GPTConfig, recorded_forward, register_ffn
from forgetless.side import AuxLoss, Monitored


@dataclass
class APNConfig:
    n_patches: int = field(default=256, metadata={"help": "K, number of patches (prototypes)"})
    top_k: int = field(default=4, metadata={"help": "k, active patches per token"})
    rank: int = field(default=32, metadata={"help": "r, width of the shared code and of each decoder"})
    tau: float = field(default=0.07, metadata={"help": "routing temperature"})
    gamma: float = field(default=1.0, metadata={"help": "residual scale"})
    balance: float = field(default=0.01, metadata={"help": "weight of the load-balancing loss sum_i (usage_i - 1/K)^2"})
    entropy: float = field(default=0.0, metadata={"help": "weight of the mean routing entropy (>0 sharpens, <0 spreads)"})
    patch_dropout: float = field(default=0.0, metadata={"help": "probability of dropping an active patch in training"})
    gate: str = field(default="vector", metadata={"help": "vector (a_i, b_i in R^r) or scalar (diagonal gate)"})
    decoder: str = field(default="full", metadata={"help": "full (U_i per patch) or shared (U_0 + per-patch low-rank offsets)"})
    offset_rank: int = field(default=4, metadata={"help": "rank of the per-patch offsets with decoder=shared"})
    route_dim: int = field(default=0, metadata={"help": "route in a learned subspace of this size (0 = on x itself)"})

    def __post_init__(self):
        for name in ("n_patches", "top_k", "rank", "offset_rank"):
            if getattr(self, name) <= 0:
                raise ForgetlessError(f"apn.{name} must be positive, got {getattr(self, name)}")
        if self.top_k > self.n_patches:
            raise ForgetlessError(f"apn.top_k ({self.top_k}) cannot exceed apn.n_patches ({self.n_patches})")
        if self.tau <= 0 or self.route_dim < 0 or not 0 <= self.patch_dropout < 1:
            raise ForgetlessError("apn.tau must be > 0, apn.route_dim >= 0, apn.patch_dropout in [0, 1)")
        if self.gate not in ("vector", "scalar") or self.decoder not in ("full", "shared"):
            raise ForgetlessError("apn.gate is vector or scalar; apn.decoder is full or shared")


@dataclass
class Routing:
    """What one forward pass routed (detached), for monitors and continual knobs."""
    index: torch.Tensor       # (N, k) active patches per token
    weight: torch.Tensor      # (N, k) their softmax weights
    confidence: torch.Tensor  # (N,) max_i s_i * tau: best cosine similarity
    z: torch.Tensor           # (N, d_route) normalised routing input
    residual_ratio: float     # mean ||APN(x)|| / ||x||


class APN(AuxLoss, Monitored, nn.Module):
    """aux_loss: the routing regularizer of the last training forward; with `record` on, `last_routing`."""
    def __init__(self, d: int, cfg: APNConfig, out_std: float = 0.02):
        super().__init__()
        self.cfg, self.d = cfg, d
        K, r = cfg.n_patches, cfg.rank
        d_route = cfg.route_dim or d
        self.route_proj = nn.Linear(d, cfg.route_dim, bias=False) if cfg.route_dim else None
        self.prototypes = nn.Parameter(torch.randn(K, d_route))                 # (K, d_route)
        self.code = nn.Parameter(torch.randn(d, r) / math.sqrt(d))              # V: (d, r)
        gate_width = r if cfg.gate == "vector" else 1
        self.gate_a = nn.Parameter(torch.zeros(K, gate_width))                   # a_i
        self.gate_b = nn.Parameter(torch.zeros(K, gate_width))                   # b_i
        if cfg.decoder == "full":
            self.decoders = nn.Parameter(torch.randn(K, r, d) * out_std)        # U_i^T: (K, r, d)
        else:
            q = cfg.offset_rank
            self.base_decoder = nn.Parameter(torch.randn(r, d) * out_std)        # U_0^T: (r, d)
            self.offset_in = nn.Parameter(torch.randn(K, r, q) / math.sqrt(r))   # B_i: (K, r, q)
            self.offset_out = nn.Parameter(torch.zeros(K, q, d))                 # A_i^T: (K, q, d)
        self.train_route: tuple[torch.Tensor, torch.Tensor] | None = None  # (index, weight) of the last training forward
        self.last_routing: Routing | None = None  # kept while `record` is on (monitors, continual knobs)
        self.update_gate: tuple[float, float] | None = None  # train only tokens with confidence in range
        self.dense = False  # dense_dispatch instead of dispatch (same values; set by methods.apn for few patches)

    def route(self, x: torch.Tensor):  # x: (N, d)
        h = self.route_proj(x) if self.route_proj is not None else x
        z = F.normalize(h, dim=-1)                                              # (N, d_route)
        scores = z @ F.normalize(self.prototypes, dim=-1).T / self.cfg.tau       # (N, K)
        top, index = scores.topk(self.cfg.top_k, dim=-1)                         # (N, k)
        weight = top.softmax(dim=-1)                                             # (N, k)
        return z, scores, index, weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, d)
        shape = x.shape
        x = x.reshape(-1, shape[-1])                                             # (N, d)
        z, scores, index, weight = self.route(x)
        confidence = scores.detach().max(-1).values * self.cfg.tau              # (N,) best cosine
        trains = None                                                            # (N,) tokens that may train
        if self.update_gate is not None and self.training:
            trains = (confidence >= self.update_gate[0]) & (confidence <= self.update_gate[1])
        self.train_route = (index, weight) if self.training else None
        self.aux_loss = self.regularizer(index, weight, trains) if self.training else None
        if self.training and self.cfg.patch_dropout > 0:
            keep = torch.rand_like(weight) >= self.cfg.patch_dropout
            weight = weight * keep / (1 - self.cfg.patch_dropout)
        u = x @ self.code                                                        # (N, r)
        out = self.cfg.gamma * (self.dense_dispatch if self.dense else self.dispatch)(u, index, weight)  # (N, d)
        if trains is not None:  # same output, no gradient outside the range
            out = torch.where(trains.unsqueeze(1), out, out.detach())
        if self.record:
            self.last_routing = Routing(index.detach(), weight.detach(), confidence,
                                        z.detach(), (out.norm(dim=-1) / x.norm(dim=-1).clamp_min(1e-6)).mean().item())
        return out.reshape(shape)

    def dispatch(self, u: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """sum_{i in S} w_i U_i phi_i for every token, by batched matmuls over groups of pairs.

        (token, patch) pairs are sorted by patch and cut into groups of at most `c` pairs (c = the
        mean number of pairs per patch), so a busy patch spans several groups and the padded
        buffer stays under 2x the pairs however unbalanced the routing is. Each group reads its
        patch's decoder once: no per-token copy of U is made.
        """
        N, k = index.shape
        K, r = self.cfg.n_patches, u.shape[1]
        flat = index.reshape(-1)                                                 # (P,) P = N*k pairs
        order = flat.argsort(stable=True)
        patch = flat[order]                                                      # (P,) sorted patch ids
        token = order // k                                                       # (P,) token of each pair
        counts = torch.bincount(flat, minlength=K)                               # (K,)
        c = -(-len(flat) // K)                                                   # group size
        slot = torch.arange(len(flat), device=flat.device) - (counts.cumsum(0) - counts)[patch]  # place in its patch
        groups = -(-counts // c)                                                 # (K,) groups per patch
        group = (groups.cumsum(0) - groups)[patch] + slot // c                   # (P,) group of each pair
        row = group * c + slot % c                                               # (P,) row in the buffer
        group_patch = torch.repeat_interleave(torch.arange(K, device=flat.device), groups)  # (G,)
        u_pairs = u.index_select(0, token)                                       # (P, r)
        a, b = self.gate_a.index_select(0, patch), self.gate_b.index_select(0, patch)
        phi = u_pairs * torch.sigmoid(a * u_pairs + b)                           # (P, r)
        phi = phi * weight.reshape(-1)[order].unsqueeze(1)                       # fold in w_i
        packed = phi.new_zeros(len(group_patch) * c, r).index_copy(0, row, phi).view(-1, c, r)  # (G, c, r)
        if self.cfg.decoder == "full":
            y = torch.bmm(packed, self.decoders.index_select(0, group_patch))   # (G, c, d)
        else:
            low = torch.bmm(packed, self.offset_in.index_select(0, group_patch))  # (G, c, q)
            y = torch.bmm(low, self.offset_out.index_select(0, group_patch))     # (G, c, d)
        y = y.view(-1, self.d).index_select(0, row)                              # (P, d)
        out = u.new_zeros(N, self.d).index_add(0, token, y)                      # (N, d)
        if self.cfg.decoder == "shared":  # U_0 is shared: apply it once per token
            mixed = u.new_zeros(N, r).index_add(0, token, phi)                   # (N, r) sum_i w_i phi_i
            out = out + mixed @ self.base_decoder
        return out

    def dense_dispatch(self, u: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The same sum over all K patches at once, the inactive ones weighted 0: one (N, K r) x (K r, d) product
        instead of sorting and packing pairs. K / k times the multiply-adds, so faster only for few patches."""
        N, K = u.shape[0], self.cfg.n_patches
        w = weight.new_zeros(N, K).scatter(1, index, weight)                    # (N, K), 0 off the top k
        u3 = u.unsqueeze(1)                                                      # (N, 1, r)
        phi = u3 * torch.sigmoid(self.gate_a * u3 + self.gate_b) * w.unsqueeze(2)  # (N, K, r) w_i phi_i
        if self.cfg.decoder == "full":
            return phi.flatten(1) @ self.decoders.flatten(0, 1)                  # (N, d)
        low = torch.einsum("nkr,krq->nkq", phi, self.offset_in)                 # (N, K, q)
        return low.flatten(1) @ self.offset_out.flatten(0, 1) + phi.sum(1) @ self.base_decoder

    def regularizer(self, index, weight, trains: torch.Tensor | None = None) -> torch.Tensor | None:
        """Load balancing on the routing mass per patch, plus the optional entropy term, over the
        tokens that may train (`trains`, (N,) bool; None: all), so gated-out tokens move nothing."""
        if trains is not None:
            if not trains.any() and distributed.world_size() == 1:
                return None
            index, weight = index[trains], weight[trains]
        K = self.cfg.n_patches
        mass = weight.new_zeros(K).index_add(0, index.reshape(-1), weight.reshape(-1))
        if distributed.world_size() > 1:
            return self.global_regularizer(mass, weight)
        usage = mass / index.shape[0]                                            # (K,) sums to 1
        loss = self.cfg.balance * ((usage - 1.0 / K) ** 2).sum()
        if self.cfg.entropy:
            entropy = -(weight.clamp_min(1e-9).log() * weight).sum(-1).mean()
            loss = loss + self.cfg.entropy * entropy
        return loss

    def global_regularizer(self, mass: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
        """`regularizer` of the global batch under torchrun, where this rank holds a shard of the tokens:
        the value is the ranks' mean and, as gradients are averaged, this rank's part of the gradient
        times the world size (the load balance is not a mean over tokens: per-shard losses would differ)."""
        n = distributed.world_size()
        mass_all = distributed.all_sum(torch.cat([mass.detach(), mass.new_tensor([weight.shape[0]])]))
        tokens = mass_all[-1]
        if tokens == 0:
            return None
        excess = mass_all[:-1] / tokens - 1.0 / self.cfg.n_patches                # (K,) global usage - 1/K
        part = n * (2 * excess * mass / tokens).sum()
        loss = self.cfg.balance * ((excess ** 2).sum() + part - part.detach())
        if self.cfg.entropy:
            entropy = -(weight.clamp_min(1e-9).log() * weight).sum()
            loss = loss + self.cfg.entropy * n * entropy / tokens
        return loss

    def stats(self) -> dict:
        """Monitors of the last recorded forward: usage entropy (/ log K), confidence, residual ratio."""
        r = self.last_routing
        usage = torch.bincount(r.index.reshape(-1), minlength=self.cfg.n_patches).float()
        usage = usage / usage.sum()
        entropy = -(usage[usage > 0] * usage[usage > 0].log()).sum() / math.log(self.cfg.n_patches)
        return {"usage_entropy": entropy.item(), "confidence": r.confidence.mean().item(),
                "residual_ratio": r.residual_ratio}

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in asdict(self.cfg).items())


@register_ffn("apn")
def apn_ffn(cfg: GPTConfig) -> APN:
    """APN as the FFN of every block; `GPTConfig.ffn_options` holds its APNConfig fields."""
    return APN(cfg.d_model, from_dict(APNConfig, cfg.ffn_options, "apn"), out_std=0.02 / math.sqrt(2 * cfg.n_layer))


def routing(model: nn.Module, windows: torch.Tensor) -> list[Routing]:
    """Routing of every APN module of `model` on windows (W, T+1), in module order."""
    apns = [m for m in model.modules() if isinstance(m, APN)]
    recorded_forward(model, apns, windows)
    return [m.last_routing for m in apns]


@torch.no_grad()
def patch_usage(model: nn.Module, windows: torch.Tensor) -> list[list[float]]:
    """Share of the tokens of `windows` (W, T+1) routed to each patch, per APN layer: (layers, K) as lists."""
    apns = [m for m in model.modules() if isinstance(m, APN)]
    return [(torch.bincount(r.index.reshape(-1), minlength=m.cfg.n_patches).float() / r.index.numel()).tolist()
            for m, r in zip(apns, routing(model, windows))]


def overlap_histogram(index_a: torch.Tensor, index_b: torch.Tensor) -> list[float]:
    """Share of token pairs whose active sets share j = 0..k patches (the source's interference
    proxy |S(x) & S(x')| / k); token t of `index_a` (N, k) is paired with token t of `index_b`."""
    n, k = min(len(index_a), len(index_b)), index_a.shape[1]
    shared = (index_a[:n].unsqueeze(2) == index_b[:n].unsqueeze(1)).any(2).sum(1)   # (n,)
    return (torch.bincount(shared, minlength=k + 1).float() / n).tolist()


def routing_report(model: nn.Module, windows_a: torch.Tensor, windows_b: torch.Tensor, bins: int = 50) -> dict:
    """Overlap histograms (A-B pairs, and A-A pairs from other windows as the reference),
    router-confidence histograms on A and B, and usage entropy, summed/averaged over layers."""
    ra, rb = routing(model, windows_a), routing(model, windows_b)
    if not ra:
        return {}
    k = ra[0].index.shape[1]
    ab = torch.tensor([overlap_histogram(a.index, b.index) for a, b in zip(ra, rb)]).mean(0)
    aa = torch.tensor([overlap_histogram(a.index, a.index.roll(len(a.index) // 2, 0)) for a in ra]).mean(0)
    conf_a = torch.cat([r.confidence for r in ra])
    conf_b = torch.cat([r.confidence for r in rb])
    hist = lambda c: (torch.histc(c, bins=bins, min=-1.0, max=1.0) / len(c)).tolist()  # noqa: E731
    mean_overlap = lambda h: float((h * torch.arange(k + 1)).sum() / k)  # noqa: E731
    return {"overlap_ab": ab.tolist(), "overlap_aa": aa.tolist(),
            "mean_overlap_ab": mean_overlap(ab), "mean_overlap_aa": mean_overlap(aa),
            "confidence_bins": torch.linspace(-1, 1, bins + 1).tolist(),
            "confidence_a": hist(conf_a), "confidence_b": hist(conf_b),
            "mean_confidence_a": conf_a.mean().item(), "mean_confidence_b": conf_b.mean().item()}
