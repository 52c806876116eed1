"""End to end through the CLI: smoke-preset bench, resume of arms, report, pretrain/adapt/eval, errors."""
import io
import json
import math
import os
import shutil
import statistics
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from forgetless.cli import app
from forgetless.cliutil import merge_overrides
from forgetless.errors import ForgetlessError
from forgetless.report.results import RunResult
from tiny_results import round_trips

runner = CliRunner()
CONTRACT_KEYS = {"ppl_a_before", "ppl_b_before", "ppl_a_after", "ppl_b_after", "acc_a_after", "acc_b_after",
                 "forgetting", "adaptation_gain", "trainable_params", "total_params", "wall_s", "peak_rss_mb"}


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    os.environ["FORGETLESS_CACHE"] = str(tmp_path_factory.getbasetemp() / "cache")
    result = invoke("bench", "--preset", "smoke", "--seeds", 2, "--out", out)
    assert result.exit_code == 0, result.output
    return out, result


def test_bench_smoke_writes_the_contract(smoke_run):
    out, result = smoke_run
    results = json.loads((out / "results.json").read_text())
    assert results["protocol"] == "two-domain" and results["preset"] == "smoke" and results["seeds"] == [0, 1]
    assert results["domains"] == {"a": "shakespeare-modern", "b": "shakespeare-folio"}
    fingerprints = results["data_fingerprints"]  # what the corpora held on this machine, split as used
    assert set(fingerprints) == {"a", "b"} and fingerprints["a"] != fingerprints["b"]
    assert all(isinstance(f, str) and len(f) >= 8 for f in fingerprints.values())
    assert list(results["methods"])[:4] == ["full", "ffn", "lora", "adapter"]
    for name, m in results["methods"].items():
        assert CONTRACT_KEYS <= set(m), name
        assert m["ppl_a_after"]["mean"] > 1 and m["ppl_a_after"]["std"] >= 0
        assert 0 < m["trainable_params"] <= m["total_params"]
    assert round_trips(out / "results.json")  # loaded as a RunResult and written back: the same text
    full = results["methods"]["full"]
    assert full["trainable_params"] == full["total_params"]
    assert full["adaptation_gain_dev"]["mean"] == pytest.approx(1.0)  # on validation windows too
    for m in results["methods"].values():
        assert m["ppl_b_dev_after"]["mean"] > 1 and m["forgetting_dev"]["mean"] == pytest.approx(
            m["ppl_a_dev_after"]["mean"] / m["ppl_a_dev_before"]["mean"] - 1, abs=0.05)
    for name in ("lora", "adapter"):  # G = ln-PPL_B drop of the arm / that of full, seed by seed
        arms = [json.loads((out / "arms" / label / f"seed{s}.json").read_text()) for label in (name, "full")
                for s in (0, 1)]
        drops = [math.log(a["ppl_b_before"] / a["ppl_b_after"]) for a in arms]
        expected = statistics.fmean([drops[0] / drops[2], drops[1] / drops[3]])
        assert results["methods"][name]["adaptation_gain"]["mean"] == pytest.approx(expected, rel=1e-9)
    assert full["ppl_b_after"]["mean"] < full["ppl_b_before"]["mean"]  # it adapted
    for f in ["results.csv", "results.md", "retention_vs_adaptation.png", "forgetting_curves.png", "loss_curves.png"]:
        assert (out / f).stat().st_size > 100, f
    assert "| full |" in (out / "results.md").read_text()
    assert "F %" in result.output and "PPL_B after" in result.output
    import platform
    import re
    from forgetless.config import code_fingerprint
    assert results["python"] == platform.python_version() and results["torch"] == torch.__version__
    assert results["code"] == code_fingerprint()
    import forgetless
    in_checkout = subprocess.run(["git", "-C", os.path.dirname(forgetless.__file__), "rev-parse", "HEAD"],
                                 capture_output=True, text=True)
    assert (re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", results["git_commit"]) and
            results["git_commit"].startswith(in_checkout.stdout.strip())) if in_checkout.returncode == 0 \
        else results["git_commit"] is None


def test_bench_table_fits_100_columns(smoke_run):
    """The terminal table keeps the columns a user reads first and fits 100 columns, even with the
    longest method labels; results.md has every column."""
    from rich.console import Console

    from forgetless.report import terminal_table
    out, _ = smoke_run
    results = json.loads((out / "results.json").read_text())
    results["methods"]["cms[periods=1,1,1,1;accumulate=updates]"] = next(iter(results["methods"].values()))
    console = Console(width=100, file=io.StringIO(), record=True)
    console.print(terminal_table(RunResult.from_json(results), "two-domain · smoke", "mean ± std over 2 seeds"))
    text = console.export_text()
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= 100, text


def test_bench_rerun_reuses_finished_arms(smoke_run):
    out, _ = smoke_run
    before = json.loads((out / "results.json").read_text())["methods"]
    again = invoke("bench", "--preset", "smoke", "--seeds", 2, "--out", out)
    assert again.exit_code == 0, again.output
    after = json.loads((out / "results.json").read_text())["methods"]
    assert after["lora"]["ppl_b_after"] == before["lora"]["ppl_b_after"]
    assert after["full"]["wall_s"] == before["full"]["wall_s"]  # not re-run
    assert "other forgetless code" not in again.output


def test_seed_start_runs_later_seeds_and_reuses_their_arms(smoke_run, tmp_path):
    out, _ = smoke_run
    copy = tmp_path / "run"
    shutil.copytree(out, copy)
    seed1 = (copy / "arms" / "full" / "seed1.json").read_text()
    again = invoke("bench", "--preset", "smoke", "--seeds", 1, "--seed-start", 1, "--out", copy)
    assert again.exit_code == 0, again.output
    assert json.loads((copy / "results.json").read_text())["seeds"] == [1]
    assert (copy / "arms" / "full" / "seed1.json").read_text() == seed1  # reused, not re-run
    bad = invoke("bench", "--preset", "smoke", "--seed-start", -1, "--out", tmp_path / "x")
    assert bad.exit_code == 2 and "--seed-start >= 0" in bad.output, bad.output


def test_bench_out_of_another_configuration_is_refused_unless_forced(smoke_run, tmp_path):
    out, _ = smoke_run
    copy = tmp_path / "run"
    shutil.copytree(out, copy)
    results = (copy / "results.json").read_text()
    for args, said in ((("--preset", "first"), "preset 'smoke' there, 'first' now"),
                       (("--preset", "smoke", "--methods", "lora"), "methods ")):
        r = invoke("bench", *args, "--seeds", 2, "--out", copy)
        assert r.exit_code == 2 and "holds a run of another configuration" in r.output and said in r.output, r.output
        assert "--force" in r.output and (copy / "results.json").read_text() == results
    (copy / "run.json").unlink()  # a run folder from before run.json: its results.json's preset
    r = invoke("bench", "--preset", "first", "--out", copy)
    assert r.exit_code == 2 and "preset 'smoke' there, 'first' now" in r.output, r.output
    forced = invoke("bench", "--preset", "smoke", "--methods", "lora", "--seeds", 2, "--out", copy, "--force")
    assert forced.exit_code == 0, forced.output
    assert set(json.loads((copy / "results.json").read_text())["methods"]) == {"full", "lora"}


def test_rerun_with_other_code_warns_and_reuses(smoke_run, monkeypatch):
    out, _ = smoke_run
    before = json.loads((out / "results.json").read_text())["methods"]
    monkeypatch.setattr("forgetless.continual.base_model.code_fingerprint", lambda: "0ther0c0de000")
    again = invoke("bench", "--preset", "smoke", "--seeds", 2, "--out", out)
    assert again.exit_code == 0, again.output
    lines = [line for line in again.output.splitlines() if "other forgetless code" in line]
    assert any("cached base" in line for line in lines) and any("arms" in line for line in lines)
    assert all("now 0ther0c0de000" in line for line in lines)
    assert json.loads((out / "results.json").read_text())["methods"]["full"]["wall_s"] == before["full"]["wall_s"]


def test_report_regenerates(smoke_run):
    out, _ = smoke_run
    (out / "results.md").unlink()
    result = invoke("report", out)
    assert result.exit_code == 0 and (out / "results.md").exists()


def test_pretrain_adapt_eval_chain(tmp_path, text_file):
    base = tmp_path / "base.safetensors"
    r = invoke("pretrain", "--preset", "smoke", "--domain-a", text_file, "--out", base)
    assert r.exit_code == 0, r.output
    r = invoke("pretrain", "--preset", "smoke", "--domain-a", text_file, "--out", base)
    assert r.exit_code == 2 and "exists" in r.output  # never overwritten
    other = tmp_path / "other.txt"
    other.write_text("A completely different register of text, with numbers 12345. " * 300)
    r = invoke("adapt", "--base", base, "--method", "lora", "--domain-b", other, "--out", tmp_path / "arm",
               "--set", "lora.r=2")
    assert r.exit_code == 0, r.output
    metrics = json.loads((tmp_path / "arm" / "metrics.json").read_text())
    assert metrics["method"] == "lora" and metrics["ppl_b_after"] < metrics["ppl_b_before"]
    r = invoke("eval", "--checkpoint", base, "--corpus", other, "--method-state", tmp_path / "arm" / "seed0")
    assert r.exit_code == 0, r.output
    assert f"{metrics['ppl_b_after']:.4f}" in r.output  # the saved LoRA tensors reproduce the arm's PPL
    from forgetless.checkpoint import load_checkpoint, save_checkpoint  # a method file of earlier versions
    save_checkpoint(tmp_path / "old.safetensors", load_checkpoint(tmp_path / "arm" / "seed0" / "adapter_model.safetensors")[0],
                    {"kind": "method", "options": metrics_options(tmp_path)})
    r = invoke("eval", "--checkpoint", base, "--corpus", other, "--method", "lora", "--method-state", tmp_path / "old.safetensors")
    assert r.exit_code == 0 and f"{metrics['ppl_b_after']:.4f}" in r.output, r.output
    r = invoke("adapt", "--base", base, "--method", "cms[periods=1,1,1,1]", "--domain-b", other, "--out", tmp_path / "cms")
    assert r.exit_code == 2 and "method cms needs a base with ffn=cms (this base: dense)" in r.output, r.output
    assert not (tmp_path / "cms").exists()  # refused before any work
    r = invoke("adapt", "--base", base, "--method", "lora", "--domain-b", other, "--out", text_file)
    assert r.exit_code == 2 and "is a file; give a folder" in r.output, r.output


def metrics_options(tmp_path):
    return json.loads((tmp_path / "arm" / "seed0" / "forgetless_config.json").read_text())["options"]


def test_out_naming_a_file_and_unavailable_devices_are_one_line_errors(tmp_path, text_file):
    r = invoke("bench", "--preset", "smoke", "--out", text_file)
    assert r.exit_code == 2 and f"--out {text_file} is a file" in " ".join(r.output.split()), r.output
    if not torch.cuda.is_available():
        r = invoke("bench", "--preset", "smoke", "--device", "cuda", "--out", tmp_path / "x")
        assert r.exit_code == 2 and "device cuda is not available on this machine" in r.output, r.output
    r = invoke("bench", "--preset", "smoke", "--device", "tpu", "--out", tmp_path / "x")
    assert r.exit_code == 2 and "unknown device 'tpu'" in r.output, r.output


@pytest.mark.parametrize("args,message", [
    (["bench", "--methods", "full,nope"], "unknown method 'nope'; valid: full, ffn, lora, adapter"),
    (["bench", "--domain-a", "no-such-corpus"], "unknown corpus 'no-such-corpus'"),
    (["bench", "--preset", "huge"], "unknown preset 'huge'; valid: smoke, first, quick, paper"),
    (["bench", "--seeds", "0"], "--seeds must be positive"),
    (["bench", "--protocol", "three"], "unknown protocol 'three'; valid: instructions, online, optimizers, sequence, "
                                       "study, two-domain"),
    (["bench", "--model-n-layer", "0"], "model.n_layer must be positive"),
    (["bench", "--adapt-lr", "fast"], "adapt.lr: cannot read 'fast' as float"),
    (["bench", "--set", "lora.rank=4", "--preset", "smoke"], "unknown config key methods.lora.rank"),
    (["bench", "--set", "lora"], "write METHOD.OPTION=VALUE"),
    (["bench", "--data-tokenizer", "words"], "unknown tokenizer 'words'; valid: bytes, chars"),
    (["report", "/nonexistent"], "results.json does not exist"),
    (["bench", "--adapt-steps", "0"], "steps must be positive, got 0"),
    (["bench", "--pretrain-batch-size", "-4"], "batch_size must be positive, got -4"),
    (["bench", "--data-eval-windows", "0"], "data.eval_windows must be positive"),
])
def test_bad_input_is_one_line(args, message):
    result = invoke(*args)
    assert result.exit_code == 2
    lines = [l for l in result.output.splitlines() if l.strip()]
    assert len(lines) == 1 and message in lines[0].replace("\n", " "), result.output


def test_ctrl_c_in_pretrain_names_resume(monkeypatch, tmp_path, text_file):
    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("forgetless.continual.base_model.pretrain", interrupt)
    result = invoke("pretrain", "--preset", "smoke", "--domain-a", text_file, "--out", tmp_path / "b.safetensors")
    assert result.exit_code == 130 and "run the same command with --resume" in result.output


def test_overrides_file_then_flags_then_sets(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("adapt:\n  lr: 1\n  steps: 5\nmethods:\n  lora:\n    r: 4\n")
    method_sets = (("methods",), "METHOD.OPTION", "lora.r=16")
    merged = merge_overrides(cfg, {"adapt": {"lr": "2"}}, ["lora.r=8", "ewc.lam=1e4"], *method_sets)
    assert merged == {"adapt": {"lr": "2", "steps": 5}, "methods": {"lora": {"r": "8"}, "ewc": {"lam": "1e4"}}}
    assert merge_overrides(None, {}, ["tasks=5"]) == {"tasks": "5"}
    for bad in ("lora", "lora.r.x=1", ".r=1", "lora.=1"):
        with pytest.raises(ForgetlessError, match="write METHOD.OPTION=VALUE, e.g. --set lora.r=16"):
            merge_overrides(None, {}, [bad], *method_sets)


def test_unknown_config_file_key(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("pretrain:\n  stepz: 3\n")
    result = invoke("bench", "--config", cfg)
    assert result.exit_code == 2 and "unknown config key pretrain.stepz; valid keys in pretrain: steps" in result.output


def test_char_mode_non_utf8_is_refused(tmp_path, text_file):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9 ".encode("latin-1") * 3000)
    result = invoke("bench", "--preset", "smoke", "--data-tokenizer", "chars", "--domain-a", text_file,
                    "--domain-b", bad, "--out", tmp_path / "run")
    assert result.exit_code == 2 and "is not valid UTF-8" in result.output
    assert not (tmp_path / "run").exists()


def test_module_entry_point():
    out = subprocess.run([sys.executable, "-m", "forgetless", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "bench" in out.stdout


def test_config_file_applies(tmp_path, text_file):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"data:\n  domain_a: {text_file}\n  domain_b: renamed:{text_file}\n"
                   "adapt:\n  steps: 4\nmethods:\n  lora:\n    r: 2\n")
    result = invoke("bench", "--preset", "smoke", "--config", cfg, "--methods", "lora", "--seeds", 1,
                    "--out", tmp_path / "run", "--adapt-eval-every", 2)
    assert result.exit_code == 0, result.output
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["config"]["adapt"]["steps"] == 4 and results["config"]["adapt"]["eval_every"] == 2
    assert results["methods"]["lora"]["options"]["r"] == 2
    lora = results["methods"]["lora"]
    assert lora["curves"]["step"] == [0, 2, 4]  # the final score is the curve's last point, scored once
    assert lora["curves"]["ppl_b"]["mean"][-1] == lora["ppl_b_after"]["mean"]
    assert list(results["methods"]) == ["full", "lora"]  # full joins as the reference for G
    assert results["methods"]["full"]["ppl_a_before"] == lora["ppl_a_before"]  # one base: one "before", shared


def test_char_base_refuses_unseen_characters(tmp_path, text_file):
    base = tmp_path / "base.safetensors"
    assert invoke("pretrain", "--preset", "smoke", "--data-tokenizer", "chars", "--domain-a", text_file,
                  "--out", base, "--pretrain-steps", 2).exit_code == 0
    other = tmp_path / "other.txt"
    other.write_text("Zebras quizzically jump! " * 300)
    result = invoke("eval", "--checkpoint", base, "--corpus", other)
    assert result.exit_code == 2 and "character(s) not in the char vocabulary" in result.output


def test_mixing_draws_from_domain_a(tmp_path):
    """With --mix 1.0 every adaptation row comes from A, so A must not be forgotten; an arm's own
    `mix` option overrides the flag (B is Python source: a shift far enough that training on it alone
    must cost A more than training on A does)."""
    result = invoke("bench", "--preset", "smoke", "--methods", "full,full[mix=0]", "--seeds", 1, "--mix", 1.0,
                    "--domain-a", "tinyshakespeare", "--domain-b", "python-stdlib", "--out", tmp_path)
    assert result.exit_code == 0, result.output
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["config"]["adapt"]["mix"] == 1.0
    from forgetless.presets import build_config  # the knob's earlier name is still read, from flags and files
    assert build_config("smoke", merge_overrides(None, {"adapt": {"replay": "0.25"}})).adapt.mix == 0.25
    full, unmixed = results["methods"]["full"], results["methods"]["full[mix=0]"]
    assert full["forgetting"]["mean"] < 0  # more training on A only helps A
    assert unmixed["options"]["mix"] == 0.0 and unmixed["forgetting"]["mean"] > full["forgetting"]["mean"]


def test_bracketed_method_options_add_an_arm(tmp_path):
    result = invoke("bench", "--preset", "smoke", "--methods", "lora,lora[r=2]", "--seeds", 1, "--out", tmp_path,
                    "--domain-a", "tinyshakespeare", "--domain-b", "renamed:tinyshakespeare")
    assert result.exit_code == 0, result.output
    methods = json.loads((tmp_path / "results.json").read_text())["methods"]
    assert list(methods) == ["full", "lora", "lora[r=2]"]
    assert "lora[r=2]" in result.stdout  # printed as text, not swallowed as rich markup
    assert methods["lora[r=2]"]["trainable_params"] * 4 == methods["lora"]["trainable_params"]
    assert (tmp_path / "arms" / "lora[r=2]" / "seed0.json").exists()


def test_listing_commands(monkeypatch):
    from forgetless.cliutil import out_console
    methods = invoke("methods")
    assert methods.exit_code == 0 and "apn-param-matched" in methods.output and "lora" in methods.output
    monkeypatch.setattr(out_console, "_width", 80)  # a narrow terminal (rich fixes a console's width when made)
    narrow = invoke("methods").output
    assert "…" not in narrow and max(map(len, narrow.splitlines())) <= 80  # long words fold, nothing is cut
    heads = next(line for line in narrow.splitlines() if "you have" in line).strip("┃").split("┃")
    assert [h.strip() for h in heads] == ["you have", "method", "in Trainer", "in adapt", "evidence"]
    assert len(heads[4]) > 2 * len(heads[0])  # the guide's evidence gets the room
    corpora = invoke("corpora", "tinyshakespeare", "shakespeare-folio")
    assert corpora.exit_code == 0
    cells = {row[1].strip(): row[2:] for row in (line.split("│") for line in corpora.output.splitlines())
             if len(row) > 3 and row[1].strip()}
    from forgetless.data.corpora import load_corpus
    assert cells["shakespeare-folio"][0].strip() == str(len(load_corpus("shakespeare-folio").docs)) == "35"
    assert cells["tinyshakespeare"][1].strip() == f"{len(load_corpus('tinyshakespeare').docs[0].data):,}" == "1,115,394"


def test_sequence_protocol(tmp_path):
    result = invoke("bench", "--preset", "smoke", "--protocol", "sequence", "--domain-a", "tinyshakespeare",
                    "--tasks", "renamed:tinyshakespeare,shakespeare-poems", "--methods", "full,lora", "--seeds", 2,
                    "--adapt-steps", 20, "--adapt-lr", 3e-3, "--out", tmp_path)
    assert result.exit_code == 0, result.output
    results = json.loads((tmp_path / "results.json").read_text())
    assert round_trips(tmp_path / "results.json")
    assert results["protocol"] == "sequence" and results["tasks"][1:] == ["renamed:tinyshakespeare", "shakespeare-poems"]
    full = results["methods"]["full"]
    assert {"r_matrix", "op", "bwt", "forgetting", "fwt", "trainable_params", "total_params"} <= set(full)
    assert len(full["r_matrix"]) == 3 and all(len(row) == 3 for row in full["r_matrix"])
    ppl = full["ppl_matrix"]
    assert ppl[1][1] < ppl[0][1] and ppl[2][2] < ppl[1][2]  # each task improves once trained on
    assert (tmp_path / "r_matrix.png").stat().st_size > 1000 and "R matrix of `lora`" in (tmp_path / "results.md").read_text()
    assert results["methods"]["full"]["bwt_drop"]["mean"] == pytest.approx(-full["bwt"]["mean"])
    dev = full["r_matrix_dev"]  # the same matrix on the tasks' validation windows: where choices are made
    assert len(dev) == 3 and all(len(row) == 3 for row in dev) and dev != full["r_matrix"]
    assert full["la_dev"]["mean"] == pytest.approx((dev[1][1] + dev[2][2]) / 2)
    assert full["bwt_tasks_dev"]["mean"] == pytest.approx(dev[2][1] - dev[1][1])
    from forgetless.report.frontier import operating_points
    results["methods"]["full[lr=1e-2]"] = {**full, "la_dev": {"mean": full["la_dev"]["mean"] + 0.5},
                                           "bwt_tasks_dev": {"mean": full["bwt_tasks_dev"]["mean"] + 1}}
    point = operating_points(RunResult.from_json(results))["full, lr"]["best_bwt_at_matched_la"]
    assert point["chosen_on"] == "validation" and point["arm"] == "full[lr=1e-2]"
    (tmp_path / "results.md").unlink()
    again = invoke("report", tmp_path)
    assert again.exit_code == 0, again.output
    assert "R matrix of `lora`" in again.output and (tmp_path / "results.md").exists()


def test_sequence_replay_comes_from_every_earlier_task_or_a_named_one(tmp_path):
    """`earlier` (default) replays tasks 0..t-1; naming task 0 is the protocol before the option: the same
    rows on task 1, other rows on task 2. Neutral's mixed rows are always task 0's; a name outside the
    sequence is a one-line error before anything is written."""
    from forgetless.continual.sequence import replay_source, replay_tag
    from forgetless.presets import build_config
    from forgetless.data.domains import Domain
    from forgetless.methods import build_method
    tasks = [Domain(f"c{i}", torch.full((10 * (i + 1),), i), torch.zeros(1), torch.zeros(1, 2), [], "")
             for i in range(3)]
    assert replay_source(tasks, 2, "earlier", build_method("full")).train.tolist() == [0] * 10 + [1] * 20
    assert replay_source(tasks, 2, "c1", build_method("full")) is tasks[1]
    assert replay_source(tasks, 2, "earlier", build_method("neutral")) is tasks[0]
    cfg = build_config("smoke")  # arms saved before the option replayed task 0 under this same config: new cache key
    assert replay_tag(cfg, build_method("full", {"mix": 0.1})) == {"replay": "tasks 0..t-1"}
    assert replay_tag(cfg, build_method("full")) == replay_tag(cfg, build_method("neutral")) == {}
    cfg.data.mix_from = "tinyshakespeare"
    assert replay_tag(cfg, build_method("full", {"mix": 0.1})) == {}
    runs = {}
    for mix_from in ("earlier", "tinyshakespeare"):
        out = tmp_path / mix_from
        result = invoke("bench", "--preset", "smoke", "--protocol", "sequence", "--domain-a", "tinyshakespeare",
                        "--tasks", "renamed:tinyshakespeare,shakespeare-poems", "--methods", "full[mix=0.5]",
                        "--adapt-steps", 10, "--adapt-lr", 3e-3, "--data-mix-from", mix_from, "--out", out)
        assert result.exit_code == 0, result.output
        runs[mix_from] = json.loads((out / "results.json").read_text())["methods"]["full[mix=0.5]"]["ppl_matrix"]
    assert runs["earlier"][:2] == runs["tinyshakespeare"][:2] and runs["earlier"][2] != runs["tinyshakespeare"][2]
    bad = invoke("bench", "--preset", "smoke", "--protocol", "sequence", "--domain-a", "tinyshakespeare",
                 "--tasks", "shakespeare-poems", "--data-mix-from", "Lima", "--out", tmp_path / "bad")
    assert bad.exit_code == 2 and "data.mix_from 'Lima' is not a task of this sequence" in bad.output, bad.output
    assert not (tmp_path / "bad").exists()


def test_sequence_protocol_needs_tasks():
    result = invoke("bench", "--preset", "smoke", "--protocol", "sequence", "--tasks", ",")
    assert result.exit_code == 2 and "needs tasks after the base: --tasks" in result.output


def test_bench_optimizers_compares_pretraining_and_adaptation(tmp_path):
    result = invoke("bench", "--preset", "smoke", "--seeds", 1, "--optimizers", "adamw,muon,delta,deep",
                    "--out", tmp_path)
    assert result.exit_code == 0, result.output
    results = json.loads((tmp_path / "results.json").read_text())
    assert list(results["methods"]) == ["full", "full[optimizer=muon]", "full[optimizer=delta]", "full[optimizer=deep]"]
    assert results["optimizers"] == ["adamw", "muon", "delta", "deep"]
    assert results["methods"]["full[optimizer=delta]"]["options"]["optimizer"] == "delta"
    for name, run in results["pretraining"].items():
        loss = run["loss"]["mean"]
        assert len(loss) == 30 and loss[-1] < loss[0], name      # the smoke preset pretrains 30 steps
        assert run["final_ppl_a"]["mean"] == run["ppl_a"]["mean"][-1]
    assert results["pretraining"]["adamw"]["bases"] == [results["bases"]["dense"]["path"]]  # the arms' base
    assert (tmp_path / "pretraining_curves.png").stat().st_size > 1000
    assert "Pretraining on A with each optimizer" in (tmp_path / "results.md").read_text()
    assert round_trips(tmp_path / "results.json")


def test_bench_optimizers_across_learning_rates(tmp_path):
    result = invoke("bench", "--preset", "smoke", "--seeds", 1, "--optimizers", "adamw,delta", "--lrs", "1e-3,3e-3",
                    "--out", tmp_path)
    assert result.exit_code == 0, result.output
    methods = json.loads((tmp_path / "results.json").read_text())["methods"]
    assert list(methods) == ["full", "full[lr=3e-3]", "full[optimizer=delta]", "full[optimizer=delta;lr=3e-3]"]
    assert methods["full[optimizer=delta;lr=3e-3]"]["options"]["lr"] == 3e-3   # smoke adapts at 1e-3: plain names
    assert (tmp_path / "optimizer_frontier.png").stat().st_size > 1000


def test_bench_optimizers_pair_each_seed_with_its_own_base(tmp_path):
    result = invoke("bench", "--preset", "smoke", "--seeds", 2, "--base-seeds", 2, "--pretrain-seeds", 2,
                    "--workers", 2, "--optimizers", "adamw,muon", "--out", tmp_path)
    assert result.exit_code == 0, result.output
    assert "pretraining bases" in result.output  # the optimizers' bases are a loop with its own progress
    results = json.loads((tmp_path / "results.json").read_text())
    bases = [results["bases"][f"dense seed {s}"]["path"] for s in (0, 1)]
    assert results["base_seeds"] == 2 and results["pretraining"]["adamw"]["bases"] == bases
    assert len(set(results["pretraining"]["muon"]["bases"]) | set(bases)) == 4   # muon pretrains its own two
    before = {label: [run["per_seed"][s]["ppl_a_before"] for s in ("0", "1")]
              for label, run in results["methods"].items()}
    assert before["full[optimizer=muon]"] == before["full"] and before["full"][0] != before["full"][1]  # AdamW base s


@pytest.mark.parametrize("args, message", [
    (["--optimizers", "adamw,adam"], "unknown optimizer 'adam' in --optimizers; valid: adamw"),
    (["--optimizers", "adamw", "--sweep", "full.lr=1e-3,3e-3"], "--sweep does not go with --optimizers"),
    (["--methods", "lora", "--sweep", "lora=4"], "--sweep 'lora=4': write METHOD.OPTION=V1,V2"),
    (["--methods", "lora", "--sweep", "lora.rank=4,8"], "unknown config key methods.lora.rank"),
    (["--methods", "lora", "--lrs", "fast"], "methods.lora.lr: cannot read 'fast'"),
    (["--optimizers", "adamw", "--lrs", "fast"], "--lrs takes numbers"),
    (["--optimizers", "adamw", "--protocol", "sequence"], "--optimizers runs the two-domain protocol"),
    (["--methods", "lora[r=4]", "--optimizers", "adamw"], "give plain method names"),
    (["--adapt-optimizer", "sgd"], "unknown optimizer 'sgd'"),
])
def test_bench_optimizer_errors(args, message, tmp_path):
    result = invoke("bench", "--preset", "smoke", "--seeds", 1, "--out", tmp_path, *args)
    assert result.exit_code == 2 and message in " ".join(result.output.split()), result.output


def test_export_merges_what_folds_and_keeps_the_rest_loadable(tmp_path):
    run = tmp_path / "run"
    result = invoke("bench", "--preset", "smoke", "--methods", "lora,neutral", "--seeds", 1, "--out", run,
                    "--domain-a", "tinyshakespeare", "--domain-b", "renamed:tinyshakespeare")
    assert result.exit_code == 0, result.output
    r = invoke("export", run, "--method", "lora", "--out", tmp_path / "lora")
    assert r.exit_code == 0 and "the merged model" in flat(r), r.output
    ppl_b = json.loads((run / "results.json").read_text())["methods"]["lora"]["ppl_b_after"]["mean"]
    r = invoke("eval", "--checkpoint", tmp_path / "lora" / "base.safetensors", "--corpus", "renamed:tinyshakespeare",
               "--windows", 8)  # the smoke preset's held-out windows
    assert r.exit_code == 0, r.output
    printed = float(flat(r).split("renamed:tinyshakespeare │ ")[1].split()[0])
    assert printed == pytest.approx(ppl_b, rel=1e-4)  # the merged weights are the adapted model
    r = invoke("export", run, "--method", "neutral", "--out", tmp_path / "neutral")
    assert r.exit_code == 0 and "forgetless.from_pretrained" in flat(r), r.output
    assert "forgetless.from_pretrained" in (tmp_path / "neutral" / "LOADING.md").read_text()
    r = invoke("export", run, "--method", "neutral", "--out", tmp_path / "neutral")
    assert r.exit_code == 2 and "is not an empty folder" in flat(r)
    r = invoke("export", run, "--method", "adapter", "--out", tmp_path / "x")
    assert r.exit_code == 2 and "has no arm 'adapter'; its arms: full, lora, neutral" in flat(r), r.output


def flat(result) -> str:
    """The command's output with line wrapping undone."""
    return " ".join(result.output.split())


def test_real_presets_start_full_weight_methods_at_a_fine_tuning_lr():
    """On a pretrained model, full/ffn/ewc default to 5e-5 (the preset's 5e-4 is for added modules); options given
    in a config, --set or brackets win; presets for forgetless's own GPTs keep one lr for all."""
    from forgetless.methods import MethodSpec
    from forgetless.presets import build_config
    cfg = build_config("real", merge_overrides(None, {"methods": {"full": {"lr": "1e-4"}, "lora": {"r": "4"}}}))
    assert cfg.methods["ewc"]["lr"] == 5e-5 and cfg.methods["full"]["lr"] == "1e-4" and cfg.methods["lora"] == {"r": "4"}
    assert MethodSpec("ffn").build(build_config("real-full").methods.get("ffn")).cfg.lr == 5e-5
    assert MethodSpec("lora").build(build_config("real").methods.get("lora")).cfg.lr == MethodSpec("lora").build().cfg.lr
    assert build_config("quick").methods == {}


def test_bench_prints_its_plan_first(tmp_path, text_file, monkeypatch):
    """Before any work: the bases to pretrain, the arms to run and an estimate from timed steps; a second run
    finds the base cached and the arms saved, with nothing left to estimate."""
    monkeypatch.setenv("FORGETLESS_CACHE", str(tmp_path / "cache"))  # no base cached by other tests
    args = ("bench", "--preset", "smoke", "--methods", "lora", "--seeds", 1, "--out", tmp_path / "run",
            "--domain-a", text_file, "--domain-b", f"renamed:{text_file}")
    first = invoke(*args)
    assert first.exit_code == 0, first.output
    plan = next(line for line in first.output.splitlines() if line.startswith("plan:"))
    assert "pretrain 1 of 1 base" in plan and "run 2 of 2 arms" in plan and "about" in plan  # lora + full (G)
    assert first.output.index("plan:") < first.output.index("pretrain dense base")
    again = invoke(*args)
    assert "plan: pretrain 0 of 1 base (1 cached), run 0 of 2 arms (2 saved) · about 0s" in again.output


@pytest.mark.parametrize("args, preset, methods", [
    ((), "first", ["full", "lora", "ewc", "neutral", "apn-retrofit"]),           # the first run: one base
    (("--protocol", "sequence"), "first", ["full", "lora", "ewc", "moram", "seq-lora"]),
    (("--protocol", "online"), "first", ["full", "lora", "ewc", "neutral", "apn-retrofit"]),
    (("--methods", "all"), "first", None),                                       # the whole comparison
    (("--preset", "quick"), "quick", None),
    (("--preset", "quick", "--methods", "lora"), "quick", ["lora"]),
])
def test_bench_defaults_to_the_first_run(args, preset, methods, tmp_path, monkeypatch):
    """`forgetless bench` alone runs the `first` preset's short list; --methods all (or a preset without a
    list) runs the protocol's whole set."""
    from forgetless.continual import protocols
    from forgetless.methods import method_names
    seen = {}

    def capture(self, ctx, specs):
        seen.update(preset=ctx.preset, methods=[s.label for s in specs], steps=ctx.cfg.pretrain.steps)
        raise ForgetlessError("captured")
    for protocol in protocols().values():
        monkeypatch.setattr(type(protocol), "run", capture)
    result = invoke("bench", "--out", tmp_path, *args)
    assert result.exit_code == 2 and "captured" in result.output
    protocol = "sequence" if "sequence" in args else "two-domain"
    assert seen["preset"] == preset and seen["methods"] == (methods or method_names(protocol))
    assert seen["steps"] == (400 if preset == "first" else 1200)


def test_pretrained_models_default_to_the_real_preset():
    from forgetless.continual import protocols
    from forgetless.continual.protocol import Request
    from forgetless.methods import method_names
    from forgetless.presets import build_config, default_preset
    assert default_preset("smollm2-135m") == "real" and default_preset("hf:/m") == "real"
    sequence = protocols()["sequence"]
    arms = sequence.arms(Request("sequence", build_config("real"), "real"))  # no list for real: all
    assert default_preset("byte-gpt") == "first" and [s.label for s in arms] == method_names("sequence")


def test_plan_counts_and_estimates():
    """The estimate adds what is left: done jobs count as nothing; pretrained models get no estimate."""
    from forgetless.continual.plan import Job, Plan, n_evaluations
    from forgetless.train import TrainConfig
    plan = Plan([Job("base", "dense", 100.0, False), Job("arm", "lora seed 0", 30.0, False),
                 Job("arm", "lora seed 1", 0.0, True)], calibration_s=2.0)
    assert plan.seconds == 130.0 and "run 1 of 2 arms (1 saved)" in plan.summary() and "about 2m 10s" in plan.summary()
    assert Plan(plan.jobs, calibrated=False).summary() == "plan: pretrain 1 of 1 base, run 1 of 2 arms (1 saved)"
    jobs = plan.jobs + [Job("arm", "lora seed 2", 40.0, False), Job("arm", "lora seed 3", 30.0, False)]
    on_two = Plan(jobs, calibration_s=2.0, workers=2)  # the base alone (100 s), then 100 s of arms split in two
    assert on_two.seconds == 150.0 and "about 2m 30s on 2 workers" in on_two.summary()
    assert Plan(jobs[:2], workers=2).seconds == 130.0  # one job per phase: its own time, not half of it
    assert n_evaluations(TrainConfig(steps=200, eval_every=20)) == 11 and n_evaluations(TrainConfig(steps=10, eval_every=4)) == 4


def test_sweep_draws_a_frontier_and_its_operating_points(tmp_path, text_file):
    """--sweep and --lrs add an arm per value; the arms of one method make a frontier curve, figure and table."""
    result = invoke("bench", "--preset", "smoke", "--methods", "lora", "--sweep", "lora.r=2,8", "--lrs", "3e-3",
                    "--seeds", 1, "--out", tmp_path, "--domain-a", text_file, "--domain-b", f"renamed:{text_file}")
    assert result.exit_code == 0, result.output
    results = json.loads((tmp_path / "results.json").read_text())
    assert list(results["methods"]) == ["full", "lora", "lora[r=2]", "lora[r=8]", "lora[lr=3e-3]"]  # full: G's reference
    frontier = results["frontier"]
    assert set(frontier) == {"lora, r", "lora, lr", "full"}  # curves with their plain arm; full at one setting
    g = {label: m["adaptation_gain_dev"]["mean"] for label, m in results["methods"].items()}  # chosen on validation
    f = {label: 100 * m["forgetting_dev"]["mean"] for label, m in results["methods"].items()}
    ok = [a for a in ["lora", "lora[lr=3e-3]"] if f[a] <= 5]
    arm = max(ok, key=g.get) if ok else None
    assert frontier["lora, lr"]["best_g_at_f_le_5"] == ({
        "value": results["methods"][arm]["adaptation_gain"]["mean"], "arm": arm, "chosen_value": g[arm],
        "chosen_on": "validation"} if ok else None)
    assert "Operating points" in (tmp_path / "results.md").read_text()
    assert (tmp_path / "frontier.png").stat().st_size > 1000


def test_base_seeds_pretrain_a_base_per_seed(tmp_path, text_file, monkeypatch):
    """--base-seeds 2: seed s adapts base s, so PPL_A before varies over seeds; the ± says so and 95 %
    intervals (Student t) come beside it."""
    monkeypatch.setenv("FORGETLESS_CACHE", str(tmp_path / "cache"))
    result = invoke("bench", "--preset", "smoke", "--methods", "lora", "--seeds", 2, "--base-seeds", 2, "--out",
                    tmp_path / "run", "--domain-a", text_file, "--domain-b", f"renamed:{text_file}")
    assert result.exit_code == 0, result.output
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["base_seeds"] == 2 and sorted(results["bases"]) == ["dense seed 0", "dense seed 1"]
    before = results["methods"]["lora"]["ppl_a_before"]
    assert before["std"] > 0 and before["ci95"] == pytest.approx(12.706 * before["std"] / math.sqrt(2))
    assert "each seed on its own pretrained base" in (tmp_path / "run" / "results.md").read_text()
    assert "95 % intervals of the mean" in (tmp_path / "run" / "results.md").read_text()
    one = invoke("bench", "--preset", "smoke", "--methods", "lora", "--seeds", 2, "--out", tmp_path / "one",
                 "--domain-a", text_file, "--domain-b", f"renamed:{text_file}")
    assert one.exit_code == 0 and json.loads((tmp_path / "one" / "results.json").read_text())[
        "methods"]["lora"]["ppl_a_before"]["std"] == 0  # one base: its variance is not in the ±
    assert "adaptation seeds on one pretrained base" in " ".join(one.output.split())


def test_base_seeds_need_forgetless_bases(tmp_path):
    result = invoke("bench", "--model", "smollm2-135m", "--base-seeds", 2, "--out", tmp_path)
    assert result.exit_code == 2 and "a pretrained --model has one base" in " ".join(result.output.split())


def test_bench_help_shows_the_arm_example_whole(monkeypatch):
    """Rich reads '[r=16]' as markup unless escaped: the help must show the example as typed."""
    monkeypatch.setenv("COLUMNS", "200")
    result = invoke("bench", "--help")
    assert result.exit_code == 0 and "'lora,lora[r=16]'" in result.output


def test_bench_help_lists_each_setting_once_in_panels(monkeypatch):
    """--domain-a, --domain-b, --tasks and --mix are shown, their long twins (--data-domain-a, ...) hidden but
    still taken; the options are grouped in panels."""
    monkeypatch.setenv("COLUMNS", "200")
    text = invoke("bench", "--help").output
    flags = [word for word in text.split() if word.startswith("--")]
    assert all(flags.count(flag) == 1 for flag in ("--domain-a", "--domain-b", "--tasks", "--mix", "--methods"))
    assert not {"--data-domain-a", "--data-domain-b", "--data-tasks", "--adapt-mix"} & set(flags)
    assert all(panel in text for panel in ("─ run ", "─ arms: methods, seeds, sweeps ", "─ data ", "─ model and compute "))
    for hidden in ("--data-domain-a", "--data-domain-b", "--data-tasks", "--adapt-mix"):  # parsed: the seeds check speaks
        result = invoke("bench", hidden, "0.5" if hidden == "--adapt-mix" else "x", "--seeds", 0)
        assert result.exit_code == 2 and "--seeds must be positive" in result.output, (hidden, result.output)


@pytest.mark.parametrize("command, shown", [("bench", True), ("pretrain", False), ("adapt", False)])
def test_online_flags_only_where_the_online_protocol_runs(monkeypatch, command, shown):
    monkeypatch.setenv("COLUMNS", "200")
    result = invoke(command, "--help")
    assert result.exit_code == 0 and ("--online-chunks" in result.output) is shown
    assert "--adapt-steps" in result.output


def test_tables_on_a_pipe_get_100_columns():
    """Off a terminal rich assumes 80 columns and folds 'apn-retrofit'; the tables are sized for 100."""
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    out = subprocess.run([sys.executable, "-c", "from forgetless.cliutil import out_console; print(out_console.width)"],
                         capture_output=True, text=True, env=env, check=True).stdout
    assert out.strip() == "100"
