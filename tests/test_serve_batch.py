"""Batched generation (serve/batch.py): sequences of different lengths run together give the tokens each gives
alone (greedy, and sampled with a seed), through the KV cache, past the context (window) and on the byte GPT
(no cache); 16 concurrent streams of the official `openai` client all complete while a document is learned."""
import concurrent.futures

import pytest
import torch
from tiny_models import hf_gpt2, hf_llama, ours

from forgetless.models.gpt import logits_of
from forgetless.serve.batch import DONE, Batcher, Sequence, pick


def alone(model, ids: list[int], n: int, block: int, temperature: float = 0.0, seed: int = 0) -> list[int]:
    """The reference: one sequence, no cache, the whole window each token (as serve generated before batching)."""
    ids, generator = list(ids), torch.Generator().manual_seed(seed)
    for _ in range(n):
        logits = logits_of(model, torch.tensor([ids[-block:]]))[:, -1].float()  # (1, V)
        ids.append(int(pick(logits, temperature, 0.9, generator)))
    return ids


def batched(model, prompts: list[list[int]], n: int, block: int, temperature: float = 0.0) -> tuple[list, Batcher]:
    """Every prompt's sequence stepped together by the batcher's `step` (its thread closed: the steps are ours);
    the second prompt joins one step late, as a request arriving mid-stream does."""
    batcher = Batcher(block)
    batcher.close()
    seqs = [Sequence(model, list(p), n, temperature, 0.9, torch.Generator().manual_seed(i))
            for i, p in enumerate(prompts)]
    group = [seqs[0]]
    while group:
        batcher.step(group)
        group = [s for s in seqs if s.left > 0 and (s is not seqs[1] or batcher.steps > 1)]
    return [s.ids for s in seqs], batcher


@pytest.mark.parametrize("kind", ["llama", "gpt2", "gpt"])
def test_batched_greedy_and_seeded_sampling_equal_one_sequence_at_a_time(kind):
    """Prompts of 3..11 tokens, 16 new tokens each: past the context of the GPTs (16) on the way (their window
    slides); the Llama (context 32) keeps its cache. Tokens are equal: rounding of a batched forward (~1e-6)
    could only flip a token where two logits are that close, which these random models do not have."""
    model = {"llama": hf_llama, "gpt2": hf_gpt2, "gpt": ours}[kind]().eval()
    block = 32 if kind == "llama" else 16
    prompts = [[(7 * i + j) % 200 + 1 for j in range(3 + 2 * i)] for i in range(5)]
    for temperature in (0.0, 1.0):
        with torch.no_grad():
            out, batcher = batched(model, prompts, 16, block, temperature)
            assert out == [alone(model, p, 16, block, temperature, i) for i, p in enumerate(prompts)]
        assert batcher.rows > 2 * batcher.steps  # forwards were shared (5 sequences; a step may run 3: prefill, cache, window)


def test_a_sequence_gets_its_tokens_then_done_and_an_abandoned_one_leaves_the_batch():
    model = hf_llama().eval()
    batcher = Batcher(32)
    try:
        s = batcher.submit(Sequence(model, [1, 2, 3], 5, 0.0, 1.0, torch.Generator()))
        tokens = [s.out.get(timeout=30) for _ in range(6)]
        assert tokens[-1] is DONE and tokens[:5] == alone(model, [1, 2, 3], 5, 32)[3:]
        long = batcher.submit(Sequence(model, [1, 2, 3], 10 ** 6, 0.0, 1.0, torch.Generator()))
        long.out.get(timeout=30)
        long.abandoned = True
        ok = batcher.submit(Sequence(model, [4], 2, 0.0, 1.0, torch.Generator()))
        assert [ok.out.get(timeout=30) for _ in range(3)][-1] is DONE  # the abandoned one did not block it
        assert batcher.submit(Sequence(model, [4], 0, 0.0, 1.0, torch.Generator())).out.get(timeout=1) is DONE
    finally:
        batcher.close()
    assert not batcher.thread.is_alive()


def test_16_concurrent_openai_streams_complete_equal_to_sequential_and_while_learning(tmp_path):
    pytest.importorskip("fastapi", reason="forgetless serve needs FastAPI (bash scripts/setup.sh dev or serve)")
    openai = pytest.importorskip("openai", reason="the streams are the official openai client's (bash scripts/setup.sh dev)")
    from test_serve import TOKEN, served
    from test_serve_openai import QUESTION, chat_engine

    from forgetless.serve.app import make_app

    e = chat_engine(tmp_path / "state")
    try:
        with served(make_app(e, TOKEN, model_name="tiny-chat")) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key=TOKEN, max_retries=0, timeout=120)
            questions = [[{"role": "user", "content": f"Question {i}: the capital of France is?"}] for i in range(16)]

            def chat(messages):
                stream = client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=8,
                                                        temperature=0, stream=True)
                return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

            sequential = [chat(q) for q in questions]
            steps = e.batcher.steps
            with concurrent.futures.ThreadPoolExecutor(16) as pool:
                assert list(pool.map(chat, questions)) == sequential
            assert e.batcher.steps - steps < 16 * 8 / 2  # forwards were shared (alone: 16 x 8)
            with concurrent.futures.ThreadPoolExecutor(17) as pool:
                learned = pool.submit(client.post, "/learn", cast_to=object,
                                      body={"messages": [*QUESTION, {"role": "assistant", "content": "Paris."}]})
                assert all(pool.map(chat, questions))
                assert learned.result()["seq"] == 1
    finally:
        e.close()
