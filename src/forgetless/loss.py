"""The LM training loss of a batch: the (token-weighted) cross-entropy, the modules' auxiliary losses and a
method's extra term.

Full-vocabulary logits are never whole in fp32 here. Where a model's logits are its output head's output (our
GPT, transformers causal LMs), the forward stops at what the head reads (`head_inputs`), and the head and the loss
run over chunks of the scored positions, each chunk recomputed in the backward (`chunked_sum`): one chunk's
logits are alive at a time, in the forward and in the backward (distillation's KL runs the same way). Elsewhere
(a model that post-processes its logits, one FSDP shards, token-weighted methods, which read every position's
logits) the model's logits are made whole and only the loss's fp32 copies are chunked.
"""
from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint

from forgetless.data.splits import Batch
from forgetless.device import checkpointed
from forgetless.distributed import is_shard
from forgetless.models.gpt import cache_of, forward_takes, last_logits_only, logits_of, takes_logits_to_keep
from forgetless.side import aux_loss

CHUNK_BYTES = 64 << 20  # fp32 bytes of one chunk of (positions, V) logits in the loss and the KL
SHARED_MIN = 8  # shared prompt tokens worth a forward of their own (shared_prompt)
DROPOUT_KEYS = ("attention_dropout", "dropout", "hidden_dropout", "attn_pdrop", "resid_pdrop", "embd_pdrop")  # config
# keys of dropout that transformers models apply as a function, not an nn.Dropout (Llama's, OPT's, BLOOM's, GPT-2's)
UNCACHED: set[type] = set()  # model classes whose KV cache cannot serve a shared prompt (prompt_cache)
POSTPROCESSED: set[type] = set()  # model classes whose logits were found not to be their head's output


def training_loss(model: nn.Module, batch: Batch, extra=None, token_weights=None, share_prompt: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(LM loss + modules' auxiliary losses + `extra(model, batch)`, LM loss alone).

    Targets of -100 are not scored (e.g. prompt tokens of instruction data): the output head runs only at the
    positions scored (a third less time per step on SmolLM2 with answers-only loss). `token_weights(logits, batch)`
    may return (B, T) weights for the LM loss (None: plain mean); with it, every position's logits are computed.
    `share_prompt` (a method's `prefix_once`): the unscored tokens every row starts with (a task's instruction and
    options) run once, and every row goes on from their KV cache (`shared_prompt`): the same loss and gradients
    in exact arithmetic, a forward and backward of those tokens for the batch instead of one per row.
    """
    whole, x, y, cache = batch, batch.x, batch.y, None                               # (B, T)
    shared = shared_prompt(model, batch) if share_prompt and token_weights is None else 0
    if shared and (cache := prompt_cache(model, x[:1, :shared], len(x))) is not None:
        x, y = x[:, shared:], y[:, shared:]                                          # (B, T - S): the mask stays whole
    keep, scored = None, y != -100
    if token_weights is None and not scored.all() and takes_logits_to_keep(model):
        keep = scored.any(0).nonzero().flatten()  # (P,) positions some row scores: the rest reach no head
        y = y[:, keep]
    if token_weights is not None:
        return loss_terms(model, logits_of(model, x, keep, batch.mask), y, whole, extra, token_weights)
    inputs, head, vocab = head_inputs(model, x, keep, batch.mask, cache=cache)      # (B, P, d) or logits (B, P, V)
    return loss_terms(model, inputs, y, whole, extra, head=head, vocab=vocab)


def shared_prompt(model: nn.Module, batch: Batch) -> int:
    """How many tokens every row of `batch` starts with, none scored or masked, each row keeping one of its own;
    0 below SHARED_MIN, for one row, or where running them once would not give every row's own result: a model
    other than a transformers one with a cache (or one whose cache was found unfit, UNCACHED), FSDP, gradient
    checkpointing, dropout in training (the rows would share one mask on the prompt)."""
    x, config = batch.x, getattr(model, "config", None)                              # (B, T)
    if len(x) < 2:
        return 0
    same = (x == x[:1]).all(0) & (batch.y == -100).all(0)                            # (T,)
    if batch.mask is not None:
        same &= batch.mask.bool().all(0)
    n = min(int(same.cumprod(0).sum()), x.shape[1] - 1)
    if n < SHARED_MIN or type(model) in UNCACHED or not forward_takes(model, "use_cache") or \
            is_shard(next(model.parameters())) or model.training and any(
                isinstance(p := getattr(config, key, 0), (int, float)) and p > 0 for key in DROPOUT_KEYS):
        return 0
    if checkpointed(model) or model.training and any(isinstance(m, nn.Dropout) and m.p for m in model.modules()):
        return 0
    return n


def prompt_cache(model: nn.Module, ids: torch.Tensor, rows: int):
    """The KV cache of one forward of `ids` (1, S) (under autograd: the rows' gradients flow back through it),
    repeated for `rows` rows; None (and the model's class UNCACHED) where the cache is not transformers' plain one
    (every layer a DynamicLayer, which keeps every key and appends new ones): sliding-window and chunked layers may
    drop keys, linear-attention and state-space layers update their state in place, transformers 4.x returns tuples
    in places."""
    cache = cache_of(model(input_ids=ids, use_cache=True, **last_logits_only(model)))
    layers = getattr(cache, "layers", None)
    if not layers or any(type(layer).__name__ != "DynamicLayer" for layer in layers):
        UNCACHED.add(type(model))
        return None
    cache.batch_repeat_interleave(rows)
    return cache


def loss_terms(model: nn.Module, logits: torch.Tensor, targets: torch.Tensor, batch: Batch, extra=None,
               token_weights=None, head: Callable | None = None, vocab: int | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(LM loss of `logits` (B, P, V) against `targets` (B, P) + the modules' auxiliary losses left by the
    forward that made them + `extra(model, batch)`, LM loss alone); the method sees every position of `batch`.
    With `head`, `logits` are what the head reads (B, P, d) and it makes logits of `vocab` entries."""
    scored = targets != -100                                                         # (B, P)
    if token_weights is None:
        loss = lm = chunked_sum(cross_entropy_sum, vocab or logits.shape[-1], *scored_rows(logits, targets, head),
                                head=head) / scored.sum().clamp_min(1)
    else:
        per_token = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none").view_as(targets)
        lm = per_token.mean() if scored.all() else per_token.sum() / scored.sum().clamp_min(1)
        weights = token_weights(logits, batch)
        if weights is not None:
            weights = weights * scored
        loss = lm if weights is None else (per_token * weights).sum() / weights.sum().clamp_min(1.0)
    parts = [aux_loss(model), extra(model, batch) if extra else None]
    parts = [p for p in parts if p is not None]
    return (loss + sum(parts) if parts else loss), lm


@torch.no_grad()
def scored_totals(model: nn.Module, batch: Batch) -> tuple[float, int, int]:
    """(summed cross-entropy, top-1 hits, count) over the scored targets of `batch`, the output head run over
    chunks of the scored positions as in the loss: no logits beyond one chunk."""
    scored = batch.y != -100                                                         # (B, T)
    keep = scored.any(0).nonzero().flatten() if not scored.all() and takes_logits_to_keep(model) else None
    y = batch.y if keep is None else batch.y[:, keep]                                # (B, P)
    inputs, head, vocab = head_inputs(model, batch.x, keep, batch.mask)
    rows, targets = scored_rows(inputs, y, head)                                     # (N, d or V), (N,)
    total, hits, n = 0.0, 0, max(1, CHUNK_BYTES // (4 * vocab))
    for r, t in zip(rows.split(n), targets.split(n)):
        logits = (r if head is None else head(r)).float()                            # (n, V)
        total += F.cross_entropy(logits, t, reduction="sum").item()
        hits += (logits.argmax(-1) == t).sum().item()
    return total, hits, int(scored.sum())


def scored_rows(inputs: torch.Tensor, targets: torch.Tensor, head: Callable | None):
    """(rows (N, d or V), targets (N,)): with a head, only the scored positions' inputs (a copy of (N, d)); logits
    at every position (a view: the unscored are ignored by the loss, copying their logits would cost more)."""
    if head is None or (targets != -100).all():
        return inputs.flatten(0, 1), targets.flatten()
    scored = targets != -100
    return inputs[scored], targets[scored]


def cross_entropy_sum(rows: torch.Tensor, targets: torch.Tensor, head: Callable | None = None) -> torch.Tensor:
    """Summed cross-entropy of head(rows) (n, V) (or of the logits `rows`) against targets (n,), in fp32."""
    logits = rows if head is None else head(rows)                                   # (n, V)
    return F.cross_entropy(logits.float(), targets, reduction="sum")


def chunked_sum(fn: Callable, vocab: int, *rows: torch.Tensor, **kwargs) -> torch.Tensor:
    """sum of fn(*chunk, **kwargs) over chunks of `rows` (each (N, ...)) of at most CHUNK_BYTES of fp32 logits
    (n, vocab). With more than one chunk, under autograd each chunk runs under torch.utils.checkpoint: nothing
    of it is kept, and its backward recomputes it (the head's matmul again: a few % of a step)."""
    n = max(1, CHUNK_BYTES // (4 * vocab))
    if len(rows[0]) <= n:
        return fn(*rows, **kwargs)
    run = partial(checkpoint, fn, use_reentrant=False) if torch.is_grad_enabled() else fn
    return sum(run(*chunk, **kwargs) for chunk in zip(*(r.split(n) for r in rows)))


def head_inputs(model: nn.Module, idx: torch.Tensor, keep: torch.Tensor | None = None,
                mask: torch.Tensor | None = None, params: dict[str, torch.Tensor] | None = None, cache=None
                ) -> tuple[torch.Tensor, Callable | None, int]:
    """(what the output head reads (B, P, d), the head, the vocabulary size) in the forward of `idx` (B, T) (as
    `logits_of` runs it: `keep`, `mask`, `params` in place of the model's, the head then taking them too, `cache`); the
    forward runs the head on no position. A model whose logits are not its head's output (no output head
    found, logits transformed after it, as by Gemma 2's soft-capping: found at a first forward, which then runs
    again) or whose head FSDP shards gives (its logits (B, P, V), None, V)."""
    head = output_head(model)
    if head is None or type(model) in POSTPROCESSED or any(is_shard(p) for p in head.parameters()):
        logits = logits_of(model, idx, keep, mask, params, cache)
        return logits, None, logits.shape[-1]
    seen, made = [], []

    def before(module, args):
        if args and torch.is_tensor(args[0]) and args[0].dim() >= 2:
            seen.append(args[0])                                                    # (B, P, d)
            return (args[0][..., :0, :], *args[1:])                                 # (B, 0, d): no position

    handles = [head.register_forward_pre_hook(before),
               head.register_forward_hook(lambda module, args, out: made.append(out))]
    try:
        logits = logits_of(model, idx, keep, mask, params, cache)                   # (B, 0, V)
    finally:
        for handle in handles:
            handle.remove()
    if len(seen) != 1 or len(made) != 1 or logits is not made[0]:
        POSTPROCESSED.add(type(model))
        if cache is not None:
            cache.crop(-idx.shape[1])  # the cached prompt again
        return head_inputs(model, idx, keep, mask, params, cache)
    if params is not None:
        head = partial(functional_call, head, head_params(model, head, params))
    return seen[0], head, logits.shape[-1]


def output_head(model: nn.Module) -> nn.Module | None:
    """The module that makes a model's logits: transformers' output embeddings, our GPT's lm_head."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else getattr(model, "lm_head", None)
    return head if isinstance(head, nn.Module) else None


def head_params(model: nn.Module, head: nn.Module, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The entries of `params` (named as in `model`) that are `head`'s parameters, named as in `head` (a tied
    weight found under any of its names: lm_head.weight is model.embed_tokens.weight)."""
    by_id = {id(p): params[n] for n, p in model.named_parameters(remove_duplicate=False) if n in params}
    return {n: by_id[id(p)] for n, p in head.named_parameters(remove_duplicate=False) if id(p) in by_id}
