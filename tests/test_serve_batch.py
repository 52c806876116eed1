"""Batched generation (serve/batch.py): sequences of different lengths run together give the tokens each gives
alone (greedy, and sampled with a seed), through the KV cache, past the context (window) and on the byte GPT
(no cache); prompts that join together run in one prefill forward and get their first token in that step;
learning waits between its steps while a generation runs, and a running step pauses at its next layer (a steady load
cannot starve it); 16 concurrent
streams of the official `openai` client all complete while a document is learned."""
import concurrent.futures
import json
import time

import pytest
import torch
from tiny_models import SENTENCES, hf_gpt2, hf_llama, ours

from forgetless.continual.learner import chunk_windows
from forgetless.data.tokenizers import ByteTokenizer
from forgetless.errors import ForgetlessError
from forgetless.models.gpt import logits_of
from forgetless.serve.batch import DONE, Batcher, Sequence, pick
from forgetless.serve.engine import WAL, Engine, ServeConfig


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


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_prompts_that_join_together_run_in_one_prefill_and_each_gets_its_first_token_in_that_step(kind):
    """Three prompts (1, 5 and 12 tokens) join a decoding sequence: one right-padded prefill forward of the three and
    one decode forward, each joiner has a token after that step, and every sequence's greedy tokens equal its own
    run alone (the GPT-2's context is 16: the longest passes it and slides its window)."""
    model = {"llama": hf_llama, "gpt2": hf_gpt2}[kind]().eval()
    block = 32 if kind == "llama" else 16
    shapes = []  # (B, T) of each forward of the model
    model.register_forward_pre_hook(lambda m, args, kwargs: shapes.append(
        tuple((args[0] if args else kwargs["input_ids"]).shape)), with_kwargs=True)
    batcher = Batcher(block)
    batcher.close()
    prompts = [[5, 6, 7], [9], [1, 2, 3, 4, 5], list(range(10, 22))]
    seqs = [Sequence(model, list(p), 6, 0.0, 1.0, torch.Generator()) for p in prompts]
    with torch.no_grad():
        batcher.step(seqs[:1])
        batcher.step(seqs[:1])
        shapes.clear()
        batcher.step(seqs)  # three join mid-stream
        assert shapes == [(3, 12), (1, 1)]  # one prefill of the three prompts, one decode of the first
        assert [s.out.qsize() for s in seqs] == [3, 1, 1, 1]
        while group := [s for s in seqs if s.left]:
            batcher.step(group)
        assert [s.ids for s in seqs] == [alone(model, p, 6, block) for p in prompts]


def test_learning_waits_between_its_steps_while_a_generation_runs_then_learns_the_document(tmp_path):
    """A document sent while a sequence decodes: the learner waits before its first step (no update while the
    sequence runs, 20 more tokens later still none, nothing logged yet), and learns all its updates once the
    sequence leaves; the log holds it."""
    e = gpt_engine(tmp_path / "state")
    live = []  # sequences waiting or decoding at each learning update
    update = e.learner.learn
    e.learner.learn = lambda windows, steps=1: live.append(e.batcher.live) or update(windows, steps)
    try:
        s = e.batcher.submit(Sequence(e.serving[1], [1, 2, 3], 10 ** 6, 0.0, 1.0, torch.Generator()))
        s.out.get(timeout=30)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            learned = pool.submit(e.learn, DOC)
            deadline = time.monotonic() + 30
            while not e.counters["yielded"]:  # the learner has reached its first wait
                assert time.monotonic() < deadline and not learned.done()
                time.sleep(0.01)
            for _ in range(20):
                s.out.get(timeout=30)
            assert live == [] and not learned.done() and e.seq == 0
            s.abandoned = True  # its client leaves: nothing is generating
            assert learned.result(timeout=60)["seq"] == 1
        assert live == [0, 0, 0] and e.learner.steps == 3 and e.counters["yielded"] == 1
    finally:
        e.close()
    assert [json.loads(line)["seq"] for line in (tmp_path / "state" / WAL).read_text().splitlines()] == [1]


def test_a_steady_generation_load_does_not_starve_learning(tmp_path):
    """With --serve-learn-wait-max 0.05 each learning step (the screen's forward, 3 updates, the publish) waits
    0.05 s, then runs beside a generation that never ends."""
    with pytest.raises(ForgetlessError, match="learn_wait_max"):
        ServeConfig(learn_wait_max=-1)
    e = gpt_engine(tmp_path / "state", learn_wait_max=0.05)
    live = []
    update = e.learner.learn
    e.learner.learn = lambda windows, steps=1: live.append(e.batcher.live) or update(windows, steps)
    try:
        s = e.batcher.submit(Sequence(e.serving[1], [1, 2, 3], 10 ** 6, 0.0, 1.0, torch.Generator()))
        s.out.get(timeout=30)
        assert e.learn(DOC)["seq"] == 1
        assert live == [1, 1, 1] and e.counters["yielded"] == 5 and e.yield_seconds >= 5 * 0.05
        s.abandoned = True
    finally:
        e.close()


def test_a_running_learning_step_pauses_at_its_next_layer_while_a_generation_arrived_mid_step(tmp_path):
    """A generation submitted from inside a learning update (before its first layer): at each later layer boundary
    the update waits until nothing is waiting or decoding, so no learner layer runs beside the generation; the
    readers' copy of the model, which carries the same hooks, never pauses."""
    e = gpt_engine(tmp_path / "state")
    layers = [m for m in e.learner.model.modules() if isinstance(m, torch.nn.ModuleList)][0]
    seen, started = [], []  # sequences alive at each learner layer's forward after the submission

    def submit_once(module, args):
        if not started and e.learner.model.training:
            started.append(e.batcher.submit(Sequence(e.serving[1], [1, 2, 3], 30, 0.0, 1.0, torch.Generator())))
        elif started:
            seen.append(e.batcher.live)

    handles = [layers[0].register_forward_pre_hook(submit_once), layers[1].register_forward_pre_hook(submit_once)]
    try:
        assert e.learn(DOC)["seq"] == 1
        assert started and seen and set(seen) == {0} and e.counters["paused"] >= 1
        tokens = [started[0].out.get(timeout=30) for _ in range(31)]
        assert tokens[-1] is DONE and DONE not in tokens[:-1]  # all 30 tokens made while the update waited
        for h in handles:
            h.remove()
        paused = e.counters["paused"]
        s = e.batcher.submit(Sequence(e.serving[1], [1, 2, 3], 10 ** 6, 0.0, 1.0, torch.Generator()))
        s.out.get(timeout=30)
        e.deadline = time.monotonic() + 60  # as inside a learning step
        t0 = time.monotonic()
        with torch.no_grad():
            logits_of(e.serving[1], torch.tensor([[1, 2, 3]]))  # the readers' copy: runs at once
        assert time.monotonic() - t0 < 5 and e.counters["paused"] == paused
        s.abandoned = True
    finally:
        e.close()


def test_a_running_learning_step_pauses_in_its_backward_while_a_generation_arrived_there(tmp_path):
    """A generation submitted when the gradient of the last layer's output arrives: when the next layer's arrives,
    the backward has waited until nothing is waiting or decoding."""
    e = gpt_engine(tmp_path / "state")
    layers = [m for m in e.learner.model.modules() if isinstance(m, torch.nn.ModuleList)][0]
    seen, started = [], []  # sequences alive when the first layer's output gradient arrives, after the submission

    def submit(grad):
        if not started:
            started.append(e.batcher.submit(Sequence(e.serving[1], [1, 2, 3], 30, 0.0, 1.0, torch.Generator())))

    def record(grad):
        if started:
            seen.append(e.batcher.live)

    def on(hook):  # registers `hook` on a layer's output in training forwards, after the engine's own
        def forward_hook(module, args, out):
            if out.requires_grad:
                out.register_hook(hook)
        return forward_hook

    handles = [layers[-1].register_forward_hook(on(submit)), layers[0].register_forward_hook(on(record))]
    try:
        assert e.learn(DOC)["seq"] == 1
        assert started and seen and set(seen) == {0} and e.counters["paused"] >= 1
    finally:
        for h in handles:
            h.remove()
        e.close()


DOC = " ".join(SENTENCES)


def gpt_engine(state_dir, **options) -> Engine:
    """A tiny byte GPT (context 16) learning each document in 3 full updates, the screen open."""
    canary = chunk_windows(ByteTokenizer().encode(" ".join(SENTENCES * 4).encode()), 16)[:4]
    cfg = ServeConfig(method="full", steps_per_doc=3, max_canary_rise=100, screen_k=0, screen_low_k=0, **options)
    return Engine(ours(), ByteTokenizer(), canary, 16, cfg, state_dir)


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
