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
from transformers import LlamaForCausalLM

import forgetless
from forgetless import loss as loss_module
from forgetless.data.splits import Batch
from forgetless.loss import shared_prompt
from forgetless.methods import METHODS, build_method
from forgetless.methods.distill import DistillTerm
from forgetless.models.gpt import GPT, logits_of
from forgetless.models.hf import gradient_checkpointing

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


def prompted_batch(rows: int = 4, shared: int = 10, T: int = 16, ends: tuple[int, ...] = ()) -> Batch:
    """`rows` rows starting with the same `shared` tokens, each then its own; targets scored from the shared prompt's
    end on (a task's instruction, each row's input and answer), the last two rows old data; `ends`: row i's tokens
    stop at ends[i], padding (0, masked, unscored) after, and the batch has a mask."""
    g = torch.Generator().manual_seed(1)
    w = torch.cat([torch.randint(3, V, (1, shared), generator=g).expand(rows, -1),
                   torch.randint(3, V, (rows, T + 1 - shared), generator=g)], 1)    # (B, T+1)
    y = w[:, 1:].clone()
    y[:, :shared + 1] = -100
    x, mask = w[:, :-1].clone(), None
    if ends:
        mask = torch.ones_like(x)
        for row, end in enumerate(ends):
            x[row, end:], y[row, end - 1:], mask[row, end:] = 0, -100, 0
    return Batch(x, y, torch.arange(rows) >= rows - 2, mask)


DECLARED = [n for n, cls in METHODS.items() if cls.prefix_once] + ["lora+ewc", "lora+distill"]
PREFIX_ONCE = [(kind, name) for name in DECLARED for kind in ("gpt2", "llama")
               if (kind, name) != ("gpt2", "osf")]  # OSF wraps no Conv1D (GPT-2's)


def check_shared_prompt(monkeypatch, adapted, b: Batch, shared: int):
    """The loss and gradients with the batch's shared prompt run once (`shared` tokens, its KV cache repeated for
    every row) are those of every row run whole."""
    monkeypatch.setattr(loss_module, "SHARED_MIN", 4)
    calls = []
    monkeypatch.setattr(loss_module, "prompt_cache", lambda *a, f=loss_module.prompt_cache: calls.append(a[1].shape)
                        or f(*a))
    once, _ = adapted.losses(b)
    assert calls == [(1, shared)], "the shared prompt did not run once"
    monkeypatch.setattr(loss_module, "SHARED_MIN", 10 ** 6)  # every row whole
    whole, _ = adapted.losses(b)
    assert len(calls) == 1
    torch.testing.assert_close(once, whole, rtol=1e-5, atol=1e-6)
    ours, theirs = gradients(adapted, once), gradients(adapted, whole)
    assert any(g.abs().sum() > 0 for g in ours.values())
    for n in ours:
        torch.testing.assert_close(ours[n], theirs[n], rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.parametrize("kind, name", PREFIX_ONCE)
def test_a_shared_prompt_run_once_gives_the_same_loss_and_gradients(monkeypatch, kind, name):
    """Every method that declares `prefix_once`, in training mode (GPT-2 in eval mode: its dropout would refuse)."""
    adapted = attached(kind, name)
    if kind == "gpt2":
        adapted.eval()
    check_shared_prompt(monkeypatch, adapted, prompted_batch(), 10)


def test_a_shared_prompt_serves_padded_rows_with_a_mask(monkeypatch):
    check_shared_prompt(monkeypatch, attached("llama", "lora"), prompted_batch(ends=(16, 13, 15, 12)), 10)


def test_a_model_that_transforms_its_logits_shares_a_prompt_on_its_logits(monkeypatch):
    """The first batch finds the logits are not the head's output: the forward runs again on the prompt's cache."""
    class Halved(LlamaForCausalLM):
        def forward(self, input_ids=None, use_cache=None, logits_to_keep=0, **kwargs):
            out = super().forward(input_ids=input_ids, use_cache=use_cache, logits_to_keep=logits_to_keep, **kwargs)
            out.logits = out.logits / 2
            return out

    torch.manual_seed(0)
    adapted = forgetless.attach(Halved(tiny("llama").config), "lora").train()
    with torch.no_grad():
        for _, p in adapted.trainable_parameters():
            p.add_(0.05)
    check_shared_prompt(monkeypatch, adapted, prompted_batch(), 10)
    assert Halved in loss_module.POSTPROCESSED
    loss_module.POSTPROCESSED.discard(Halved)


def test_a_shared_prompt_runs_once_only_where_it_gives_every_rows_result(monkeypatch):
    """Conditions: the tokens shared, unscored, unmasked, one left to each row; two rows or more; a transformers
    model with a cache, no gradient checkpointing, no dropout in training."""
    monkeypatch.setattr(loss_module, "SHARED_MIN", 4)
    llama, b = tiny("llama"), prompted_batch()
    assert shared_prompt(llama, b) == 10
    scored = Batch(b.x, torch.where(torch.arange(16) == 6, b.x, b.y), b.from_other)  # a scored target at 6
    assert shared_prompt(llama, scored) == 6
    masked = Batch(b.x, b.y, b.from_other, torch.ones_like(b.x).index_fill_(1, torch.tensor([8]), 0))
    assert shared_prompt(llama, masked) == 8
    other = Batch(b.x.index_fill(0, torch.tensor([1]), 1), b.y, b.from_other)    # row 1 differs from the start
    assert shared_prompt(llama, other) == 0
    same = Batch(b.x[:1].expand(4, -1), torch.full_like(b.y, -100), b.from_other)  # identical rows
    assert shared_prompt(llama, same) == 15
    assert shared_prompt(llama, Batch(b.x[:1], b.y[:1], b.from_other[:1])) == 0  # one row
    assert shared_prompt(tiny("gpt"), b) == 0  # our GPT keeps no KV cache
    gpt2 = tiny("gpt2")
    assert shared_prompt(gpt2.eval(), b) == 10 and shared_prompt(gpt2.train(), b) == 0  # its dropout, in training
    assert shared_prompt(forgetless.attach(tiny("llama"), "lora", dropout=0.1).train().model, b) == 0
    functional = tiny("llama").train()  # Llama applies its attention dropout as a function: found in the config
    assert shared_prompt(functional, b) == 10
    functional.config.attention_dropout = 0.1
    assert shared_prompt(functional, b) == 0
    gradient_checkpointing(llama)
    assert shared_prompt(llama, b) == 0


def test_a_cache_that_cannot_serve_a_shared_prompt_runs_every_row_whole(monkeypatch):
    """A cache other than transformers' plain one (here a tuple, as transformers 4.x returns): the rows run whole, and
    the model's class is not asked again."""
    monkeypatch.setattr(loss_module, "SHARED_MIN", 4)
    monkeypatch.setattr(loss_module, "UNCACHED", set())
    adapted, b = attached("llama", "lora"), prompted_batch()
    monkeypatch.setattr(loss_module, "cache_of", lambda out: ((torch.zeros(1),),))
    once, _ = adapted.losses(b)
    assert type(adapted.model) in loss_module.UNCACHED and shared_prompt(adapted.model, b) == 0
    monkeypatch.setattr(loss_module, "SHARED_MIN", 10 ** 6)
    torch.testing.assert_close(once, adapted.losses(b)[0])


def test_methods_that_read_their_forward_do_not_share_a_prompt(monkeypatch):
    """Neutral's l1 term reads the gates the batch's forward left per row, APN adds its routing loss: their batches
    run whole (no `prefix_once`), and so does any composition with one of them."""
    assert not METHODS["neutral"].prefix_once and not METHODS["apn-retrofit"].prefix_once
    assert not build_method("neutral+ewc").prefix_once and build_method("lora+ewc").prefix_once
    monkeypatch.setattr(loss_module, "SHARED_MIN", 4)
    monkeypatch.setattr(loss_module, "prompt_cache", lambda *a: pytest.fail("a prompt ran once"))
    adapted = attached("llama", "neutral")
    adapted.losses(prompted_batch())
