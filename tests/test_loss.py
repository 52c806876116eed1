"""The LM loss and distillation's KL over chunks of positions (forgetless.loss): the value and the gradients of the
formulas over whole logits, on our GPT and tiny transformers models, answer-only and full-sequence, with and without
the KL (its teacher included); no logits tensor above one chunk, in the forward or the backward; a model that
transforms its head's output falls back to its logits."""
import pytest
import torch
import torch.nn.functional as F
from tiny_models import tiny
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import forgetless
from forgetless import loss as loss_module
from forgetless.data.splits import Batch
from forgetless.methods.distill import DistillTerm
from forgetless.models.gpt import GPT, logits_of

V, ROWS = 256, 3  # the tiny models' vocabulary; positions per chunk where a test forces chunks


def batch(answer_only: bool) -> Batch:
    """(4, 12) random tokens, the last two rows old data; answer-only: each row scores its own tail."""
    w = torch.randint(0, V, (4, 13), generator=torch.Generator().manual_seed(0))
    y = w[:, 1:].clone()                                                             # (B, T)
    if answer_only:
        for row, prompt in enumerate((7, 9, 5, 10)):
            y[row, :prompt] = -100
    return Batch(w[:, :-1], y, torch.tensor([False, False, True, True]))


def attached(kind: str, name: str):
    adapted = forgetless.attach(tiny(kind), name)
    adapted.start_task(1, torch.randint(0, V, (2, 13)) if adapted.method.needs_previous else None)
    with torch.no_grad():  # away from the start, so that the KL is not zero
        for _, p in adapted.trainable_parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    return adapted.train()


def whole_logits_loss(adapted, b: Batch) -> torch.Tensor:
    """The loss as the formulas give it over whole (B, T, V) logits: mean cross-entropy over the scored targets,
    plus beta x the KL to the start's logits summed over the old rows' scored positions, over their count."""
    model, method = adapted.model, adapted.method
    lm = F.cross_entropy(logits_of(model, b.x).flatten(0, 1), b.y.flatten(), ignore_index=-100)
    if "distill" not in method.name:
        return lm
    x, scored = b.x[b.from_other], b.y[b.from_other] != -100                         # (R, T)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        teacher = logits_of(model, x, params=method.start)                           # (R, T, V)
    model.train(was_training)
    student = logits_of(model, x)                                                    # (R, T, V)
    kl = F.kl_div(F.log_softmax(student, -1), F.log_softmax(teacher, -1), log_target=True, reduction="none").sum(-1)
    beta = next(t.cfg.beta for t in method.terms if isinstance(t, DistillTerm))
    return lm + beta * (kl * scored).sum() / scored.sum()


def gradients(adapted, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    params = dict(adapted.trainable_parameters())
    return dict(zip(params, torch.autograd.grad(loss, list(params.values()))))


@pytest.mark.parametrize("kind", ["gpt", "gpt2", "llama"])
@pytest.mark.parametrize("name", ["full", "distill", "lora+distill"])
@pytest.mark.parametrize("answer_only", [True, False])
@pytest.mark.parametrize("chunked", [True, False])
def test_the_loss_and_its_gradients_are_the_whole_logits_ones(monkeypatch, kind, name, answer_only, chunked):
    if chunked:
        monkeypatch.setattr(loss_module, "CHUNK_BYTES", 4 * V * ROWS)
    adapted, b = attached(kind, name), batch(answer_only)
    adapted.eval()  # no dropout (GPT-2 has some), the same in both
    total, _ = adapted.losses(b)
    expected = whole_logits_loss(adapted, b)
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-6)
    ours, theirs = gradients(adapted, total), gradients(adapted, expected)
    assert ours.keys() == theirs.keys() and any(g.abs().sum() > 0 for g in ours.values())
    for n in ours:
        torch.testing.assert_close(ours[n], theirs[n], rtol=1e-4, atol=1e-6, msg=n)


class LogitShapes(TorchDispatchMode):
    """The largest number of elements of a tensor made inside it whose last dimension is the vocabulary (views of
    an input, as the head's transposed weight, not counted: they hold no memory of their own)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == V \
                    and t.untyped_storage().data_ptr() not in given:
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("kind", ["gpt", "llama"])
@pytest.mark.parametrize("name", ["full", "ewc-distill", "lora+distill"])
def test_no_logits_tensor_above_one_chunk_is_made(monkeypatch, kind, name):
    """Student, teacher, loss and KL, forward and backward: at most ROWS positions' logits in any tensor (the
    whole-logits formulas make (4, 12, V) ones: the check can fail)."""
    monkeypatch.setattr(loss_module, "CHUNK_BYTES", 4 * V * ROWS)
    adapted, b = attached(kind, name), batch(answer_only=False)
    with LogitShapes() as shapes:
        adapted.losses(b)[0].backward()
    assert 0 < shapes.largest <= ROWS * V
    with LogitShapes() as whole:
        whole_logits_loss(adapted, b).backward()
    assert whole.largest >= 4 * 12 * V


class Capped(GPT):
    """A GPT whose logits are its head's output soft-capped (as Gemma 2's): not the head's output."""

    def forward(self, idx):
        return 3.0 * torch.tanh(super().forward(idx) / 3.0)


def test_a_model_that_transforms_its_heads_output_is_scored_on_its_logits(monkeypatch):
    monkeypatch.setattr(loss_module, "CHUNK_BYTES", 4 * V * ROWS)
    model = Capped(tiny("gpt").config)
    b = batch(answer_only=True)
    _, lm = loss_module.training_loss(model, b)
    expected = F.cross_entropy(model(b.x).flatten(0, 1), b.y.flatten(), ignore_index=-100)
    torch.testing.assert_close(lm, expected)
    assert Capped in loss_module.POSTPROCESSED and GPT not in loss_module.POSTPROCESSED
    inputs, head, vocab = loss_module.head_inputs(model, b.x)
    assert head is None and inputs.shape == (4, 12, V) and vocab == V


def test_the_ewc_penalty_made_before_the_forward_gives_the_same_gradients(monkeypatch):
    """Penalty first (Composed.penalties_first, as Adapted.losses runs it) or after the forward (extra_loss alone):
    the same loss and gradients."""
    adapted, b = attached("llama", "ewc-distill"), batch(answer_only=True)  # a Llama without dropout, in training
    made_first = []
    real = forgetless.adapted.training_loss
    monkeypatch.setattr(forgetless.adapted, "training_loss",
                        lambda *a: made_first.append(len(adapted.method.early)) or real(*a))
    first, _ = adapted.losses(b)
    assert made_first == [1] and adapted.method.early == {}
    after, _ = loss_module.training_loss(adapted.model, b, adapted.method.extra_loss)
    torch.testing.assert_close(first, after)
    ours, theirs = gradients(adapted, first), gradients(adapted, after)
    for n in ours:
        torch.testing.assert_close(ours[n], theirs[n], rtol=1e-5, atol=1e-7, msg=n)
