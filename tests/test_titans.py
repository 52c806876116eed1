"""Titans memory and HOPE: the chunked write rule against a token-by-token reference, state across chunks and
sequences, stop-gradient writes, a HOPE base through `forgetless bench`, and methods attached to it."""

import json

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

import forgetless
from forgetless.cli import app
from forgetless.loss import training_loss
from forgetless.data.splits import Sampler
from forgetless.errors import ForgetlessError
from forgetless.methods import build_method
from forgetless.models.gpt import GPT, GPTConfig
from forgetless.nn.hope import HOPE
from forgetless.nn.titans import NeuralMemory, TitansConfig, gain, memory_scan, surprise, write
from forgetless.train import TrainConfig, train

B, H, T, D, Fh = 2, 2, 11, 4, 6


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors and many small ops: one thread is faster, and far faster on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def reference(q, k, v, eta, alpha, mu, w1, w2, chunk, backprop_writes):
    """Token by token: each token's gradient of ||M(k) - v||^2 by autograd at its chunk's starting weights, then
    S = mu S - scale eta g; W = alpha W + S one token at a time; chunk n reads the weights chunks < n left; scale
    = 1 / max(1, rho), rho the chunk's step times curvature bound, from GELU' by autograd. Without
    `backprop_writes` the gradients g are constants (taken on detached k, v, W); the gates and W stay in the graph."""
    out = torch.zeros_like(q)
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            W = [w1[h], w2[h]]
            S = [torch.zeros_like(w1[h]), torch.zeros_like(w2[h])]
            for start in range(0, q.shape[2], chunk):
                W0 = W
                tokens = range(start, min(start + chunk, q.shape[2]))
                for t in tokens:
                    x = q[b, h, t]
                    out[b, h, t] = x + W0[1] @ F.gelu(W0[0] @ x)
                rho = 0.0  # sum_t eta_t / (1 - mu_t) * 2 (|a_t|^2 + |k_t|^2 sum_f GELU'(z_tf)^2 |W2[:, f]|^2)
                for t in tokens:
                    kt = k[b, h, t] if backprop_writes else k[b, h, t].detach()
                    W1t, W2t = W0 if backprop_writes else [w.detach() for w in W0]
                    z = (W1t @ kt).requires_grad_()
                    slope, = torch.autograd.grad(F.gelu(z).sum(), z, create_graph=backprop_writes)
                    w1_block = kt.square().sum() * (slope.square() * W2t.square().sum(0)).sum()
                    curv = 2 * (F.gelu(z).square().sum() + w1_block)
                    rho = rho + eta[b, h, t] / (1 - (mu[b, h, t] if mu is not None else 0.0)) * curv
                scale = 1 / torch.clamp(rho, min=1)
                for t in tokens:
                    kt, vt = (k[b, h, t], v[b, h, t]) if backprop_writes else (k[b, h, t].detach(), v[b, h, t].detach())
                    Wg = W0 if backprop_writes else [w.detach().requires_grad_() for w in W0]
                    loss = (kt + Wg[1] @ F.gelu(Wg[0] @ kt) - vt).square().sum()
                    g = torch.autograd.grad(loss, Wg, create_graph=backprop_writes)
                    m = mu[b, h, t] if mu is not None else 0.0
                    S = [m * s - scale * eta[b, h, t] * gi for s, gi in zip(S, g)]
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


def assert_same_gradients(got, want, leaves, rtol, atol):
    """got and want have the same gradients with respect to every leaf (a leaf neither reaches counts as zero)."""
    w = torch.randn_like(got)
    g_got = torch.autograd.grad((got * w).sum(), leaves, allow_unused=True, retain_graph=True)
    g_want = torch.autograd.grad((want * w).sum(), leaves, allow_unused=True, retain_graph=True)
    for a, b in zip(g_got, g_want):
        if a is None or b is None:
            assert (a is None or not a.any()) and (b is None or not b.any())
        else:
            torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


@pytest.mark.parametrize("chunk", [1, 3, 4, 11, 16])
@pytest.mark.parametrize("momentum", [True, False])
@pytest.mark.parametrize("backprop_writes", [False, True])
def test_chunked_writes_match_token_by_token_reference(chunk, momentum, backprop_writes):
    """Both forms (backprop_writes runs the sequential one) against the token-by-token reference, T = 11 tokens:
    one chunk, chunks that divide T and chunks that leave a partial last one; batch 2, heads 2."""
    args = inputs(momentum)
    leaves = [t for t in args if t is not None]
    want = reference(*args, chunk, backprop_writes)
    for scan in ("parallel", "sequential"):
        got = memory_scan(*args, chunk, backprop_writes, scan)
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)
        assert_same_gradients(got, want, leaves, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("momentum", [True, False])
def test_parallel_form_equals_the_sequential_one_in_float32(momentum):
    """The memory module at its default width ratio, in float32: 37 tokens in chunks of 4, 5, 8 and 16 (none
    divides 37), batch 3, heads 2, writes hard enough to matter; the reads and every gradient (parameters and
    input) agree to float rounding."""
    torch.manual_seed(0)
    x = torch.randn(3, 37, 16)
    for chunk in (4, 5, 8, 16):
        mem = NeuralMemory(16, TitansConfig(heads=2, chunk=chunk, momentum=momentum))
        with torch.no_grad():
            mem.gate_bias[:2] = 1.0  # eta = softplus(1) ~ 1.3: the step scale is active
        runs = []
        for scan in ("parallel", "sequential"):
            mem.scan = scan
            mem.zero_grad()
            xi = x.clone().requires_grad_()
            y = mem(xi)
            (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
            runs.append([y.detach(), xi.grad, *(p.grad for p in mem.parameters())])
        mem.writes = False
        with torch.no_grad():
            assert (mem(x) - runs[0][0]).abs().max() > 1e-2  # what the writes change is well above the tolerance
        for parallel, sequential in zip(*runs):
            torch.testing.assert_close(parallel, sequential, rtol=1e-4, atol=1e-5)


def test_parallel_form_runs_under_bf16_autocast_as_the_sequential_one():
    """Under CPU bf16 autocast (--precision bf16) the surprises are bf16 and the weights' stacks stay float32: the
    two forms give the same reads and gradients to bf16 precision."""
    torch.manual_seed(0)
    mem = NeuralMemory(16, TitansConfig(heads=2, chunk=4))
    with torch.no_grad():
        mem.gate_bias[:2] = 1.0
    x = torch.randn(2, 19, 16)
    runs = []
    for scan in ("parallel", "sequential"):
        mem.scan = scan
        mem.zero_grad()
        with torch.autocast("cpu", torch.bfloat16):
            y = mem(x)
        y.float().square().sum().backward()
        runs.append([y.float().detach(), *(p.grad for p in mem.parameters())])
    for parallel, sequential in zip(*runs):
        torch.testing.assert_close(parallel, sequential, rtol=2e-2, atol=2e-2 * sequential.abs().max().item())


@pytest.mark.parametrize("momentum", [True, False])
def test_parallel_gradients_on_both_sides_of_the_step_cap(momentum):
    """The cap s = 1 / max(1, rho) binds in chunk 0 (rho > 1: the gradient also flows through rho) and not in
    chunk 1 (rho < 1); the parallel form's hand-written backward still gives the sequential form's gradients."""
    q, k, v, eta, alpha, mu, w1, w2 = inputs(momentum)
    eta = (eta * torch.tensor([30.0] * 4 + [0.01] * 7, dtype=torch.double)).detach().requires_grad_()
    with torch.no_grad():  # rho of the two chunks that write, at the weights they see
        W1, W2, S1, S2, rho = w1.expand(B, *w1.shape), w2.expand(B, *w2.shape), None, None, []
        for part in (slice(0, 4), slice(4, 8)):
            gates = [eta[..., part], alpha[..., part], None if mu is None else mu[..., part]]
            rho.append((gain(gates[0], gates[2]) * surprise(W1, W2, k[:, :, part], v[:, :, part])[3]).sum(-1))
            W1, W2, S1, S2 = write(W1, W2, S1, S2, k[:, :, part], v[:, :, part], *gates, False)
    assert (rho[0] > 1.5).all() and (rho[1] < 0.5).all()
    args = [q, k, v, eta, alpha, mu, w1, w2]
    got, want = (memory_scan(*args, 4, False, scan) for scan in ("parallel", "sequential"))
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)
    assert_same_gradients(got, want, [t for t in args if t is not None], rtol=1e-8, atol=1e-10)


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


def self_modifying_pair(chunk, conv=4, momentum=True):
    torch.manual_seed(0)
    plain = NeuralMemory(8, TitansConfig(heads=2, chunk=chunk, conv=conv, momentum=momentum)).double()
    selfmod = NeuralMemory(8, TitansConfig(heads=2, chunk=chunk, conv=conv, momentum=momentum,
                                           self_modify=True)).double()
    selfmod.load_state_dict(plain.state_dict())
    with torch.no_grad():
        for m in (plain, selfmod):
            m.gate_bias[:2] = 1.0  # write hard enough to see
    return plain, selfmod


@pytest.mark.parametrize("conv", [0, 1, 4])
def test_self_modifying_projections_change_only_after_the_first_chunk(conv):
    plain, selfmod = self_modifying_pair(chunk=4, conv=conv)
    x = torch.randn(2, 11, 8, dtype=torch.double)
    a, b = plain(x), selfmod(x)
    torch.testing.assert_close(a[:, :4], b[:, :4])  # chunk 0 reads with the learned projections in both
    assert (a[:, 4:] - b[:, 4:]).abs().max() > 1e-4  # later chunks see projections the sequence rewrote
    plain.cfg.chunk = selfmod.cfg.chunk = 11  # one chunk: nothing is written, the two are one layer
    torch.testing.assert_close(plain(x), selfmod(x))


@pytest.mark.parametrize("momentum", [True, False])
def test_self_modifying_memory_is_causal_per_sequence_and_trains(momentum):
    _, mem = self_modifying_pair(chunk=3, momentum=momentum)
    x = torch.randn(3, 10, 8, dtype=torch.double)
    x2 = x.clone()
    x2[0, 6:] += 1.0
    y, y2 = mem(x), mem(x2)
    torch.testing.assert_close(y[:, :6], y2[:, :6])  # no later token is seen
    torch.testing.assert_close(y[1:], y2[1:])  # rows are separate sequences
    torch.testing.assert_close(mem(x[2:]), y[2:])
    y.square().sum().backward()
    assert mem.c_qkv.weight.grad.abs().sum() > 0 and mem.c_gates.weight.grad.abs().sum() > 0


def test_self_modifying_linear_write_matches_token_by_token():
    """write_linear against S = mu S - eta g, P = P0 + alpha (P - P0) + S per token, g at the chunk's start."""
    from forgetless.nn.titans import write_linear
    g = torch.Generator().manual_seed(3)
    Bn, C, d, out = 2, 5, 4, 3
    P0, P, S = torch.randn(out, d, generator=g), torch.randn(Bn, out, d, generator=g), torch.randn(Bn, out, d, generator=g)
    keys, values = torch.randn(Bn, C, d, generator=g), torch.randn(Bn, C, d, generator=g)
    eta, alpha, mu = (0.2 + 0.6 * torch.rand(Bn, C, generator=g) for _ in range(3))
    got_P, got_S = write_linear(P, P0, S, keys, values, eta, alpha, mu, False)
    want_P, want_S = P.clone(), S.clone()
    scale = 1 / (eta / (1 - mu) * 2 * keys.square().sum(-1)).sum(-1).clamp(min=1)  # (B,): 1 / max(1, rho)
    for t in range(C):
        err = keys[:, t:t + 1] @ P.transpose(-1, -2) - values[:, t:t + 1] @ P.transpose(-1, -2)  # (B, 1, out)
        grad = 2 * err.transpose(-1, -2) @ keys[:, t:t + 1]  # (B, out, d)
        want_S = mu[:, t, None, None] * want_S - (scale * eta[:, t])[:, None, None] * grad
        want_P = P0 + alpha[:, t, None, None] * (want_P - P0) + want_S
    torch.testing.assert_close(got_P, want_P)
    torch.testing.assert_close(got_S, want_S)


@pytest.mark.parametrize("self_modify", [False, True])
@pytest.mark.parametrize("x_needs_grad", [True, False])
def test_recomputed_memory_gives_the_same_values_and_gradients(self_modify, x_needs_grad):
    """checkpoint=True keeps only x and runs the forward again in backward: nothing changes, and the
    parameters learn even when x needs no gradient (a retrofitted first layer under a frozen embedding)."""
    torch.manual_seed(0)
    mem = NeuralMemory(8, TitansConfig(heads=2, chunk=3, self_modify=self_modify)).double()
    with torch.no_grad():
        mem.gate_bias[:2] = 1.0  # write hard enough to see
    x = torch.randn(2, 10, 8, dtype=torch.double)
    w = torch.randn(2, 10, 8, dtype=torch.double)
    runs = []
    for checkpoint in (False, True):
        mem.checkpoint = checkpoint
        xi = x.clone().requires_grad_(x_needs_grad)
        y = mem(xi)
        mem.zero_grad()
        (y * w).sum().backward()
        runs.append([y.detach(), xi.grad, *(p.grad.clone() for p in mem.parameters())])
    for kept, recomputed in zip(*runs):
        assert (kept is None) == (recomputed is None) and (kept is None or torch.equal(kept, recomputed))
    assert all(g is not None for g in runs[1][2:])


def test_hope_retrofit_recomputes_its_memories_with_the_same_gradients():
    from tiny_models import hf_llama
    x = torch.randint(0, 256, (2, 13), generator=torch.Generator().manual_seed(1))
    runs = []
    for checkpoint in (False, True):
        adapted = forgetless.attach(hf_llama(), "hope", chunk=4, checkpoint=checkpoint)
        assert all(m.checkpoint == checkpoint for m in adapted.modules() if isinstance(m, NeuralMemory))
        with torch.no_grad():
            for m in adapted.modules():
                if isinstance(m, NeuralMemory):
                    m.c_proj.weight.normal_()  # off zero, so the memory reaches the loss
        adapted.train()
        loss = adapted.loss(x)
        loss.backward()
        runs.append([loss.detach(), *(p.grad for _, p in adapted.trainable_parameters())])
    for kept, recomputed in zip(*runs):
        assert (kept is None) == (recomputed is None) and (kept is None or torch.equal(kept, recomputed))


def test_hope_retrofit_follows_its_size_budget():
    """Beside a transformers model's MLPs the HOPE slots have about retrofit_size x its parameters, about half
    in the memory, whose width (a multiple of heads) is then below the model's; a width given explicitly wins."""
    from tiny_models import hf_llama
    total = sum(p.numel() for p in hf_llama().parameters())
    for size in (0.1, 0.2):
        adapted = forgetless.attach(hf_llama(), "hope", retrofit_size=size)
        memories = [m for m in adapted.modules() if isinstance(m, NeuralMemory)]
        added = sum(p.numel() for _, p in adapted.trainable_parameters())
        in_memory = sum(p.numel() for m in memories for p in m.parameters())
        assert added == pytest.approx(size * total, rel=0.1) and 0.4 < in_memory / added < 0.6
        assert all(0 < m.c_proj.in_features < 32 and m.c_proj.in_features % m.cfg.heads == 0 for m in memories)
    given = forgetless.attach(hf_llama(), "hope", width=8)
    assert {m.c_qkv.out_features for m in given.modules() if isinstance(m, NeuralMemory)} == {24}


def test_a_saved_retrofit_of_another_width_is_a_one_line_error():
    """A HOPE retrofit saved at one memory width (e.g. model-wide, before retrofits were sized) does not load into
    a slot of another width: the error names the tensor, both shapes and the fix, before any tensor is copied."""
    from tiny_models import hf_llama
    saved = forgetless.attach(hf_llama(), "hope", width=8).method_state()
    other = forgetless.attach(hf_llama(), "hope", width=4)
    before = {k: v.clone() for k, v in other.method_state().items()}
    with pytest.raises(ForgetlessError, match=r"has shape .* but the attached hope has .*; attach it with the options"):
        other.method.load_state_dict(other.model, saved)
    assert all(torch.equal(before[k], v) for k, v in other.method_state().items())


@pytest.mark.parametrize("d", [576, 1152])
@pytest.mark.parametrize("eta", [0.01, 3.0])
def test_wide_memory_writes_stay_bounded(d, eta):
    """At d = 576 the plain step diverged (|W1| 27 -> 9.5e18 -> NaN within 11 chunks of unit-scale inputs): the
    write now caps each chunk's step times curvature at 1, so the weights stay bounded at any width and rate."""
    torch.manual_seed(0)
    mem = NeuralMemory(d, TitansConfig(heads=2, mem_mult=2, eta_init=eta))
    x = torch.randn(1, 320, d)  # 20 chunks of 16
    with torch.no_grad():
        qkv = mem.conv(mem.c_qkv(x).transpose(1, 2))[..., :320].transpose(1, 2)
        q, k, v, eta, alpha, mu = mem.split(qkv, mem.c_gates(x) + mem.gate_bias)
        W1, W2, S1, S2 = mem.w1[None], mem.w2[None], None, None
        norms = []
        for start in range(0, 320, 16):
            p = slice(start, start + 16)
            W1, W2, S1, S2 = write(W1, W2, S1, S2, k[:, :, p], v[:, :, p], eta[..., p], alpha[..., p], mu[..., p],
                                   False)
            norms.append(max(W1.norm(), W2.norm()))
        assert max(norms) <= mem.w1.norm() and torch.isfinite(mem(x)).all()


def test_hope_beside_a_wide_llama_gives_finite_loss_and_gradients():
    """SmolLM2's width (576, head dim 64): the retrofitted memories' reads were NaN from token 112 on."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=576, intermediate_size=128, num_hidden_layers=1,
                                         num_attention_heads=9, num_key_value_heads=3, vocab_size=256,
                                         max_position_embeddings=256))
    adapted = forgetless.attach(model, "hope", width=576)  # the memory at the model's width (a retrofit's is narrower)
    with torch.no_grad():
        for m in adapted.modules():
            if isinstance(m, NeuralMemory):
                m.c_proj.weight.normal_(std=0.02)  # off zero, so the memory reaches the loss
    adapted.train()
    loss = adapted.loss(torch.randint(0, 256, (1, 193), generator=torch.Generator().manual_seed(1)))
    loss.backward()
    grads = [p.grad for _, p in adapted.trainable_parameters()]
    assert torch.isfinite(loss) and all(g is not None and torch.isfinite(g).all() for g in grads)


def test_bad_titans_options_are_one_line_errors():
    with pytest.raises(ForgetlessError, match="chunk must be positive"):
        TitansConfig(chunk=0)
    with pytest.raises(ForgetlessError, match="hope scan must be one of parallel, sequential, got 'serial'"):
        build_method("hope", {"scan": "serial"})
    mem = NeuralMemory(8, TitansConfig(heads=2, chunk=2))
    mem.scan = "serial"
    with pytest.raises(ForgetlessError, match="titans scan must be one of parallel, sequential, got 'serial'"):
        mem(torch.randn(1, 5, 8))
    with pytest.raises(ForgetlessError, match="must divide the memory's width"):
        NeuralMemory(10, TitansConfig(heads=4))
    with pytest.raises(ForgetlessError, match="titans width must be 0"):
        TitansConfig(width=-1)
    with pytest.raises(ForgetlessError, match="it needs width = d"):
        NeuralMemory(8, TitansConfig(heads=2, width=4, self_modify=True))


# ---- HOPE as a GPT's FFN slot --------------------------------------------------------------------
SMALL = {"heads": 2, "chunk": 4, "periods": [1, 4]}


def hope_gpt(**options):
    torch.manual_seed(0)
    cfg = build_method("hope", {**SMALL, **options}).base_config(GPTConfig(n_layer=2, n_head=2, d_model=16,
                                                                             block_size=16))
    return GPT(cfg)


def test_hope_bench_pretrains_a_hope_base_and_runs_two_domain(tmp_path):
    result = CliRunner().invoke(app, ["bench", "--preset", "smoke", "--methods", "hope,full", "--seeds", "1",
                                      "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    results = json.loads((tmp_path / "results.json").read_text())
    assert list(results["methods"]) == ["hope", "full"]
    assert {base["ffn"] for base in results["bases"].values()} == {"hope", "dense"}
    hope = results["methods"]["hope"]
    assert hope["method"] == "hope" and hope["ppl_b_after"]["mean"] > 1
    assert 0 < hope["trainable_params"] < hope["total_params"]
    again = CliRunner().invoke(app, ["bench", "--preset", "smoke", "--methods", "hope", "--seeds", "1",
                                     "--out", str(tmp_path / "again")])
    assert again.exit_code == 0 and "pretrain 0 of 2 bases (2 cached)" in again.output  # full is added back


@pytest.mark.parametrize("options", [{}, {"self_modify": True}, {"attention": False}])
def test_hope_training_resumes_exactly(tmp_path, options):
    """Interrupted at step 13 (checkpoint at 10, inside a CMS chunk of 4), resumed: the same run."""
    def setup():
        model = hope_gpt(**options)
        return model, Sampler(torch.arange(2000) % 7, 4, 16, seed=0)
    cfg = TrainConfig(steps=20, batch_size=4, lr=1e-2, warmup=2, eval_every=5, ckpt_every=5)
    model, sampler = setup()
    full = train(model, list(model.named_parameters()), sampler, cfg, training_loss)
    ckpt = tmp_path / "ckpt.safetensors"

    def interrupting(m, b, calls=[0]):
        calls[0] += 1
        if calls[0] == 13:
            raise KeyboardInterrupt
        return training_loss(m, b)
    model2, sampler2 = setup()
    with pytest.raises(KeyboardInterrupt):
        train(model2, list(model2.named_parameters()), sampler2, cfg, interrupting, ckpt_path=ckpt, run_config={})
    model3, sampler3 = setup()
    history = train(model3, list(model3.named_parameters()), sampler3, cfg, training_loss, ckpt_path=ckpt,
                    run_config={})
    assert history.loss == full.loss
    for (n, p), (_, q) in zip(model.named_parameters(), model3.named_parameters()):
        assert torch.equal(p, q), n


@pytest.mark.parametrize("name", ["lora", "ffn", "hope"])
def test_methods_attach_to_a_hope_model(name):
    model = hope_gpt()
    x = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(1))
    model.eval()
    with torch.no_grad():
        before = model(x[:, :-1])
    adapted = forgetless.attach(model, name, **(SMALL if name == "hope" else {}))
    adapted.start_task(1)
    with torch.no_grad():
        torch.testing.assert_close(adapted(x[:, :-1]), before)  # attaching changes nothing
    params = [p for _, p in adapted.trainable_parameters()]
    adapted.train()
    opt = torch.optim.SGD(params, lr=0.1)
    loss = adapted.loss(x)
    loss.backward()
    opt.step()
    assert adapted.loss(x).item() < loss.item()
    names = [n for n, _ in adapted.trainable_parameters()]
    if name == "ffn":
        assert any(".mlp.memory." in n for n in names) and any(".mlp.cms." in n for n in names)
    if name == "lora":
        assert any("mlp.memory.c_proj.lora_" in n for n in names)


@pytest.mark.parametrize("self_modify", [False, True])
def test_hope_forward_and_backward_follow_the_model_device(self_modify):
    """On the meta device any tensor made on the CPU by the memory would fail to combine with the others."""
    with torch.device("meta"):
        model = hope_gpt(self_modify=self_modify)
    logits = model(torch.randint(0, 256, (2, 16)).to("meta"))
    logits.sum().backward()
    assert logits.is_meta and all(p.grad is None or p.grad.is_meta for p in model.parameters())


def test_hope_blocks_without_attention():
    model = hope_gpt(attention=False)
    assert all(b.attn is None and b.ln_1 is None for b in model.transformer.h)
    assert not any(".attn." in n for n, _ in model.named_parameters())
    x = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(1))
    x2 = x.clone()
    x2[:, 9:] = 7
    model.eval()
    torch.testing.assert_close(model(x[:, :-1])[:, :9], model(x2[:, :-1])[:, :9])  # causal through the memory
    adapted = forgetless.attach(model, "lora")  # c_attn is gone; the memory's and levels' linears remain
    assert any("lora_" in n for n, _ in adapted.trainable_parameters())
    from tiny_models import hf_llama
    with pytest.raises(ForgetlessError, match="attention=false needs a forgetless GPT"):
        forgetless.attach(hf_llama(), "hope", attention=False)


def test_hope_method_refuses_another_base_and_writes_can_be_turned_off():
    with pytest.raises(ForgetlessError, match="method hope needs a base with chunk=8 \\(this base: 4\\)"):
        forgetless.attach(hope_gpt(), "hope", **{**SMALL, "chunk": 8})
    with pytest.raises(ForgetlessError, match="periods"):
        forgetless.attach(GPT(GPTConfig(n_layer=1, n_head=2, d_model=16, block_size=16)), "hope")
    adapted = forgetless.attach(hope_gpt(), "hope", **SMALL, writes=False)
    assert all(not m.writes for m in adapted.modules() if isinstance(m, NeuralMemory))
    memories = [m for m in hope_gpt().modules() if isinstance(m, NeuralMemory)]
    assert memories and {m.scan for m in memories} == {"parallel"}  # a HOPE base runs the parallel form
    adapted = forgetless.attach(hope_gpt(), "hope", **SMALL, scan="sequential")
    assert {m.scan for m in adapted.modules() if isinstance(m, NeuralMemory)} == {"sequential"}
    assert sum(isinstance(m, HOPE) for m in adapted.modules()) == 2


def test_hope_report_measures_the_test_time_writes():
    adapted = forgetless.attach(hope_gpt(), "hope", **SMALL)
    windows = torch.randint(0, 256, (3, 17), generator=torch.Generator().manual_seed(2))
    report = adapted.report(windows, windows[:2])
    assert {"memory_gain_a", "memory_gain_b"} <= set(report) and report["memory_gain_a"] != 0
    assert all(m.writes for m in adapted.modules() if isinstance(m, NeuralMemory))  # restored
