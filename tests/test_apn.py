import pytest
import torch
import torch.nn.functional as F

from forgetless.errors import ForgetlessError
from forgetless.models.gpt import GPT, GPTConfig
from forgetless.side import aux_loss
from forgetless.nn.apn import APN, APNConfig

VARIANTS = [{}, {"gate": "scalar"}, {"decoder": "shared"}, {"route_dim": 8}]


def naive_apn(apn: APN, x: torch.Tensor) -> torch.Tensor:
    """The equations of docs/DESIGN.md §2.1, token by token, with a per-token copy of U (slow, clear)."""
    cfg = apn.cfg
    h = apn.route_proj(x) if apn.route_proj is not None else x
    z = F.normalize(h, dim=-1)
    s = z @ F.normalize(apn.prototypes, dim=-1).T / cfg.tau
    top, idx = s.topk(cfg.top_k, dim=-1)
    w = top.softmax(-1)
    u = x @ apn.code
    out = []
    for t in range(x.shape[0]):
        acc = 0
        for j in range(cfg.top_k):
            i = idx[t, j]
            phi = u[t] * torch.sigmoid(apn.gate_a[i] * u[t] + apn.gate_b[i])
            if cfg.decoder == "full":
                U = apn.decoders[i].T                                                   # (d, r)
            else:
                U = apn.base_decoder.T + (apn.offset_in[i] @ apn.offset_out[i]).T
            acc = acc + w[t, j] * (U @ phi)
        out.append(acc)
    return cfg.gamma * torch.stack(out)


@pytest.mark.parametrize("dense", [False, True], ids=["sparse", "dense"])
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: ",".join(f"{k}={x}" for k, x in v.items()) or "default")
def test_dispatch_matches_the_equations(variant, dense):
    torch.manual_seed(0)
    apn = APN(16, APNConfig(n_patches=12, top_k=3, rank=4, **variant)).eval()
    apn.dense = dense
    with torch.no_grad():  # non-trivial gates and offsets
        for p in apn.parameters():
            p.add_(0.3 * torch.randn_like(p))
    x = torch.randn(2, 5, 16, requires_grad=True)
    fast = apn(x)
    slow = naive_apn(apn, x.reshape(-1, 16)).reshape(2, 5, 16)
    assert fast.shape == (2, 5, 16)
    assert torch.allclose(fast, slow, atol=1e-5)
    g_fast = torch.autograd.grad(fast.square().sum(), [x, *apn.parameters()])
    g_slow = torch.autograd.grad(slow.square().sum(), [x, *apn.parameters()], allow_unused=True)
    for a, b in zip(g_fast, g_slow):
        assert torch.allclose(a, torch.zeros_like(a) if b is None else b, atol=1e-4)


@pytest.mark.parametrize("dense", [False, True], ids=["sparse", "dense"])
def test_inactive_patches_get_exactly_zero_gradient(dense):
    torch.manual_seed(0)
    apn = APN(16, APNConfig(n_patches=32, top_k=2, rank=4))
    apn.dense = dense
    x = torch.randn(3, 16)
    apn.record = True
    apn(x).sum().backward()
    active = torch.zeros(32, dtype=torch.bool)
    active[apn.last_routing.index.flatten()] = True
    assert (~active).any()
    assert (apn.decoders.grad[~active] == 0).all() and (apn.gate_a.grad[~active] == 0).all()
    assert (apn.decoders.grad[active].abs().sum(dim=(1, 2)) > 0).all()


def test_regularizers_and_patch_dropout():
    torch.manual_seed(0)
    apn = APN(16, APNConfig(n_patches=8, top_k=2, rank=4, entropy=0.1, patch_dropout=0.5))
    x = torch.randn(64, 16)
    apn.train()
    y1, y2 = apn(x), apn(x)
    assert not torch.equal(y1, y2)  # dropout is random in training
    assert apn.aux_loss is not None and apn.aux_loss > 0
    apn.eval()
    assert torch.equal(apn(x), apn(x)) and apn.aux_loss is None


@pytest.mark.parametrize("variant", VARIANTS + [{"patch_dropout": 0.2}, {"entropy": 0.01}],
                         ids=lambda v: ",".join(f"{k}={x}" for k, x in v.items()) or "default")
def test_apn_as_the_gpt_ffn_trains(variant):
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, d_model=32, block_size=16, ffn="apn",
                          ffn_options={"n_patches": 16, "rank": 8, "top_k": 2, **variant}))
    assert isinstance(model.transformer.h[0].mlp, APN)
    data = (torch.arange(17 * 8) % 5).reshape(8, 17)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(60):
        logits = model(data[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), data[:, 1:].flatten())
        losses.append(loss.item())
        (loss + aux_loss(model)).backward()
        opt.step()
        opt.zero_grad()
    assert losses[-1] < 0.5 * losses[0]


@pytest.mark.parametrize("options,message", [
    ({"top_k": 9, "n_patches": 8}, "apn.top_k \\(9\\) cannot exceed apn.n_patches \\(8\\)"),
    ({"rank": 0}, "apn.rank must be positive"), ({"gate": "cubic"}, "apn.gate is vector or scalar"),
    ({"patches": 3}, "unknown config key apn.patches")])
def test_bad_apn_options(options, message):
    with pytest.raises(ForgetlessError, match=message):
        GPT(GPTConfig(n_layer=1, n_head=1, d_model=8, block_size=4, ffn="apn", ffn_options=options))
