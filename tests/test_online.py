"""The online protocol: prequential scoring before learning, the frozen and dynamic-evaluation baselines,
results.json, the report and the CLI."""
import copy
import json

import pytest
import torch
from typer.testing import CliRunner

from forgetless import attach
from forgetless.cli import app
from forgetless.continual.evaluate import evaluate
from forgetless.continual.learner import Learner, chunk_windows
from forgetless.continual.online import Frozen, run_online, run_online_arm
from forgetless.data.domains import Domain
from forgetless.methods import build_method
from forgetless.presets import AdaptConfig, OnlineConfig, build_config
from forgetless.report import write_report
from tiny_models import ours
from tiny_results import round_trips

STREAM = {"data": {"domain_a": "tinyshakespeare", "domain_b": "renamed:tinyshakespeare"}}


def tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


def domain() -> Domain:
    t = tokens(2000, 0)
    return Domain("a", t, t, chunk_windows(t[:400], 16), [], "fp")


def chunks(n: int = 3) -> list[torch.Tensor]:
    return [chunk_windows(tokens(81, 10 + i), 16) for i in range(n)]  # (5, 17) each


def run(method, chunk_list, cfg=None, model=None):
    model = model or ours()
    cfg = cfg or AdaptConfig(lr=1e-2, warmup=0, weight_decay=0.0)
    return run_online_arm(model, method, chunk_list, domain().windows, domain(), cfg,
                          OnlineConfig(chunks=len(chunk_list), canary_every=1), seed=0)


def test_each_chunk_is_scored_before_it_is_learned():
    chunk = chunks(1)[0]
    unseen = evaluate(ours(), chunk)["loss"]
    result = run(build_method("full"), [chunk, chunk, chunk])
    assert result["prequential"][0] == unseen  # learning first would have lowered it
    assert result["prequential"][1] < unseen and result["prequential"][2] < result["prequential"][1]
    assert result["updates"] == 3 and result["updates_per_s"] > 0


def test_frozen_arm_is_scoring_without_updates():
    stream, model = chunks(), ours()
    before = copy.deepcopy(model.state_dict())
    result = run(Frozen(Frozen.Config()), stream, model=model)
    assert result["prequential"] == [evaluate(ours(), c)["loss"] for c in stream]
    assert len({loss for _, loss in result["canary"]}) == 1 and result["updates"] == 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_dynamic_eval_decays_toward_the_original_weights():
    decay = 0.25
    adapted = attach(ours(), "dynamic-eval", decay=decay)
    origin = {k: v.clone() for k, v in adapted.model.state_dict().items()}
    with torch.no_grad():
        for p in adapted.model.parameters():
            p.add_(1.0)
    adapted.method.after_step(adapted.model, None, 1, False)
    for name, p in adapted.model.named_parameters():
        torch.testing.assert_close(p, origin[name] + (1 - decay), rtol=0, atol=1e-6)


def test_dynamic_eval_step_is_sgd_then_decay():
    decay, lr, stream = 0.1, 0.05, chunks(1)
    model, reference = ours(), ours()
    learner = Learner(model, build_method("dynamic-eval", {"decay": decay, "lr": lr}),
                      AdaptConfig(grad_clip=0.0, warmup=0))
    origin = {k: v.clone() for k, v in reference.named_parameters()}
    reference.train()
    loss = attach(reference, "full").loss(stream[0])
    loss.backward()
    learner.learn(stream[0], 1)
    with torch.no_grad():
        for name, p in reference.named_parameters():
            expected = p - lr * p.grad
            expected += decay * (origin[name] - expected)
            torch.testing.assert_close(dict(model.named_parameters())[name], expected, rtol=1e-5, atol=1e-6)


def test_online_bench_writes_results_report_and_table(tmp_path):
    cfg = build_config("smoke", STREAM)
    results = run_online(cfg, ["full", "lora", "apn"], [0], tmp_path, "smoke")
    assert results["protocol"] == "online"
    assert list(results["methods"]) == ["frozen", "dynamic-eval", "full", "lora", "apn"]
    s = results["stream"]
    assert s["chunks"] == 6 and s["switch_chunk"] == 3 and s["chunk_tokens"] == 256 and len(s["positions"]) == 6
    assert results["config"]["online"]["steps_per_chunk"] == 1
    for m in results["methods"].values():
        for key in ("prequential_loss", "prequential_loss_a", "prequential_loss_b", "canary_ppl_before",
                    "canary_ppl_after", "forgetting", "gain_vs_frozen", "gain_vs_dynamic_eval", "updates_per_s"):
            assert set(m[key]) >= {"mean", "std"}
        assert len(m["curves"]["prequential_loss"]["mean"]) == 6 and m["curves"]["canary_position"] == [0, 512, 1024, 1536]
    frozen, dynamic, full = (results["methods"][k] for k in ("frozen", "dynamic-eval", "full"))
    assert frozen["gain_vs_frozen"]["mean"] == 0 and dynamic["gain_vs_dynamic_eval"]["mean"] == 0
    assert frozen["updates_per_s"]["mean"] is None and frozen["forgetting"]["mean"] == 0
    assert full["gain_vs_frozen"]["mean"] > 0 and full["updates"] == 6
    apn = results["methods"]["apn"]  # compared with its own (APN) base without updates, not the dense one
    assert abs(apn["gain_vs_frozen"]["mean"]) < 0.01 < abs(apn["prequential_loss"]["mean"] - frozen["prequential_loss"]["mean"])
    results["methods"]["lora[lr=3e-3]"] = results["methods"]["lora"]  # two arms of one method: no frontier here
    files = write_report(results, tmp_path)
    assert {f.name for f in files} == {"results.json", "results.csv", "results.md", "online.png",
                                       "online_tradeoff.png"}
    assert "gain vs dynamic-eval" in (tmp_path / "results.md").read_text() and round_trips(tmp_path / "results.json")
    again = run_online(cfg, ["full", "lora", "apn"], [0], tmp_path, "smoke")  # saved arms are reused
    assert again["methods"]["full"]["prequential_loss"] == full["prequential_loss"]
    assert json.loads((tmp_path / "results.json").read_text())["methods"]["lora"]["method"] == "lora"


def test_other_protocols_keep_their_config_hashes():
    cfg = build_config("smoke", {"online": {"chunks": 3}})
    assert "online" not in cfg.to_dict() and cfg.online.chunks == 3


@pytest.mark.parametrize("args, message", [
    (["--online-chunks", "0"], "online.chunks must be positive"),
    (["--online-chunks", "100000"], "lower --online-chunks"),
])
def test_bad_online_config_is_one_line(tmp_path, args, message):
    result = CliRunner().invoke(app, ["bench", "--protocol", "online", "--preset", "smoke", "--methods", "full",
                                      "--domain-a", "tinyshakespeare", "--domain-b", "renamed:tinyshakespeare",
                                      "--seeds", "1", "--out", str(tmp_path), *args])
    assert result.exit_code == 2 and message in result.output and len(result.output.strip().splitlines()) <= 2
