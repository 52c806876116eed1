"""Fast scores of instruction tasks on Hugging Face causal LMs: label accuracy (each prompt runs once,
its KV cache serves every candidate label), greedy exact match (a cached greedy loop), and perplexity
on English prose held out from every task (Python's help topics: technical text, not a broad sample).

Every function runs in eval mode without gradients (the model's mode is restored after), on the
device of the model's parameters. Prompts are tokenized as in `data.instructions.encode` (bos when
the tokenizer has one, then the prompt), answers as the answer's tokens then eos; a prompt longer
than the model's context loses its beginning.
"""
from __future__ import annotations

import contextlib
import copy

import torch
import torch.nn as nn

from forgetless.continual.evaluate import evaluate
from forgetless.data.instructions import Example, InstructionTask, head, keep_end, prompt_ids, text_ids
from forgetless.data.splits import check_length, eval_windows
from forgetless.device import autocast
from forgetless.errors import ForgetlessError
from forgetless.models.gpt import cache_arg, cache_of, last_logits_only, windowed

LABEL_FORWARD_BYTES = 256 << 20  # logits, attention weights and mask of the labels scored in one forward


# ---- label accuracy --------------------------------------------------------------------------
def label_accuracy(model: nn.Module, tokenizer, examples: list[Example], labels: list[str], batch_size: int = 8,
                   normalize: bool = False) -> float:
    """Fraction of examples whose answer is the label of highest log-likelihood given the prompt
    (`label_scores`: summed token log-probs; normalize=True: per-token mean)."""
    hits = label_hits(model, tokenizer, examples, labels, batch_size, normalize)
    return sum(hits) / len(hits)


def label_hits(model: nn.Module, tokenizer, examples: list[Example], labels: list[str], batch_size: int = 8,
               normalize: bool = False) -> list[bool]:
    """Per example: whether its answer is the label of highest log-likelihood (`label_accuracy`'s outcomes)."""
    if not examples:
        raise ForgetlessError("label accuracy needs at least one example")
    scores = label_scores(model, tokenizer, [ex.prompt for ex in examples], labels, batch_size, normalize)  # (N, K)
    return [labels[k] == ex.answer for k, ex in zip(scores.argmax(1).tolist(), examples)]


@torch.no_grad()
def label_scores(model: nn.Module, tokenizer, prompts: list[str], labels: list[str], batch_size: int = 8,
                 normalize: bool = False) -> torch.Tensor:
    """(N, K) log-likelihood of each label after each prompt: the sum of the log-probs of the label's
    tokens and of the eos that ends it (the eos keeps a label that is a prefix of another from winning
    for free); normalize=True divides by that token count.

    The tokens every prompt starts with (a task's instruction and options) run once; their KV cache, repeated per
    row, is where each batch of the rest starts. The rest runs in batches of similar length (`by_length`: little
    padding), left-padded (the padding sits between the shared tokens and each row's own, masked), once each. The
    head's log-softmax at a prompt's end scores every label's first token; the labels' further tokens run together
    in one forward on that cache, each seeing the prompt and its own tokens (`label_rest`).
    """
    check_causal_lm(model)
    if not labels:
        raise ForgetlessError("label scoring needs at least one label")
    pad = pad_of(tokenizer)
    cands = [torch.tensor(text_ids(tokenizer, label) + [tokenizer.eos_id]) for label in labels]  # K x (Lk,)
    room = prompt_room(model, max(len(c) for c in cands) - 1)
    bos = getattr(tokenizer, "bos_id", None)
    device = next(model.parameters()).device
    rows = [keep_end(prompt_ids(tokenizer, p), room, bos) for p in prompts]
    shared = shared_prefix(rows)
    out = torch.zeros(len(prompts), len(cands))
    key = cache_arg(model)
    with inference(model):
        if shared:
            prefix = torch.tensor(rows[0][:shared], device=device)[None]  # (1, S)
            prefix_cache = cache_of(model(input_ids=prefix, use_cache=True, **last_logits_only(model)))
            rows = [r[shared:] for r in rows]
        for batch in by_length(rows, batch_size):
            ids, mask = left_padded([rows[i] for i in batch], pad)      # (b, P)
            ids, mask, b = ids.to(device), mask.to(device), len(batch)
            past = {}
            if shared:
                cache = copy.deepcopy(prefix_cache)
                cache.batch_repeat_interleave(b)
                past = {key: cache}
            pos = shared + positions(mask)                               # (b, P)
            mask = torch.cat([mask.new_ones(b, shared), mask], 1)       # (b, S + P)
            first = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                          **last_logits_only(model), **past)
            cache, lengths, batch = cache_of(first), mask.sum(1), torch.tensor(batch)
            if not hasattr(cache, "crop"):
                raise ForgetlessError(f"{type(model).__name__} returned a legacy KV cache (tuples); label scoring "
                                      "needs a transformers version whose models return Cache objects")
            first_lp = first.logits[:, -1].float().log_softmax(-1)      # (b, V): every label's first token
            out[batch] = first_lp[:, [c[0] for c in cands]].cpu()        # (b, K)
            for group in label_groups(model, cands, b, mask.shape[1]):
                out[batch[:, None], group] += label_rest(model, key, cache, mask, lengths, [cands[k] for k in group])
    if normalize:
        out /= torch.tensor([len(c) for c in cands], dtype=out.dtype)
    return out


def label_groups(model: nn.Module, cands: list[torch.Tensor], b: int, prompt: int) -> list[list[int]]:
    """The labels with tokens after their first, in groups that run in one forward on prompts of `prompt` tokens:
    per label token, its fp32 logits, one layer's attention weights over every key and the mask, at most
    LABEL_FORWARD_BYTES a group; one label a group where the model's attention takes no custom mask (`mask_kind`)."""
    output = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    vocab = output.weight.shape[0] if output is not None else model.config.vocab_size
    heads = getattr(getattr(model, "config", None), "num_attention_heads", None) or 1
    keys = prompt + sum(len(c) - 1 for c in cands)  # the most keys a label token can face
    groups, size, alone = [], LABEL_FORWARD_BYTES, mask_kind(model) is None
    for k, c in enumerate(cands):
        if len(c) < 2:
            continue
        cost = b * (len(c) - 1) * (vocab + (heads + 1) * keys) * 4
        if alone or size + cost > LABEL_FORWARD_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(k)
        size += cost
    return groups


def label_rest(model: nn.Module, key: str, cache, mask: torch.Tensor, lengths: torch.Tensor,
               cands: list[torch.Tensor]) -> torch.Tensor:
    """(b, k): the summed log-probs of each label's tokens after its first, in one forward on the prompts' cache:
    the labels' inputs one after another, each attending to the prompt and to its own earlier tokens (a 4D mask;
    a 2D one for one label); the cache is cut back to the prompts after."""
    b, k, device = len(mask), len(cands), mask.device
    spans = [len(c) - 1 for c in cands]
    ids = torch.cat([c[:-1] for c in cands]).to(device).expand(b, -1)              # (b, Q): every label's inputs
    targets = torch.cat([c[1:] for c in cands]).to(device).expand(b, -1)           # (b, Q): what they predict
    label = torch.repeat_interleave(torch.arange(k), torch.tensor(spans)).to(device)  # (Q,): whose input
    offset = torch.cat([torch.arange(n) for n in spans]).to(device)                # (Q,): where in its label
    attn = torch.cat([mask, torch.ones_like(ids)], 1)                              # (b, S + P + Q)
    if k > 1:
        own = (label[:, None] == label[None, :]) & (offset[:, None] >= offset[None, :])  # (Q, Q)
        attend = torch.cat([mask.bool()[:, None, :].expand(-1, len(label), -1), own.expand(b, -1, -1)], 2)
        attn = model_mask(model, attend[:, None])                                  # (b, 1, Q, S + P + Q)
    logits = model(input_ids=ids, attention_mask=attn, position_ids=lengths[:, None] + offset, use_cache=True,
                   **{key: cache}).logits.float()                                  # (b, Q, V)
    cache.crop(-len(label))  # drop the labels' tokens: the prompts' cache again
    lp = logits.gather(-1, targets[..., None]).squeeze(-1) - logits.logsumexp(-1)   # (b, Q)
    return torch.zeros(b, k).index_add_(1, label.cpu(), lp.cpu())


def mask_kind(model: nn.Module) -> str | None:
    """How the model's attention takes a custom 4D mask: "bool" (SDPA), "additive" (eager), None (one label a forward):
    other kernels, sliding-window or chunked layers (a 4D mask would replace their window), or transformers before
    5 (whose models read a 4D mask in another form)."""
    import transformers
    if windowed(model) or int(transformers.__version__.split(".")[0]) < 5:
        return None
    implementation = getattr(getattr(model, "config", None), "_attn_implementation", None)
    return {"sdpa": "bool", "eager": "additive"}.get(implementation)


def model_mask(model: nn.Module, attend: torch.Tensor) -> torch.Tensor:
    """`attend` (b, 1, Q, K), True where a query sees a key, as the model's attention takes it."""
    if mask_kind(model) == "bool":
        return attend
    dtype = next(model.parameters()).dtype
    return torch.zeros(attend.shape, dtype=dtype, device=attend.device).masked_fill(~attend, torch.finfo(dtype).min)


def shared_prefix(rows: list[list[int]]) -> int:
    """How many tokens every row starts with, each row keeping at least one of its own."""
    first, n = rows[0], min(len(r) for r in rows) - 1
    for row in rows[1:]:
        n = next((i for i in range(n) if row[i] != first[i]), n)
    return max(n, 0)


def by_length(rows: list[list[int]], batch_size: int) -> list[list[int]]:
    """Indices of `rows` in batches of `batch_size`, longest rows first (each batch pads to similar lengths)."""
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))
    return [order[s:s + batch_size] for s in range(0, len(order), batch_size)]


# ---- exact match -----------------------------------------------------------------------------
def exact_match(model: nn.Module, tokenizer, examples: list[Example], max_new_tokens: int,
                batch_size: int = 8, first_line: bool = False) -> float:
    """Fraction of examples whose greedy answer equals the answer after whitespace/case normalization
    (first_line=True: the first lines of both)."""
    hits = exact_hits(model, tokenizer, examples, max_new_tokens, batch_size, first_line)
    return sum(hits) / len(hits)


def exact_hits(model: nn.Module, tokenizer, examples: list[Example], max_new_tokens: int, batch_size: int = 8,
               first_line: bool = False) -> list[bool]:
    """Per example: whether its greedy answer matches (`exact_match`'s outcomes)."""
    if not examples:
        raise ForgetlessError("exact match needs at least one example")
    answers = greedy_answers(model, tokenizer, [ex.prompt for ex in examples], max_new_tokens, batch_size)
    cut = head if first_line else (lambda text: text)
    return [normalized(cut(a)) == normalized(cut(ex.answer)) for a, ex in zip(answers, examples)]


def normalized(text: str) -> str:
    return " ".join(text.split()).lower()


@torch.no_grad()
def greedy_answers(model: nn.Module, tokenizer, prompts: list[str], max_new_tokens: int,
                   batch_size: int = 8) -> list[str]:
    """Greedy continuations (argmax each step, KV-cached), stopped at eos or after max_new_tokens, decoded
    without the eos."""
    check_causal_lm(model)
    if max_new_tokens < 1:
        raise ForgetlessError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    pad, eos, bos = pad_of(tokenizer), tokenizer.eos_id, getattr(tokenizer, "bos_id", None)
    room = prompt_room(model, max_new_tokens - 1)
    device = next(model.parameters()).device
    prompt_rows = [keep_end(prompt_ids(tokenizer, p), room, bos) for p in prompts]
    answers, key = [""] * len(prompts), cache_arg(model)
    with inference(model):
        for batch in by_length(prompt_rows, batch_size):
            rows = [prompt_rows[i] for i in batch]
            ids, mask = left_padded(rows, pad)                           # (b, P)
            ids, mask = ids.to(device), mask.to(device)
            out = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask), use_cache=True,
                        **last_logits_only(model))
            lengths = mask.sum(1)                                        # (b,)
            done = torch.zeros(len(rows), dtype=torch.bool, device=device)
            steps = []
            for s in range(max_new_tokens):
                token = out.logits[:, -1].argmax(-1)                     # (b,)
                steps.append(token)
                done |= token == eos
                if done.all() or s == max_new_tokens - 1:
                    break
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
                out = model(input_ids=token[:, None], attention_mask=mask, position_ids=(lengths + s)[:, None],
                            use_cache=True, **{key: cache_of(out)})
            for i, row in zip(batch, torch.stack(steps, 1).tolist()):   # (b, steps)
                answers[i] = tokenizer.decode(row[:row.index(eos)] if eos in row else row)
    return answers


# ---- one task --------------------------------------------------------------------------------
def score_task(model: nn.Module, tokenizer, task: InstructionTask, rows: int | None = None, batch_size: int = 8,
               max_new_tokens: int | None = None, precision: str = "fp32") -> dict:
    """Label accuracy when the task has labels, else exact match (of the answers' first lines when the task
    says so), on its first `rows` test examples (all when None), in %, the forwards under `precision`'s autocast.
    Exact match generates up to the longest of those answers (first lines) plus one token unless told."""
    hits, kind = task_hits(model, tokenizer, task, rows, batch_size, max_new_tokens, precision)
    return {"score": 100.0 * sum(hits) / len(hits), "kind": kind, "rows": len(hits)}


def task_hits(model: nn.Module, tokenizer, task: InstructionTask, rows: int | None = None, batch_size: int = 8,
              max_new_tokens: int | None = None, precision: str = "fp32") -> tuple[list[bool], str]:
    """(per test row: whether `score_task` counts it right, the score's kind): the outcomes behind the score,
    for intervals over test rows (continual/bootstrap.py)."""
    examples = task.test[:rows]
    if not examples:
        raise ForgetlessError(f"task {task.name} has no test examples to score")
    with autocast(next(model.parameters()).device, precision):
        if task.labels:
            return label_hits(model, tokenizer, examples, task.labels, batch_size), "label_accuracy"
        cut = head if task.first_line else (lambda text: text)
        longest = max(len(text_ids(tokenizer, cut(ex.answer))) for ex in examples) + 1
        hits = exact_hits(model, tokenizer, examples, max_new_tokens or longest, batch_size, task.first_line)
    return hits, "first_line_match" if task.first_line else "exact_match"


# ---- general text ------------------------------------------------------------------------------
def general_text() -> str:
    """English prose held out from every task (technical: about Python), on disk wherever Python is: the topic texts of
    Python's bundled help (`pydoc_data.topics`), in topic order, about 465k characters."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def general_perplexity(model: nn.Module, tokenizer, text: str | None = None, window: int = 256,
                       max_windows: int = 16, batch_size: int = 8) -> float:
    """exp(mean next-token NLL) over fixed, evenly spaced, non-overlapping windows of `window` + 1 tokens
    of `text` (default: `general_text()`)."""
    tokens = torch.tensor(text_ids(tokenizer, general_text() if text is None else text))
    check_length(tokens, window, "the general text")
    return evaluate(model, eval_windows(tokens, window, max_windows), batch_size)["ppl"]


# ---- shared --------------------------------------------------------------------------------------
@contextlib.contextmanager
def inference(model: nn.Module):
    """Eval mode inside, the model's own mode restored after."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def check_causal_lm(model: nn.Module):
    if not hasattr(model, "generate"):  # transformers causal LMs (and PEFT / Adapted wrappers of them)
        raise ForgetlessError(f"scoring instruction tasks needs a Hugging Face causal LM (attention masks and a KV "
                              f"cache); {type(model).__name__} is not one")


def pad_of(tokenizer) -> int:
    pad = getattr(tokenizer, "pad_id", None)
    return tokenizer.eos_id if pad is None else pad


def prompt_room(model: nn.Module, after: int) -> int | None:
    """Most prompt tokens that leave room for `after` more inputs in the model's context (None: no limit)."""
    config = getattr(model, "config", None)
    context = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if context is None:
        return None
    if context - after < 1:
        raise ForgetlessError(f"the model's context of {context} tokens has no room for a prompt before {after} "
                              "answer tokens; use shorter labels or fewer new tokens")
    return context - after


def left_padded(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids (b, P), attention mask (b, P)): rows aligned at the right, so every prompt ends at P - 1."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if not r:
            raise ForgetlessError("an empty prompt has no tokens to score from (and the tokenizer no bos)")
        ids[i, width - len(r):], mask[i, width - len(r):] = torch.tensor(r), 1
    return ids, mask


def positions(mask: torch.Tensor) -> torch.Tensor:  # (b, P) -> (b, P): 0.. from each row's first real token
    return (mask.cumsum(1) - 1).clamp_min(0)
