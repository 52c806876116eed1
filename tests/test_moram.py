import pytest
import torch
import torch.nn as nn

from forgetless.errors import ForgetlessError
from forgetless.nn.moram import MoRAMConfig, MoRAMLinear


def layer(**kw):
    torch.manual_seed(0)
    return MoRAMLinear(nn.Linear(6, 5), 6, 5, MoRAMConfig(**{**dict(atoms_per_task=4, top_k=3, tau=0.5, delta=0.0), **kw}))


def test_no_atoms_and_new_atoms_leave_the_base_unchanged():
    m = layer()
    x = torch.randn(2, 3, 6)
    assert torch.equal(m(x), m.base(x))
    m.add_task()
    assert m.n_atoms == 4 and torch.allclose(m(x), m.base(x))  # values start at zero


def test_equations_top_k_and_threshold():
    m = layer(delta=0.3)
    m.add_task()
    with torch.no_grad():
        m.values[0].normal_()
    x = torch.randn(7, 6)
    z = x @ m.keys[0].T
    s = z / z.norm(dim=-1, keepdim=True)
    top = s.topk(3, dim=-1).indices
    logits = torch.full_like(s, float("-inf")).scatter(-1, top, s.gather(-1, top) / 0.5)
    w = logits.softmax(-1)
    m.train()
    assert torch.allclose(m(x), m.base(x) + (w * z) @ m.values[0], atol=1e-6)
    assert ((m.weights(z) > 0).sum(-1) == 3).all()
    m.eval()
    assert torch.allclose(m(x), m.base(x) + (w * (s >= 0.3) * z) @ m.values[0], atol=1e-6)


def test_new_task_freezes_old_atoms_and_routes_over_the_union():
    m = layer()
    m.add_task()
    m.add_task()
    assert m.n_atoms == 8
    assert not m.keys[0].requires_grad and not m.values[0].requires_grad
    assert m.keys[1].requires_grad and m.values[1].requires_grad
    with torch.no_grad():
        m.values[0].normal_()
    m(torch.randn(4, 6)).sum().backward()
    assert m.keys[0].grad is None and m.values[1].grad is not None


def test_bad_options():
    with pytest.raises(ForgetlessError, match="must be positive"):
        MoRAMConfig(tau=0)


def test_threshold_applies_only_in_eval_and_can_be_switched_off():
    m = layer(delta=0.9)
    m.add_task()
    z = torch.randn(50, 4)
    m.train()
    assert ((m.weights(z) > 0).sum(-1) == 3).all()   # top-3, no threshold while training
    m.eval()
    dropped = m.weights(z)
    assert ((dropped > 0).sum(-1) < 3).any()           # delta=0.9 drops atoms at eval
    off = layer(delta=None, top_k=0)
    off.add_task()
    off.eval()
    assert torch.allclose(off.weights(z), (z / z.norm(dim=-1, keepdim=True) / 0.5).softmax(-1))  # all atoms, no cut
