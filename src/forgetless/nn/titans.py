"""Titans neural memory (docs/DESIGN.md §2.4): a small MLP whose weights are written inside the forward pass,
at training and at test time, by gradient steps on an associative loss, and read by queries.

    M(x)     = x + W2 GELU(W1 x)                                  per head: W1 (F, D), W2 (D, F)
    loss_t   = ||M(k_t) - v_t||^2                                 k_t, q_t L2-normalised
    S_t      = mu_t S_{t-1} - s eta_t grad loss_t                 momentum (the "surprise"); mu = 0 without it
    W_t      = alpha_t W_{t-1} + S_t                              alpha: retention (forgetting as weight decay)
    eta_t    = softplus(w_eta x_t + b_eta),  alpha_t = sigmoid(.),  mu_t = sigmoid(.)      data-dependent, per head

For a linear memory M(k) = W k the write is the delta rule W <- W (alpha I - eta k k^T) + eta v k^T, the form of
the Nested Learning source. Tokens are taken in chunks of `chunk`: every gradient of a chunk is computed at the
chunk's starting weights, all tokens at once and in closed form; momentum and decay over the chunk are a product
of scalar gates, summed with a (C, C) mask (no loop over tokens). The chunk's rates are scaled by one s <= 1 so
that its step times the curvature of its loss is at most 1 (`step_scale`): the write is stable at any width and
rate. Queries of chunk n read the memory as written by chunks 0..n-1, so the output at t never sees a later
token. Only each chunk's surprise (its gradients at the weights the chunks before it wrote) must wait for the
previous chunk: `parallel_scan` runs the chunks' surprises and writes as one autograd Function, a few ops per
chunk without a graph and its adjoint by hand in backward, and the gates' coefficients and all reads batched
over the chunks; `sequential_scan`, one chunk at a time in the graph, is the reference (the same values to float
rounding; the only form before 2026-11-26). The memory starts from its learned initial weights for
every sequence (batch row) and carries its state from chunk to chunk. With `self_modify` the q/k/v and gate
projections are linear memories of each sequence too, written by the same rule (HOPE's self-modifying Titans;
chunk by chunk, as the projections of a chunk's keys depend on the chunks before).

Source: Nested Learning (Behrouz, Razaviyayn, Zhong, Mirrokni), building on Titans: Learning to Memorize at
Test Time (Behrouz, Zhong, Mirrokni).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from forgetless.errors import ForgetlessError


@dataclass
class TitansConfig:
    heads: int = field(default=2, metadata={"help": "memory heads (each its own MLP over width / heads dims)"})
    width: int = field(default=0, metadata={
        "help": "the memory's width: q, k, v have `width` dims, split over the heads (0: the block's width d; a "
                "HOPE retrofit on a transformers model sizes it from retrofit_size)"})
    mem_mult: int = field(default=2, metadata={"help": "hidden width of each memory MLP = mem_mult * head dim"})
    chunk: int = field(default=16, metadata={
        "help": "tokens per write: a chunk's gradients are taken together at its starting weights"})
    conv: int = field(default=4, metadata={"help": "kernel of the causal depthwise conv on q, k, v (0: none)"})
    eta_init: float = field(default=0.01, metadata={"help": "initial write rate eta = softplus(bias)"})
    alpha_init: float = field(default=0.99, metadata={"help": "initial retention alpha = sigmoid(bias)"})
    momentum: bool = field(default=True, metadata={"help": "momentum on the writes (mu = sigmoid(.))"})
    momentum_init: float = field(default=0.9, metadata={"help": "initial momentum mu = sigmoid(bias)"})
    self_modify: bool = field(default=False, metadata={
        "help": "the q/k/v and gate projections are memories too, written per chunk from self-generated targets"})
    backprop_writes: bool = field(default=False, metadata={
        "help": "backpropagate through the writes (keys, values, the written memory); false: the surprise is a "
                "constant and only the gates eta, alpha, mu and the decayed state carry gradient"})

    def __post_init__(self):
        for name in ("heads", "mem_mult", "chunk"):
            if getattr(self, name) <= 0:
                raise ForgetlessError(f"titans {name} must be positive, got {getattr(self, name)}")
        if self.width < 0:
            raise ForgetlessError(f"titans width must be 0 (the block's width) or positive, got {self.width}")
        if self.conv < 0:
            raise ForgetlessError(f"titans conv must be 0 (off) or a kernel size, got {self.conv}")
        if not self.eta_init > 0:
            raise ForgetlessError(f"titans eta_init must be positive, got {self.eta_init}")
        for name in ("alpha_init", "momentum_init"):
            if not 0 < getattr(self, name) < 1:
                raise ForgetlessError(f"titans {name} must be in (0, 1), got {getattr(self, name)}")
        if post := getattr(super(), "__post_init__", None):  # a mixed-in config (CMSConfig in HopeConfig)
            post()


class NeuralMemory(nn.Module):
    """Titans memory as a sequence layer: (B, T, d) -> (B, T, d). `writes = False` freezes the memory at its
    learned initial weights (reads only), e.g. to measure what test-time writes do. `checkpoint = True` keeps
    only x for backward and runs the forward again there: the per-chunk weights (B, H, F, D), four tensors per
    chunk, then exist for one layer at a time instead of for every layer (same values and gradients). `scan`
    picks how the chunks run (SCANS; the same values to float rounding)."""

    def __init__(self, d: int, opts: TitansConfig, bias: bool = True):
        super().__init__()
        w = opts.width or d
        if w % opts.heads:
            raise ForgetlessError(f"titans heads ({opts.heads}) must divide the memory's width ({w}); choose "
                                  "another heads or width")
        if opts.self_modify and w != d:
            raise ForgetlessError(f"titans self_modify writes projections of the block's input: it needs width = d "
                                  f"({d}), got {w}; drop width or self_modify")
        self.cfg, self.writes, self.checkpoint, self.scan = opts, True, False, "parallel"
        H, D = opts.heads, w // opts.heads
        Fh = opts.mem_mult * D
        self.c_qkv = nn.Linear(d, 3 * w, bias=bias)
        self.conv = nn.Conv1d(3 * w, 3 * w, opts.conv, groups=3 * w, padding=opts.conv - 1) if opts.conv else None
        n_gates = 3 if opts.momentum else 2
        self.c_gates = nn.Linear(d, n_gates * H, bias=False)
        inits = [opts.eta_init, opts.alpha_init, opts.momentum_init][:n_gates]
        starts = [math.log(math.expm1(inits[0]))] + [math.log(p / (1 - p)) for p in inits[1:]]
        self.gate_bias = nn.Parameter(torch.tensor(starts).repeat_interleave(H))  # (n_gates * H,)
        self.w1 = nn.Parameter(torch.randn(H, Fh, D) / math.sqrt(D))   # learned initial memory, per head
        self.w2 = nn.Parameter(torch.randn(H, D, Fh) / math.sqrt(Fh))
        self.c_proj = nn.Linear(w, d, bias=bias)

    def forward(self, x):  # (B, T, d)
        if self.checkpoint and self.writes and torch.is_grad_enabled():
            return Recompute.apply(self.run, x, *self.parameters())
        return self.run(x)

    def run(self, x):  # (B, T, d)
        B, T, _ = x.shape
        if self.cfg.self_modify and self.writes:
            return self.c_proj(self.self_modifying(x))
        qkv = self.c_qkv(x)  # (B, T, 3w)
        if self.conv is not None:
            qkv = self.conv(qkv.transpose(1, 2))[..., :T].transpose(1, 2)  # causal: left context only
        q, k, v, eta, alpha, mu = self.split(qkv, self.c_gates(x) + self.gate_bias)
        chunk = self.cfg.chunk if self.writes else T
        y = memory_scan(q, k, v, eta, alpha, mu, self.w1, self.w2, chunk, self.cfg.backprop_writes,
                        self.scan)  # (B, H, T, D)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, -1))  # (B, T, w) -> (B, T, d)

    def split(self, qkv, gates):
        """(B, T, 3w) after the conv, (B, T, n_gates H) pre-activations -> q, k, v (B, H, T, D), gates (B, H, T)."""
        B, T, _ = qkv.shape
        H = self.cfg.heads
        q, k, v = F.silu(qkv).view(B, T, 3, H, -1).permute(2, 0, 3, 1, 4)  # each (B, H, T, D)
        gates = gates.view(B, T, -1, H).permute(2, 0, 3, 1)  # (n_gates, B, H, T)
        mu = torch.sigmoid(gates[2]) if self.cfg.momentum else None
        return F.normalize(q, dim=-1), F.normalize(k, dim=-1), v, F.softplus(gates[0]), torch.sigmoid(gates[1]), mu

    def self_modifying(self, x):  # (B, T, d) -> reads (B, T, d)
        """The q/k/v and gate projections as linear memories of each sequence, written chunk by chunk with the
        memory's keys k_t and their own outputs on the values, P(v_t) (a constant), as targets (DESIGN §2.4)."""
        B, T, d = x.shape
        K = self.cfg.conv
        P0 = [self.c_qkv.weight, self.c_gates.weight]  # learned projections: (3d, d), (n_gates H, d)
        P, S = [w.expand(B, *w.shape) for w in P0], [None, None]
        W1, W2 = self.w1.expand(B, *self.w1.shape), self.w2.expand(B, *self.w2.shape)
        S1 = S2 = None
        tail = x.new_zeros(B, max(K - 1, 0), 3 * d)  # the conv's left context from the chunks before
        reads = []
        for start in range(0, T, self.cfg.chunk):
            xn = x[:, start:start + self.cfg.chunk]  # (B, C, d)
            qkv = xn @ P[0].transpose(-1, -2)
            if self.c_qkv.bias is not None:
                qkv = qkv + self.c_qkv.bias
            if self.conv is not None:
                seq = torch.cat([tail, qkv], dim=1)  # (B, K-1+C, 3d)
                tail = seq[:, seq.shape[1] - (K - 1):]
                qkv = F.conv1d(seq.transpose(1, 2), self.conv.weight, self.conv.bias, groups=3 * d).transpose(1, 2)
            q, k, v, eta, alpha, mu = self.split(qkv, xn @ P[1].transpose(-1, -2) + self.gate_bias)
            reads.append(mlp(W1, W2, q))
            if start + self.cfg.chunk < T:
                W1, W2, S1, S2 = write(W1, W2, S1, S2, k, v, eta, alpha, mu, self.cfg.backprop_writes)
                keys = k.transpose(1, 2).flatten(2) / math.sqrt(self.cfg.heads)  # (B, C, d), unit norm
                values = v.transpose(1, 2).flatten(2)
                gates = [g.mean(1) if g is not None else None for g in (eta, alpha, mu)]  # (B, C): heads share
                for i in range(2):
                    P[i], S[i] = write_linear(P[i], P0[i], S[i], keys, values, *gates, self.cfg.backprop_writes)
        return torch.cat(reads, dim=2).transpose(1, 2).reshape(B, T, d)


class Recompute(torch.autograd.Function):
    """y = fn(x), keeping only x for backward: the forward runs without a graph, and again with one in backward
    (activation checkpointing). The parameters are inputs, so they get gradients even when x needs none (the
    first retrofitted layer). Not torch.utils.checkpoint: its non-reentrant form records the forward's graph,
    whose nodes kept glibc from reusing the freed chunk states (6.5 GB RSS after four SmolLM2-wide layers)."""

    @staticmethod
    def forward(ctx, fn, x, *params):
        ctx.fn, ctx.params = fn, params
        ctx.save_for_backward(x)
        return fn(x)

    @staticmethod
    def backward(ctx, grad):
        x, = ctx.saved_tensors
        needs = ctx.needs_input_grad[1:]
        with torch.enable_grad():
            x = x.detach().requires_grad_(needs[0])
            y = ctx.fn(x)
        wanted = [t for t, need in zip((x, *ctx.params), needs) if need]
        grads = iter(torch.autograd.grad(y, wanted, grad, allow_unused=True))
        return None, *(next(grads) if need else None for need in needs)


SCANS = ("parallel", "sequential")


def memory_scan(q, k, v, eta, alpha, mu, w1, w2, chunk: int, backprop_writes: bool = False, scan: str = "parallel"):
    """Reads of the memory written chunk by chunk. q, k, v (B, H, T, D); eta, alpha, mu (B, H, T) (mu None: no
    momentum); w1 (H, F, D), w2 (H, D, F) the initial weights. Returns the reads M_{chunk start}(q_t), (B, H, T, D).
    `scan`: "parallel" (`parallel_scan`) or "sequential" (`sequential_scan`, the reference), the same math;
    backprop_writes needs the graph through every chunk's surprise and always runs sequentially."""
    check_scan(scan, "titans")
    if q.shape[2] <= chunk:  # one chunk: nothing is written before it is read
        return mlp(w1, w2, q)
    if backprop_writes or scan == "sequential":
        return sequential_scan(q, k, v, eta, alpha, mu, w1, w2, chunk, backprop_writes)
    return parallel_scan(q, k, v, eta, alpha, mu, w1, w2, chunk)


def check_scan(scan: str, owner: str):
    if scan not in SCANS:
        raise ForgetlessError(f"{owner} scan must be one of {', '.join(SCANS)}, got {scan!r}")


def sequential_scan(q, k, v, eta, alpha, mu, w1, w2, chunk: int, backprop_writes: bool = False):
    """The reference: one chunk at a time, its reads, then its write (`write`), all in the graph."""
    B, H, T, D = q.shape
    W1, W2 = w1.expand(B, *w1.shape), w2.expand(B, *w2.shape)  # (B, H, F, D), (B, H, D, F)
    S1 = S2 = None
    reads = []
    for start in range(0, T, chunk):
        part = slice(start, start + chunk)
        reads.append(mlp(W1, W2, q[:, :, part]))
        if start + chunk < T:  # the last chunk is only read
            W1, W2, S1, S2 = write(W1, W2, S1, S2, k[:, :, part], v[:, :, part], eta[..., part], alpha[..., part],
                                   None if mu is None else mu[..., part], backprop_writes)
    return torch.cat(reads, dim=2)


def parallel_scan(q, k, v, eta, alpha, mu, w1, w2, chunk: int):
    """`sequential_scan` with stop-gradient writes, the graph taken apart. Batched over all chunks: the gates'
    coefficients (in closed form, `coefficients`) and, after the writes, every chunk's reads. Chunk by chunk
    (`Writes`): each chunk's surprise at the weights the chunks before it wrote and its write, the one step that
    must wait for the previous chunk, a few whole-matrix ops per chunk with no graph, and its adjoint in backward."""
    B, H, T, D = q.shape
    N = -(-T // chunk) - 1  # chunks that write: all but the last (maybe partial) one, which is only read

    def chunks(t, n=N):  # (B, H, T, ...) -> (n, B, H, C, ...): chunk-major, so that each chunk is contiguous
        return None if t is None else t[:, :, :n * chunk].unflatten(2, (n, chunk)).movedim(2, 0).contiguous()
    eta, alpha, mu = map(chunks, (eta, alpha, mu))  # (N, B, H, C)
    c, decay, carry, keep, m = coefficients(eta, alpha, mu)  # (N, B, H, C), (N, B, H): at the unscaled rates
    W1, W2 = Writes.apply(c, m, gain(eta, mu), decay, carry, keep, w1.expand(B, *w1.shape),
                          w2.expand(B, *w2.shape), chunks(k.detach()), chunks(v.detach()))  # (N+1, B, H, ., .)
    reads = mlp(W1, W2, chunks(F.pad(q, (0, 0, 0, (N + 1) * chunk - T)), N + 1))  # (N+1, B, H, C, D)
    return reads.movedim(0, 2).flatten(2, 3)[:, :, :T]


class Writes(torch.autograd.Function):
    """The weights each chunk reads, W_0 = the initial ones and W_{n+1} = decay_n W_n + carry_n S_n - s_n G_n,
    S_{n+1} = keep_n S_n - s_n M_n (S_0 = 0), with G_n = sum_t c_t grad_t and M_n = sum_t m_t grad_t over chunk
    n's tokens, grad_t the gradient of its loss at W_n (`surprise`, a constant: the writes are stop-gradient) and
    s_n = 1 / max(1, rho_n), rho_n = sum_t gains_t curv_t (`step_scale`). Each weight matrix's state X = [W; S]
    (K = 2 with momentum, [W] without) goes to A_n X - s_n [G; M], A_n = [[decay, carry], [0, keep]]. Forward and
    backward (the adjoint, run backwards) are a few ops per chunk into preallocated stacks, without a graph.
    c, m, gains (N, B, H, C); decay, carry, keep (N, B, H) (m, carry, keep None: no momentum); W1 (B, H, F, D),
    W2 (B, H, D, F); k, v (N, B, H, C, D), not differentiated -> W_0..W_N for W1 (N+1, B, H, F, D) and W2."""

    @staticmethod
    def forward(ctx, c, m, gains, decay, carry, keep, W1, W2, k, v):
        N, B, H = decay.shape
        K = 1 if m is None else 2
        wide = torch.promote_types(torch.promote_types(W1.dtype, decay.dtype), c.dtype)  # as sequential_scan's W
        Xs = [W.new_zeros((N + 1, B, H, K, *W.shape[2:]), dtype=wide) for W in (W1, W2)]  # (N+1, B, H, K, ., .)
        Xs[0][0, :, :, 0], Xs[1][0, :, :, 0] = W1, W2
        cm = c[..., None] if m is None else torch.stack([c, m], -1)  # (N, B, H, C, K)
        diag = decay[..., None] if m is None else torch.stack([decay, keep], -1)  # (N, B, H, K)
        pieces, rhos = [], []
        carries = [None] * N if m is None else carry[..., None, None].unbind(0)
        for n, (kn, vn, cmn, gn, dn, cn) in enumerate(zip(k, v, cm, gains, diag[..., None, None], carries)):
            dz, err, a, curv = surprise(Xs[0][n, :, :, 0], Xs[1][n, :, :, 0], kn, vn)
            rhos.append((gn * curv).sum(-1))  # (B, H)
            w = cmn * rhos[-1].clamp_min(1).reciprocal()[..., None, None]  # (B, H, C, K): s c_t, s m_t
            for X, GM in zip(Xs, (spread(w, dz, kn), spread(w, err, a))):
                torch.mul(X[n], dn, out=X[n + 1])  # decay W, keep S
                if K == 2:
                    X[n + 1, :, :, 0].addcmul_(X[n, :, :, 1], cn)  # + carry S
                X[n + 1].sub_(GM)
            pieces.append((dz, err, a, curv))
        ctx.save_for_backward(cm, diag, carry, torch.stack(rhos), k, *Xs, *(torch.stack(t) for t in zip(*pieces)))
        return Xs[0][:, :, :, 0], Xs[1][:, :, :, 0]

    @staticmethod
    def backward(ctx, grad1, grad2):  # (N+1, B, H, F, D), (N+1, B, H, D, F)
        cm, diag, carry, rho, k, X1s, X2s, dz, err, a, curv = ctx.saved_tensors
        k, dz, err, a = (t.to(X1s.dtype) for t in (k, dz, err, a))  # the surprises may be autocast's bf16
        N, B, H, K = diag.shape
        s = rho.clamp_min(1).reciprocal()  # (N, B, H)
        ds_drho = torch.where(rho >= 1, -s.square(), torch.zeros_like(s))  # as clamp_min passes the gradient
        d_cm, d_gains, d_A = torch.empty_like(cm), torch.empty_like(curv), diag.new_empty((N, B, H, K, K))
        lams = [X.new_zeros(X.shape[1:]) for X in (X1s, X2s)]  # d loss / d X_{n+1}: (B, H, K, ., .)
        for lam, g in zip(lams, (grad1, grad2)):
            lam[:, :, 0] = g[-1]
        for n in reversed(range(N)):
            dn = diag[n, ..., None, None]  # (B, H, K, 1, 1)
            # <lam_i, grad_t> for each state i and token t: (B, H, C, K)
            u = along(lams[0], k[n], dz[n]) + along(lams[1], a[n], err[n])
            d_cm[n] = -s[n, ..., None, None] * u
            d_gains[n] = (-(cm[n] * u).sum((-1, -2)) * ds_drho[n])[..., None] * curv[n]
            d_A[n] = sum(lam.flatten(-2) @ X[n].flatten(-2).transpose(-1, -2) for lam, X in zip(lams, (X1s, X2s)))
            for lam, g in zip(lams, (grad1, grad2)):  # lam <- A^T lam + [d loss / d W_n (its reads); 0]
                if K == 2:
                    lam[:, :, 1].mul_(dn[:, :, 1]).addcmul_(lam[:, :, 0], carry[n, ..., None, None])
                lam[:, :, 0].mul_(dn[:, :, 0]).add_(g[n])
        d_c, d_m = d_cm[..., 0], d_cm[..., 1] if K == 2 else None
        d_decay, d_carry, d_keep = d_A[..., 0, 0], *((d_A[..., 0, 1], d_A[..., 1, 1]) if K == 2 else (None, None))
        return d_c, d_m, d_gains, d_decay, d_carry, d_keep, lams[0][:, :, 0], lams[1][:, :, 0], None, None


def spread(w, x, y):
    """sum_t w_ti x_t y_t^T for each i: w (..., C, K), x (..., C, m), y (..., C, n) -> (..., K, m, n), one matmul."""
    wx = (w[..., :, None] * x[..., None, :]).flatten(-2)  # (..., C, K m)
    return (wx.transpose(-1, -2) @ y).unflatten(-2, (w.shape[-1], x.shape[-1]))


def along(lam, x, g):
    """<lam_i, g_t x_t^T> for each state i and token t: lam (..., K, m, n), x (..., C, n), g (..., C, m) ->
    (..., C, K)."""
    proj = (x @ lam.flatten(-3, -2).transpose(-1, -2)).unflatten(-1, lam.shape[-3:-1])  # (..., C, K, m)
    return (proj * g[..., None, :]).sum(-1)


def mlp(W1, W2, x):  # W1 (..., F, D), W2 (..., D, F), x (..., C, D) -> (..., C, D)
    return x + F.gelu(x @ W1.transpose(-1, -2)) @ W2.transpose(-1, -2)


def write(W1, W2, S1, S2, k, v, eta, alpha, mu, backprop_writes: bool):
    """One chunk's write: the per-token gradients of ||M(k_t) - v_t||^2 at the chunk's starting weights (closed
    form), combined by the gates' products. k, v (B, H, C, D); eta, alpha, mu (B, H, C). Returns W1, W2, S1, S2."""
    U1, U2 = (W1, W2) if backprop_writes else (W1.detach(), W2.detach())
    if not backprop_writes:
        k, v = k.detach(), v.detach()
    dz, err, a, curv = surprise(U1, U2, k, v)
    c, decay, carry, keep, m = coefficients(eta * step_scale(gain(eta, mu), curv), alpha, mu)
    G1, G2, M1, M2 = chunk_write(c, m, dz, k, err, a)
    W1, S1 = advance(W1, S1, decay, carry, keep, G1, M1)
    W2, S2 = advance(W2, S2, decay, carry, keep, G2, M2)
    return W1, W2, S1, S2


def surprise(W1, W2, k, v):
    """A chunk's gradient pieces of loss_t = ||M(k_t) - v_t||^2 at W1 (..., F, D), W2 (..., D, F) in closed form:
    grad_W1 = dz_t k_t^T, grad_W2 = err_t a_t^T. k, v (..., C, D) -> dz (..., C, F), err (..., C, D), a (..., C, F)
    and curv (..., C), the bound 2 (|a|^2 + |k|^2 |W2 diag(GELU'(z))|_F^2) >= the top eigenvalue of the Gauss-Newton
    matrix of loss_t."""
    z = k @ W1.transpose(-1, -2)                                     # (..., C, F)
    a, slope = F.gelu(z), gelu_grad(z)
    err = 2 * (k + a @ W2.transpose(-1, -2) - v)                     # (..., C, D): d loss / d M(k)
    dz = (err @ W2) * slope                                          # (..., C, F)
    curv = 2 * (a.square().sum(-1) + k.square().sum(-1) * (slope.square() @ W2.square().sum(-2)[..., None])[..., 0])
    return dz, err, a, curv


def chunk_write(c, m, dz, k, err, a):
    """sum_t c_t grad_t for W1 and W2 (G1, G2), and with m for the momentum (M1, M2; None without momentum).
    c, m (..., C); dz, k, err, a (..., C, .)."""
    M = (None, None) if m is None else (weighted(m, dz, k), weighted(m, err, a))
    return weighted(c, dz, k), weighted(c, err, a), *M


def advance(W, S, decay, carry, keep, G, M):
    """One chunk of the gated recurrence in closed form (`coefficients`): W' = decay W + carry S - G and
    S' = keep S - M; S None for zero (the first chunk), M None without momentum. Gates (B, H) or (.., B, H)
    broadcast over W's last dims."""
    decay, carry, keep = (None if g is None else g.view(*g.shape, *[1] * (W.dim() - g.dim()))
                          for g in (decay, carry, keep))
    W = decay * W - G
    if M is None:
        return W, None
    if S is None:
        return W, -M
    return W + carry * S, keep * S - M


def write_linear(P, P0, S, keys, values, eta, alpha, mu, backprop_writes: bool):
    """A chunk's write of a linear memory P (B, out, d) with keys (B, C, d) and self-generated targets P(values),
    a constant: the same gated scan as `write`, retention pulling P back to its learned start P0 (out, d)."""
    U = P if backprop_writes else P.detach()
    k = keys if backprop_writes else keys.detach()
    err = 2 * (k @ U.transpose(-1, -2) - (values @ P.transpose(-1, -2)).detach())  # (B, C, out)
    c, decay, carry, keep, m = coefficients(eta * step_scale(gain(eta, mu), 2 * k.square().sum(-1)), alpha, mu)
    P, S = advance(P - P0, S, decay, carry, keep, weighted(c, err, k), None if m is None else weighted(m, err, k))
    return P0 + P, S


def gain(eta, mu):
    """Each token's rate with what its momentum adds in later chunks, eta / (1 - mu) (eta without momentum)."""
    return eta if mu is None else eta / (1 - mu).clamp_min(1e-6)


def step_scale(gains, curv):
    """The chunk's write rates scaled so that rho = sum_t gain_t curv_t <= 1 (`gain`): each token's step with what
    momentum adds in later chunks, times its curvature bound. At rho <= 1 the chunked scan of a quadratic loss
    is stable for any chunk, momentum and retention (DESIGN §2.4); below 1 the rates are unchanged.
    gains, curv (..., C) -> (..., 1)."""
    return 1 / (gains * curv).sum(-1, keepdim=True).clamp_min(1)


def coefficients(eta, alpha, mu):
    """The scan over a chunk in closed form: with S_i = mu_i S_{i-1} - eta_i g_i and W_i = alpha_i W_{i-1} + S_i,
    W_C = decay W_0 + carry S_0 - sum_l c_l g_l and S_C = keep S_0 - sum_l m_l g_l. All (B, H, C) or (B, H),
    computed in at least float32 (sums of logs) and returned in the gates' dtype."""
    dtype = eta.dtype
    wide = torch.promote_types(dtype, torch.float32)
    eta = eta.to(wide)
    la = torch.cumsum(torch.log(alpha.to(wide)), -1)                 # (B, H, C): log prod_{j<=i} alpha_j
    after = la[..., -1:] - la                                        # log prod_{j>i} alpha_j
    decay = la[..., -1].exp()
    if mu is None:
        return (eta * after.exp()).to(dtype), decay.to(dtype), None, None, None
    lm = torch.cumsum(torch.log(mu.to(wide)), -1)
    C = eta.shape[-1]
    causal = torch.ones(C, C, dtype=torch.bool, device=eta.device).tril()  # [i, l]: i >= l
    paths = (after + lm)[..., :, None] - lm[..., None, :]             # (B, H, C_i, C_l)
    c = eta * paths.masked_fill(~causal, float("-inf")).exp().sum(-2)
    carry = (after + lm).exp().sum(-1)
    keep = lm[..., -1].exp()
    m = eta * (lm[..., -1:] - lm).exp()
    return tuple(t.to(dtype) for t in (c, decay, carry, keep, m))


def weighted(c, a, b):
    """sum_t c_t a_t b_t^T over a chunk: c (..., C), a (..., C, m), b (..., C, n) -> (..., m, n), one matmul."""
    return (c[..., None] * a).transpose(-1, -2) @ b


def gelu_grad(z):
    """d GELU(z) / dz for the exact (erf) GELU."""
    return 0.5 * (1 + torch.erf(z / math.sqrt(2))) + z * torch.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)
