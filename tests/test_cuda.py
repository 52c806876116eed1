"""The CUDA check (`python -m pytest -m cuda`, which scripts/gpu-check.sh runs): every registered method
attaches, trains a few steps through forgetless.train (autocast in fp32, bf16 and fp16 with loss scaling,
the method's step hooks), saves and reloads on a CUDA device, on a tiny random transformers Llama and on our
GPT; the online protocol and serve run there too. Skipped without CUDA; FORGETLESS_TEST_DEVICE=cpu runs them
on the CPU (fp16 skipped), as `gpu-check.sh --dry-run` does to check the tests themselves."""
import os

import pytest
import torch

from forgetless import from_pretrained
from forgetless.continual.arm import adapt_task
from forgetless.continual.learner import chunk_windows
from forgetless.continual.online import run_online
from forgetless.data.domains import Domain
from forgetless.presets import AdaptConfig, build_config
from test_contract import NAMES, T, attached, base, logits, snapshot, windows
from tiny_models import ours

DEVICE = torch.device(os.environ.get("FORGETLESS_TEST_DEVICE", "cuda"))
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(DEVICE.type == "cuda" and not torch.cuda.is_available(),
                                                   reason="needs a CUDA device")]
PRECISIONS = ["fp32", "bf16", "fp16"]
STEPS = 8  # fp16's loss scaler skips the first steps whose scaled gradients overflow


def needs_cuda_for(precision: str):
    if precision == "fp16" and DEVICE.type != "cuda":
        pytest.skip("fp16 autocast needs CUDA")


def domain(seed: int) -> Domain:
    """Random token ids as a domain: training stream and held-out windows of T tokens."""
    tokens = torch.randint(0, 256, (2000,), generator=torch.Generator().manual_seed(seed))
    return Domain(f"random-{seed}", tokens, tokens, chunk_windows(tokens[:400], T), [], f"random-{seed}")


def on_device(module) -> list[str]:
    """Names of the parameters and buffers of `module` that are not on DEVICE."""
    return [n for n, t in [*module.named_parameters(), *module.named_buffers()] if t.device.type != DEVICE.type]


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("kind", ["gpt", "llama"])
@pytest.mark.parametrize("name", NAMES)
def test_method_trains_saves_and_reloads_on_the_device(name, kind, precision, tmp_path):
    needs_cuda_for(precision)
    adapted = attached(kind, name, base(kind, name).to(DEVICE))
    before = snapshot(adapted.model)
    cfg = AdaptConfig(steps=STEPS, batch_size=4, lr=1e-2, warmup=0, weight_decay=0.0, eval_every=STEPS,
                      ckpt_every=STEPS, precision=precision)
    history, params = adapt_task(adapted, domain(1), domain(2), cfg, 1, sampler_seed=0)
    assert not on_device(adapted), on_device(adapted)[:3]
    assert all(torch.isfinite(torch.tensor(loss)) for _, loss in history.loss), history.loss
    moved = {n for n, p in adapted.model.named_parameters() if not torch.equal(p, before[n])}
    assert moved and all(torch.isfinite(p).all() for _, p in params), "no trainable parameter moved"

    adapted.save_pretrained(tmp_path)
    reloaded = from_pretrained(base(kind, name).to(DEVICE), tmp_path)
    assert not on_device(reloaded), on_device(reloaded)[:3]
    mine = dict(adapted.model.named_parameters())
    differ = [n for n, p in reloaded.model.named_parameters() if not torch.equal(p, mine[n])]
    assert not differ, f"reloaded parameters differ: {differ[:3]}"
    x = windows(seed=3)[:, :-1].to(DEVICE)
    torch.testing.assert_close(logits(reloaded, x), logits(adapted, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_online_protocol_on_the_device(precision, text_file, tmp_path):
    cfg = build_config("smoke", {"data": {"domain_a": str(text_file), "domain_b": f"renamed:{text_file}"},
                                 "adapt": {"precision": precision}})
    results = run_online(cfg, ["full", "lora", "apn"], [0], tmp_path, "smoke", device=DEVICE.type)
    assert results["device"].startswith(DEVICE.type)
    for name, m in results["methods"].items():
        assert torch.isfinite(torch.tensor(m["prequential_loss"]["mean"])), name
    assert results["methods"]["full"]["gain_vs_frozen"]["mean"] > 0


def test_serve_learns_scores_and_generates_on_the_device(text_file, tmp_path):
    pytest.importorskip("fastapi", reason="forgetless serve needs FastAPI (carried as wheels by gpu-check.sh)")
    from fastapi.testclient import TestClient

    from forgetless.data.tokenizers import ByteTokenizer
    from forgetless.serve.app import make_app
    from forgetless.serve.engine import Engine, ServeConfig

    text = text_file.read_text()
    canary = chunk_windows(ByteTokenizer().encode(text[-3000:].encode()), 16)[:8]
    engine = Engine(ours().to(DEVICE), ByteTokenizer(), canary, 16,
                    ServeConfig(method="lora", lr=3e-3, canary_every=1, snapshot_every=2), tmp_path / "state")
    client, auth = TestClient(make_app(engine, "token"), base_url="http://localhost"), {"Authorization": "Bearer token"}
    for i in range(3):
        reply = client.post("/v1/learn", json={"text": text[i * 500:(i + 1) * 500]}, headers=auth)
        assert reply.status_code == 200 and reply.json()["seq"] == i + 1, reply.text
    score = client.post("/v1/score", json={"text": text[:400]}).json()
    assert torch.isfinite(torch.tensor(score["loss"])), score
    greedy = {"prompt": "ROMEO:", "max_tokens": 8, "temperature": 0}
    first = client.post("/v1/generate", json=greedy)
    assert first.status_code == 200 and first.text == client.post("/v1/generate", json=greedy).text
    assert not on_device(engine.learner.adapted), on_device(engine.learner.adapted)[:3]
