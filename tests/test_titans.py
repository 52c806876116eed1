"""Titans memory and HOPE: the chunked write rule against a token-by-token reference, state across chunks and
sequences, stop-gradient writes, a HOPE base through `forgetless bench`, and methods attached to it."""

import pytest
import torch
import torch.nn.functional as F

from forgetless.nn.titans import NeuralMemory, TitansConfig, memory_scan

B, H, T, D, Fh = 2, 2, 11, 4, 6


def reference(q, k, v, eta, alpha, mu, w1, w2, chunk, backprop_writes):
    """Token by token: each token's gradient of ||M(k) - v||^2 by autograd at its chunk's starting weights, then
    S = mu S - eta g; W = alpha W + S one token at a time; chunk n reads the weights chunks < n left. Without
    `backprop_writes` the gradients g are constants (taken on detached k, v, W); the gates and W stay in the graph."""
    out = torch.zeros_like(q)
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            W = [w1[h], w2[h]]
            S = [torch.zeros_like(w1[h]), torch.zeros_like(w2[h])]
            for start in range(0, q.shape[2], chunk):
                W0 = W
                for t in range(start, min(start + chunk, q.shape[2])):
                    x = q[b, h, t]
                    out[b, h, t] = x + W0[1] @ F.gelu(W0[0] @ x)
                for t in range(start, min(start + chunk, q.shape[2])):
                    kt, vt = (k[b, h, t], v[b, h, t]) if backprop_writes else (k[b, h, t].detach(), v[b, h, t].detach())
                    Wg = W0 if backprop_writes else [w.detach().requires_grad_() for w in W0]
                    loss = (kt + Wg[1] @ F.gelu(Wg[0] @ kt) - vt).square().sum()
                    g = torch.autograd.grad(loss, Wg, create_graph=backprop_writes)
                    m = mu[b, h, t] if mu is not None else 0.0
                    S = [m * s - eta[b, h, t] * gi for s, gi in zip(S, g)]
                    W = [alpha[b, h, t] * w + s for w, s in zip(W, S)]
    return out


def inputs(momentum=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (F.normalize(torch.randn(B, H, T, D, generator=g), dim=-1) for _ in range(2))
    v = torch.randn(B, H, T, D, generator=g)
    eta = 0.1 + 0.3 * torch.rand(B, H, T, generator=g)
    alpha = 0.8 + 0.2 * torch.rand(B, H, T, generator=g)
    mu = 0.5 + 0.4 * torch.rand(B, H, T, generator=g) if momentum else None
    w1 = torch.randn(H, Fh, D, generator=g) / 2
    w2 = torch.randn(H, D, Fh, generator=g) / 2
    tensors = [q, k, v, eta, alpha, mu, w1, w2]
    return [t.double().requires_grad_() if t is not None else None for t in tensors]


@pytest.mark.parametrize("chunk", [1, 3, 4, 11, 16])
@pytest.mark.parametrize("momentum", [True, False])
@pytest.mark.parametrize("backprop_writes", [False, True])
def test_chunked_writes_match_token_by_token_reference(chunk, momentum, backprop_writes):
    args = inputs(momentum)
    leaves = [t for t in args if t is not None]
    got = memory_scan(*args, chunk, backprop_writes)
    want = reference(*args, chunk, backprop_writes)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)
    w = torch.randn_like(got)
    g_got = torch.autograd.grad((got * w).sum(), leaves, allow_unused=True)
    g_want = torch.autograd.grad((want * w).sum(), leaves, allow_unused=True)
    for a, b in zip(g_got, g_want):
        if a is None or b is None:
            assert (a is None or not a.any()) and (b is None or not b.any())
        else:
            torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)


def test_writes_leak_no_gradient_unless_asked():
    q, k, v, eta, alpha, mu, w1, w2 = inputs()
    for backprop_writes in (False, True):
        out = memory_scan(q, k, v, eta, alpha, mu, w1, w2, 4, backprop_writes)
        gk, gv, geta, gq = torch.autograd.grad(out.square().sum(), [k, v, eta, q], allow_unused=True)
        leaked = gk is not None and gk.abs().sum() > 0 and gv is not None and gv.abs().sum() > 0
        assert leaked == backprop_writes
        assert geta.abs().sum() > 0 and gq.abs().sum() > 0  # the gates learn; reads are differentiable


def test_state_carries_across_chunks_and_resets_between_sequences():
    torch.manual_seed(0)
    mem = NeuralMemory(8, TitansConfig(heads=2, chunk=4, conv=0)).double()
    with torch.no_grad():
        mem.gate_bias[:2] = 1.0  # write hard enough to see
    x = torch.randn(3, 12, 8, dtype=torch.double)
    y = mem(x)
    x2 = x.clone()
    x2[0, :4] += 1.0  # change the first chunk of row 0
    y2 = mem(x2)
    assert (y2[0, 4:] - y[0, 4:]).abs().max() > 1e-4  # later chunks read what chunk 0 wrote
    torch.testing.assert_close(y2[1:], y[1:])  # other rows (sequences) are untouched
    torch.testing.assert_close(mem(x[1:2]), y[1:2])  # each sequence starts from the learned initial memory
    mem.writes = False  # reads only: no chunk depends on another
    y3, y4 = mem(x), mem(x2)
    torch.testing.assert_close(y3[0, 4:], y4[0, 4:])
    assert (y3[0, 4:] - y[0, 4:]).abs().max() > 1e-4


def test_memory_is_causal():
    torch.manual_seed(0)
    mem = NeuralMemory(8, TitansConfig(heads=2, chunk=3, conv=4))
    x = torch.randn(2, 10, 8)
    x2 = x.clone()
    x2[:, 6:] = torch.randn(2, 4, 8)
    torch.testing.assert_close(mem(x)[:, :6], mem(x2)[:, :6])


def test_bad_titans_options_are_one_line_errors():
    from forgetless.errors import ForgetlessError
    with pytest.raises(ForgetlessError, match="chunk must be positive"):
        TitansConfig(chunk=0)
    with pytest.raises(ForgetlessError, match="must divide d_model"):
        NeuralMemory(10, TitansConfig(heads=4))
