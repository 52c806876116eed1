"""`forgetless serve` under chat load with the official `openai` client: time to first token and tokens/s of
`--streams` concurrent streamed chat completions, learning off and on, against a plain transformers `generate`
loop on the same model measured in the same run.

Server: `forgetless serve --model MODEL` in a subprocess on loopback (`--threads` torch threads, LoRA learning,
no rate limit, the gate open: a load test, not a retention one). Arms, in order, on one server: one stream alone;
`--streams` streams (learning off); the same streams while one more client sends chat corrections to /v1/learn
back to back (learning on). Each stream asks its own question, greedy, `--tokens` new tokens at most (a stream
may end earlier at the end-of-text token: tokens are counted from the usage the server reports). TTFT: from the
request to the first chunk with content. Per arm, from the server's metrics: its generation forwards and the rows
they carried (rows / forwards: the mean batch), and the learning steps that waited for generation (generation has
priority: `--serve-learn-wait-max`, docs/serving.md). Baseline, after the server is stopped: `model.generate`
(greedy, KV cache) on the same prompts in this process, one stream, then the streams one after another; how many
of the learning-off arm's texts equal `generate`'s is printed (the same work on both sides). Both sides run
untimed first: the server one stream and then `--streams` streams (first-call costs of the model and of the
batched shapes), the baseline one request.

Goals (issue 51): p99 TTFT learning on <= 1.3 x learning off; aggregate tokens/s of the streams >= 4 x one stream's.

    python benchmarks/bench_serve_load.py [--model smollm2-135m] [--streams 16] [--tokens 16] [--threads 2]
    python benchmarks/bench_serve_load.py --quick   # a tiny random Llama, seconds: a check of the script
    python benchmarks/bench_serve_load.py --tokens 64 --question 'Question {i}: tell me about the history of Paris.'
"""
from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
from _timing import provenance
from bench_serve import CORPUS, TOKEN, free_port, launch

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def parse_args() -> argparse.Namespace:
    global QUESTION
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="what `forgetless serve --model` takes")
    parser.add_argument("--streams", type=int, default=16, help="concurrent chat streams")
    parser.add_argument("--tokens", type=int, default=16, help="new tokens per stream (at most)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads, server and baseline")
    parser.add_argument("--question", default=QUESTION, help="each stream's question, {i} its number (a question "
                        "with a long answer keeps every stream going to --tokens)")
    parser.add_argument("--quick", action="store_true", help="a tiny random Llama with a chat template, 4 tokens")
    args = parser.parse_args()
    QUESTION = args.question
    if args.quick:
        args.tokens = min(args.tokens, 4)
    return args


def tiny_model(folder: Path) -> str:
    """A tiny random Llama and a byte-level BPE with a chat template, saved as a transformers folder: `hf:FOLDER`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator([TEMPLATE, "What is the capital of France? Paris."] * 4, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    hf.chat_template = TEMPLATE
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                 num_key_value_heads=1, vocab_size=len(hf), max_position_embeddings=256,
                                 eos_token_id=0)).save_pretrained(folder)
    hf.save_pretrained(folder)
    return f"hf:{folder}"


def start_server(args, model: str, folder: Path) -> tuple[subprocess.Popen, str]:
    (folder / "token").write_text(TOKEN)
    (folder / "token").chmod(0o600)  # serve refuses a token file others can read
    port = free_port()
    command = [sys.executable, "-m", "forgetless", "serve", "--model", model, "--canary", CORPUS, "--canary-windows",
               "2", "--block-size", "256", "--state-dir", folder / "state", "--token-file", folder / "token", "--port",
               port, "--serve-method", "lora", "--serve-learn-per-minute", "0", "--serve-screen-k", "0",
               "--serve-screen-low-k", "0", "--serve-max-canary-rise", "100", "--device", "cpu"]
    return launch(command, args.threads, 900)


QUESTION = "Question {i}: in one sentence, what is the capital of France?"  # --question sets it


def question(i: int) -> list[dict]:
    return [{"role": "user", "content": QUESTION.format(i=i)}]


async def run_arm(url: str, streams: int, tokens: int, learn: bool) -> dict:
    """`streams` concurrent streamed chat completions (and chat corrections sent to /v1/learn when `learn`)."""
    from openai import AsyncOpenAI
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key=TOKEN, max_retries=0, timeout=1800)
    ttft, rates, counts, errors, learned, done = [], [], [], [], 0, asyncio.Event()
    texts: dict[int, str] = {}
    before = metrics(url)

    async def chat(i: int):
        t0 = time.perf_counter()
        first = None
        try:
            stream = await client.chat.completions.create(model=None, messages=question(i), max_tokens=tokens,
                                                          temperature=0, stream=True,
                                                          stream_options={"include_usage": True})
            pieces = []
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    first = time.perf_counter() - t0 if first is None else first
                    pieces.append(chunk.choices[0].delta.content)
                if chunk.usage:
                    counts.append(chunk.usage.completion_tokens)
                    rates.append(chunk.usage.completion_tokens / (time.perf_counter() - t0))
            ttft.append(first if first is not None else time.perf_counter() - t0)
            texts[i] = "".join(pieces)
        except Exception as e:  # noqa: BLE001 - counted and named, the load goes on
            errors.append(f"{type(e).__name__}: {e}"[:200])

    async def learner():
        nonlocal learned
        i = 0
        while not done.is_set():
            doc = {"messages": [*question(i), {"role": "assistant", "content": "Paris is the capital of France."}]}
            try:
                await client.post("/learn", cast_to=object, body=doc)
                learned += 1
            except Exception as e:  # noqa: BLE001 - counted and named
                errors.append(f"learn {type(e).__name__}: {e}"[:200])
            i += 1

    background = asyncio.create_task(learner()) if learn else None
    if learn:
        await asyncio.sleep(0.5)  # the learner has started a document
    t0 = time.perf_counter()
    await asyncio.gather(*(chat(i) for i in range(streams)))
    seconds = time.perf_counter() - t0
    done.set()
    if background:
        await background
    await client.close()
    after = {k: v - before.get(k, 0.0) for k, v in metrics(url).items()}
    forwards = after["generation_forwards_total"]
    return {"streams": streams, "learn": learn, "ttft_p50_s": quantile(ttft, 0.5), "ttft_p99_s": quantile(ttft, 0.99),
            "tokens": sum(counts), "seconds": seconds, "tokens_per_s": sum(counts) / seconds,
            "per_stream_tokens_per_s": statistics.median(rates) if rates else 0.0, "errors": errors,
            "learned": learned, "forwards": forwards,
            "mean_batch": after["generation_rows_total"] / forwards if forwards else float("nan"),
            "learn_yields": after["learn_yields_total"], "learn_pauses": after["learn_pauses_total"],
            "learn_yield_s": after["learn_yield_seconds_total"],
            "texts": [texts.get(i) for i in range(streams)]}


def metrics(url: str) -> dict[str, float]:
    """The server's unlabelled Prometheus metrics, without the forgetless_ prefix."""
    text = httpx.get(f"{url}/v1/metrics", timeout=60).text
    return {m[1]: float(m[2]) for m in re.finditer(r"^forgetless_(\w+) (\S+)$", text, re.MULTILINE)}


def quantile(values: list[float], q: float) -> float:
    """The q-quantile (nearest rank; p99 of 16 values is the largest)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]


@torch.no_grad()
def baseline(model_spec: str, streams: int, tokens: int) -> dict:
    """A plain transformers `generate` loop (greedy, its KV cache) on the same model: one stream, then `streams`
    streams one after another; tokens/s of each."""
    from forgetless.models.hf import load_model
    model, tokenizer = load_model(model_spec, "cpu")
    model.eval()
    hf = tokenizer.hf
    out = {}
    for name, n in (("warm-up", 1), ("one", 1), ("sequential", streams)):  # the warm-up as the server's, untimed
        count, texts, t0 = 0, [], time.perf_counter()
        for i in range(n):
            ids = torch.tensor([hf.apply_chat_template(question(i), add_generation_prompt=True, tokenize=True,
                                                       return_dict=False)])
            new = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, do_sample=False,
                                 pad_token_id=hf.eos_token_id)
            count += new.shape[1] - ids.shape[1]
            texts.append(hf.decode(new[0, ids.shape[1]:], skip_special_tokens=True))
        seconds = time.perf_counter() - t0
        out[name] = {"tokens": count, "seconds": seconds, "tokens_per_s": count / seconds, "texts": texts}
    del out["warm-up"]
    return out


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model = tiny_model(folder / "tiny") if args.quick else args.model
        proc, url = start_server(args, model, folder)
        try:
            asyncio.run(run_arm(url, 1, args.tokens, False))  # warm-up, untimed: first-call costs of the model
            asyncio.run(run_arm(url, args.streams, args.tokens, False))  # and of the batched shapes
            arms = [asyncio.run(run_arm(url, 1, args.tokens, False)),
                    asyncio.run(run_arm(url, args.streams, args.tokens, False)),
                    asyncio.run(run_arm(url, args.streams, args.tokens, True))]
        finally:
            proc.kill()
            proc.wait()
        base = baseline(model, args.streams, args.tokens)
    one, off, on = arms
    print(f"{'arm':<28}{'TTFT p50 s':>11}{'TTFT p99 s':>11}{'tok/s all':>10}{'tok/s each':>11}{'tokens':>7}"
          f"{'errors':>7}{'learned':>8}{'forwards':>9}{'batch':>6}{'yields':>7}{'pauses':>7}{'waited s':>9}")
    for arm, name in zip(arms, ("serve, 1 stream", f"serve, {args.streams} streams, learn off",
                                f"serve, {args.streams} streams, learn on")):
        print(f"{name:<28}{arm['ttft_p50_s']:>11.3f}{arm['ttft_p99_s']:>11.3f}{arm['tokens_per_s']:>10.1f}"
              f"{arm['per_stream_tokens_per_s']:>11.1f}{arm['tokens']:>7}{len(arm['errors']):>7}{arm['learned']:>8}"
              f"{arm['forwards']:>9.0f}{arm['mean_batch']:>6.1f}{arm['learn_yields']:>7.0f}{arm['learn_pauses']:>7.0f}"
              f"{arm['learn_yield_s']:>9.1f}")
    for name, b in (("generate, 1 stream", base["one"]), (f"generate, {args.streams} in a row", base["sequential"])):
        print(f"{name:<28}{'':>11}{'':>11}{b['tokens_per_s']:>10.1f}{'':>11}{b['tokens']:>7}")
    ratios = {"p99_ttft_on_over_off": on["ttft_p99_s"] / off["ttft_p99_s"],
              "tokens_per_s_streams_over_one": off["tokens_per_s"] / one["tokens_per_s"],
              "tokens_per_s_streams_over_generate_one": off["tokens_per_s"] / base["one"]["tokens_per_s"],
              "tokens_per_s_streams_over_generate_sequential": off["tokens_per_s"] / base["sequential"]["tokens_per_s"]}
    print(f"p99 TTFT learning on / off: {ratios['p99_ttft_on_over_off']:.2f} (goal <= 1.3); aggregate tok/s "
          f"{args.streams} streams / 1 stream: {ratios['tokens_per_s_streams_over_one']:.2f} (goal >= 4); "
          f"/ generate 1 stream: {ratios['tokens_per_s_streams_over_generate_one']:.2f}; / generate "
          f"{args.streams} in a row: {ratios['tokens_per_s_streams_over_generate_sequential']:.2f}")
    same = sum(a == b for a, b in zip(off["texts"], base["sequential"]["texts"]))
    print(f"greedy texts of the {args.streams} streams (learning off) equal to generate's: {same} of {args.streams}")
    for arm in arms:
        for e in arm["errors"][:3]:
            print(f"error ({arm['streams']} streams, learn {'on' if arm['learn'] else 'off'}): {e}")
    print(json.dumps({"config": {**vars(args), "model": model if not args.quick else "llama-tiny"}, "arms": arms,
                      "baseline": base, "ratios": ratios, "provenance": provenance()}))


if __name__ == "__main__":
    main()
