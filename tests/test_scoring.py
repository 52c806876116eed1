"""Fast instruction scoring against naive references on tiny random Hugging Face LMs (offline)."""
import inspect
import math
import warnings
from collections import Counter

import pytest
import torch
from tiny_lm import tiny_gpt2, tiny_llama, tiny_tokenizer

import forgetless
from forgetless.continual import scoring
from forgetless.continual.scoring import (exact_match, general_perplexity, general_text, greedy_answers, label_accuracy,
                                          label_scores, score_task, shared_prefix)
from forgetless.data.instructions import Example, InstructionTask, load_task, prompt_ids, text_ids
from forgetless.errors import ForgetlessError
from forgetless.models.gpt import GPT, GPTConfig

MODELS = {"llama": tiny_llama, "gpt2": tiny_gpt2}


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def dbpedia():
    return load_task("dbpedia")


@torch.no_grad()
def naive_scores(model, tok, prompts, labels, normalize=False) -> torch.Tensor:
    """One full forward of prompt + label + eos per (prompt, label): the reference."""
    model.eval()
    out = torch.zeros(len(prompts), len(labels))
    for i, prompt in enumerate(prompts):
        p = prompt_ids(tok, prompt)
        for k, label in enumerate(labels):
            c = text_ids(tok, label) + [tok.eos_id]
            logp = model(torch.tensor([p + c[:-1]])).logits[0].log_softmax(-1)  # (T, V)
            picked = [logp[len(p) - 1 + j, t].item() for j, t in enumerate(c)]
            out[i, k] = sum(picked) / (len(picked) if normalize else 1)
    return out


@pytest.mark.parametrize("kind", MODELS)
def test_fast_label_scores_equal_one_forward_per_candidate(kind, tok, dbpedia):
    model = MODELS[kind](tok.vocab_size)
    prompts = [ex.prompt for ex in dbpedia.test[:5]]
    lengths = {len(prompt_ids(tok, p)) for p in prompts}
    assert len(lengths) > 1  # batches mix prompt lengths, so left padding is exercised
    assert shared_prefix([prompt_ids(tok, p) for p in prompts]) > 20  # the instruction's tokens run once, cached
    ref = naive_scores(model, tok, prompts, dbpedia.labels)
    fast = label_scores(model, tok, prompts, dbpedia.labels, batch_size=3)  # batches of 3 and 2
    assert fast.shape == (5, 14)
    assert (fast - ref).abs().max().item() < 1e-4
    assert ref.std(1).min().item() > 1e-3  # the labels really score differently
    assert torch.equal(fast.argmax(1), ref.argmax(1))
    mean = label_scores(model, tok, prompts, dbpedia.labels, batch_size=5, normalize=True)
    assert (mean - naive_scores(model, tok, prompts, dbpedia.labels, normalize=True)).abs().max().item() < 1e-4


@pytest.mark.parametrize("route", ["eager", "one label a forward"])
def test_labels_scored_together_or_alone_equal_one_forward_per_candidate(route, tok, dbpedia, monkeypatch):
    model = tiny_llama(tok.vocab_size)
    if route == "eager":  # an additive 4D mask in place of SDPA's boolean one
        model.config._attn_implementation = "eager"
        assert scoring.mask_kind(model) == "additive"
    else:
        monkeypatch.setattr(scoring, "mask_kind", lambda model: None)
    prompts = [ex.prompt for ex in dbpedia.test[:4]]
    fast = label_scores(model, tok, prompts, dbpedia.labels, batch_size=3)
    assert (fast - naive_scores(model, tok, prompts, dbpedia.labels)).abs().max().item() < 1e-4
    monkeypatch.setattr(scoring, "LABEL_FORWARD_BYTES", 1)  # every label its own group: the same scores
    assert (label_scores(model, tok, prompts, dbpedia.labels, batch_size=3) - fast).abs().max().item() < 1e-5


def test_label_groups_are_sized_by_logits_and_attention(tok):
    model = tiny_llama(tok.vocab_size)
    cands = [torch.tensor([5, 6, 2]), torch.tensor([7, 2]), torch.tensor([2]), torch.tensor([8, 9, 10, 2])]
    assert scoring.label_groups(model, cands, 4, 100) == [[0, 1, 3]]      # the eos-only label has no rest
    per_token = 4 * (tok.vocab_size + 3 * (100 + 6)) * 4                   # b x (V + (heads + 1) x keys) x fp32
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(scoring, "LABEL_FORWARD_BYTES", 3 * per_token)       # 2 + 1 tokens fit, then 3 more
        assert scoring.label_groups(model, cands, 4, 100) == [[0, 1], [3]]


def test_a_sliding_window_model_scores_one_label_a_forward(tok, dbpedia):
    model = tiny_llama(tok.vocab_size)
    assert scoring.mask_kind(model) == "bool"
    model.config.sliding_window = 4096  # a 4D mask would replace the window: each label alone, with the model's mask
    assert scoring.mask_kind(model) is None


def test_prompts_without_shared_tokens_score_as_one_forward_per_candidate(dbpedia):
    bare = tiny_tokenizer(bos=False)
    model = tiny_llama(bare.vocab_size)
    prompts = ["Alpha beta gamma.\nAnswer:", "Zeta is a letter too.\nAnswer:", "Question: which one?"]
    assert shared_prefix([prompt_ids(bare, p) for p in prompts]) == 0
    fast = label_scores(model, bare, prompts, dbpedia.labels[:5], batch_size=2)
    assert (fast - naive_scores(model, bare, prompts, dbpedia.labels[:5])).abs().max().item() < 1e-4


def test_shared_prefix_leaves_each_row_a_token_of_its_own():
    assert shared_prefix([[1, 5, 6, 7], [1, 5, 6, 8, 9], [1, 5, 9]]) == 2
    assert shared_prefix([[1, 5, 6], [1, 5, 6]]) == 2 and shared_prefix([[3], [3, 4]]) == 0
    assert shared_prefix([[2, 5], [1, 5]]) == 0


def test_label_accuracy_counts_argmax_decisions(tok, dbpedia):
    model = tiny_llama(tok.vocab_size, seed=1)
    examples = dbpedia.test[:6]
    best = naive_scores(model, tok, [ex.prompt for ex in examples], dbpedia.labels).argmax(1).tolist()
    # answers: the reference's choice for 4 examples, another label for 2
    relabeled = [Example(ex.prompt, dbpedia.labels[(k + (i >= 4)) % 14])
                 for i, (ex, k) in enumerate(zip(examples, best))]
    assert label_accuracy(model, tok, relabeled, dbpedia.labels, batch_size=4) == pytest.approx(4 / 6)


def test_scoring_runs_in_eval_mode_and_restores_it(tok, dbpedia):
    model = tiny_gpt2(tok.vocab_size)  # GPT-2 has dropout 0.1: train mode would change the scores
    prompts = [ex.prompt for ex in dbpedia.test[:2]]
    ref = naive_scores(model, tok, prompts, dbpedia.labels[:4])
    model.train()
    fast = label_scores(model, tok, prompts, dbpedia.labels[:4])
    assert model.training and (fast - ref).abs().max().item() < 1e-4


def test_scoring_works_through_an_attached_method(tok, dbpedia):
    model = tiny_llama(tok.vocab_size)
    prompts = [ex.prompt for ex in dbpedia.test[:3]]
    bare = label_scores(model, tok, prompts, dbpedia.labels)
    adapted = forgetless.attach(model, "lora", r=4)  # attaching changes no output
    assert torch.allclose(label_scores(adapted, tok, prompts, dbpedia.labels), bare, atol=1e-5)
    assert greedy_answers(adapted, tok, prompts, 3) == greedy_answers(adapted.model, tok, prompts, 3)


def test_the_kv_cache_goes_by_the_keyword_the_forward_takes(tok, dbpedia):
    """Scoring and greedy decoding pass the cache as `cache` where the model's forward takes it (transformers 5's
    newer releases deprecate `past_key_values`, to be removed in 5.40: no FutureWarning), else as
    `past_key_values` (older transformers: a forward without `cache`)."""
    from transformers import LlamaForCausalLM

    from forgetless.models.gpt import cache_arg, cache_of

    class OlderLlama(LlamaForCausalLM):  # the forward as transformers 4.x declares it
        def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, **kwargs):
            raise AssertionError("not called")

    class OlderOutput(dict):  # an output with `past_key_values` (this transformers' ModelOutput renames it)
        __getattr__ = dict.__getitem__

    model = tiny_llama(tok.vocab_size)
    takes_cache = "cache" in inspect.signature(LlamaForCausalLM.forward).parameters
    assert cache_arg(model) == ("cache" if takes_cache else "past_key_values")
    assert cache_arg(forgetless.attach(model, "lora", r=4)) == cache_arg(model)  # through a wrapper
    assert cache_arg(OlderLlama(model.config)) == "past_key_values"
    assert cache_of(OlderOutput(logits=torch.zeros(1), past_key_values="kv")) == "kv"
    prompts = [ex.prompt for ex in dbpedia.test[:2]]
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*past_key_values.*", category=FutureWarning)
        label_scores(model, tok, prompts, dbpedia.labels[:3])
        greedy_answers(model, tok, prompts, 3)


def test_scoring_refuses_a_model_without_cache(tok, dbpedia):
    ours = GPT(GPTConfig(n_layer=1, n_head=2, d_model=16, block_size=16, vocab_size=tok.vocab_size))
    with pytest.raises(ForgetlessError, match="needs a Hugging Face causal LM"):
        label_accuracy(ours, tok, dbpedia.test[:1], dbpedia.labels)


@torch.no_grad()
def manual_greedy(model, tok, prompt, max_new_tokens) -> list[int]:
    """Argmax of a full forward per step, no cache, batch of one."""
    ids, new = prompt_ids(tok, prompt), []
    for _ in range(max_new_tokens):
        token = model(torch.tensor([ids + new])).logits[0, -1].argmax().item()
        if token == tok.eos_id:
            break
        new.append(token)
    return new


@pytest.mark.parametrize("kind", MODELS)
def test_greedy_answers_and_exact_match_follow_manual_greedy(kind, tok, dbpedia):
    model = MODELS[kind](tok.vocab_size)
    prompts = [ex.prompt[:60 + 37 * i] for i, ex in enumerate(dbpedia.test[:6])]  # different lengths and endings
    base = [manual_greedy(model, tok, p, 6) for p in prompts]
    # make eos win where a token some rows produce after their first step would: those rows stop early
    late = Counter(t for row in base for t in row[1:] if any(t not in other for other in base))
    with torch.no_grad():
        model.lm_head.weight[tok.eos_id] = 1.05 * model.lm_head.weight[late.most_common(1)[0][0]]
    manual = [manual_greedy(model, tok, p, 6) for p in prompts]
    assert {len(m) == 6 for m in manual} == {True, False} and len(set(map(tuple, manual))) > 3
    assert greedy_answers(model, tok, prompts, 6, batch_size=4) == [tok.decode(m) for m in manual]
    # exact match: normalized comparison with the greedy text; two answers changed
    answers = [f"  {tok.decode(m).upper()} " if i % 2 else tok.decode(m) for i, m in enumerate(manual)]
    answers[1], answers[4] = answers[1] + " extra", "something else"
    examples = [Example(p, a) for p, a in zip(prompts, answers)]
    assert exact_match(model, tok, examples, 6, batch_size=4) == pytest.approx(4 / 6)


def test_score_task_picks_the_score_by_labels(tok, dbpedia):
    model = tiny_llama(tok.vocab_size)
    labeled = score_task(model, tok, dbpedia, rows=4)
    acc = label_accuracy(model, tok, dbpedia.test[:4], dbpedia.labels)
    assert labeled == {"score": pytest.approx(100 * acc), "kind": "label_accuracy", "rows": 4}
    greedy = greedy_answers(model, tok, [ex.prompt for ex in dbpedia.test[:3]], 3)
    free = InstructionTask("free", dbpedia.train[:2], [Example(ex.prompt, g) for ex, g in zip(dbpedia.test[:2], greedy)]
                           + [Example(dbpedia.test[2].prompt, "no")])
    assert greedy[2].strip().lower() != "no"
    out = score_task(model, tok, free, rows=3, max_new_tokens=3)
    assert out == {"score": pytest.approx(100 * 2 / 3), "kind": "exact_match", "rows": 3}  # the third is "no"
    # first-line tasks: the first greedy line against the answer's first line, whatever follows it
    lines = InstructionTask("letters", free.train, [Example(ex.prompt, ex.answer.split("\n")[0] + "\nsome reason")
                                                    for ex in free.test], first_line=True)
    assert all("\n" not in g.strip() for g in greedy)
    out = score_task(model, tok, lines, rows=3, max_new_tokens=3)
    assert out == {"score": pytest.approx(100 * 2 / 3), "kind": "first_line_match", "rows": 3}
    assert score_task(model, tok, InstructionTask("whole", free.train, lines.test), rows=3, max_new_tokens=3)["score"] == 0


def test_general_text_is_prose():
    text = general_text()
    words = text.split()
    assert len(text) > 300_000 and text == general_text()
    assert sum(c.isalpha() or c.isspace() for c in text) / len(text) > 0.85
    assert words.count("the") / len(words) > 0.02  # English: "the" is about 3-6 % of words


@pytest.mark.parametrize("kind", MODELS)
def test_general_perplexity_is_exp_mean_nll(kind, tok):
    model = MODELS[kind](tok.vocab_size)
    text = general_text()[:4000]
    ids = torch.tensor(text_ids(tok, text))
    window = 64
    n = (len(ids) - 1) // window                     # every window fits in max_windows=1000: all are used
    with torch.no_grad():
        nll = torch.cat([torch.nn.functional.cross_entropy(model(ids[None, i * window:(i + 1) * window]).logits[0],
                                                           ids[i * window + 1:(i + 1) * window + 1], reduction="none")
                         for i in range(n)])
    ppl = general_perplexity(model, tok, text, window=window, max_windows=1000)
    assert n >= 10 and math.isfinite(ppl)
    assert ppl == pytest.approx(math.exp(nll.mean().item()), rel=1e-5)
    assert 100 < general_perplexity(model, tok, window=32, max_windows=4) < 10 * tok.vocab_size  # random model: near V
