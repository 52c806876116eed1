"""`forgetless serve`'s published versions (issue 51, item 4 and the publish part of 6): `POST /v1/publish` writes
the last good state as a PEFT adapter that peft alone loads onto the base with the served logits (a tiny random
Llama saved as a transformers folder), or merged weights (the byte GPT), into `publish/vN` with a manifest; a
publish killed between writing and renaming leaves the earlier versions intact and no half version; `forgetless
export STATE_DIR` publishes the newest kept state offline."""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi", reason="forgetless serve needs FastAPI (bash scripts/setup.sh dev or serve)")

from safetensors.torch import load_file  # noqa: E402
from test_serve import AUTH, DOCS, TOKEN, engine, local, trained  # noqa: E402,F401
from tiny_models import SENTENCES, bpe_tokenizer, gguf_llama  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from forgetless.cli import app  # noqa: E402
from forgetless.continual.base_model import load_base  # noqa: E402
from forgetless.continual.learner import chunk_windows  # noqa: E402
from forgetless.data.tokenizers import PretrainedCorpusTokenizer, TextTokenizer  # noqa: E402
from forgetless.serve import publish  # noqa: E402
from forgetless.serve.app import make_app  # noqa: E402
from forgetless.serve.engine import Engine, ServeConfig, detached  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OPEN = {"lr": 1e-2, "max_canary_rise": 100, "learn_per_minute": 0, "screen_k": 0, "screen_low_k": 0,
        "canary_every": 1, "snapshot_every": 1}  # the gate open, every document checked: good = current


def llama_folder(folder: Path):
    """A tiny random Llama and its BPE tokenizer saved as a transformers folder (a local base peft can name)."""
    hf = bpe_tokenizer()
    gguf_llama(len(hf)).save_pretrained(folder)
    hf.save_pretrained(folder)
    return hf


def llama_engine(base: Path, state_dir: Path, **options) -> Engine:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    hf = AutoTokenizer.from_pretrained(base)
    tokenizer = PretrainedCorpusTokenizer(TextTokenizer(hf, "tiny"))
    canary = chunk_windows(tokenizer.encode(" ".join(SENTENCES * 8).encode()), 32)[:4]
    cfg = ServeConfig(**{"method": "lora", **OPEN, **options})
    return Engine(AutoModelForCausalLM.from_pretrained(base), tokenizer, canary, 32, cfg, state_dir)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    llama_folder(folder)
    return folder


def test_a_published_lora_adapter_loads_in_peft_alone_with_the_served_logits(base, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    e = llama_engine(base, tmp_path / "state")
    try:
        c = local(make_app(e, TOKEN, model_name="tiny"))
        assert c.post("/v1/publish").status_code == 401  # the token rules of learning
        for doc in SENTENCES:
            assert c.post("/v1/learn", json={"text": doc * 2}, headers=AUTH).status_code == 200
        r = c.post("/v1/publish", headers=AUTH)
        assert r.status_code == 200, r.text
        manifest = r.json()
        served = e.serving[1]
        ids = e.encode(" ".join(SENTENCES))[None, :32]  # (1, 32)
        with torch.no_grad():
            want = served(ids).logits
    finally:
        e.close()
    folder = Path(manifest["path"])
    assert folder == tmp_path / "state" / "publish" / "v1" and manifest["form"] == "peft"
    assert manifest["version"] == 1 and manifest["parent"] is None and manifest["method"] == "lora"
    assert manifest["documents"] == {"through_seq": 4, "count": 4, "undone": []}
    assert manifest["base"]["name"] == "tiny" and manifest["canary_loss"] == e.good["meta"]["canary"]
    assert set(manifest["files"]) >= {"adapter_config.json", "adapter_model.safetensors"}
    assert publish.check_intact(folder) == json.loads((folder / "manifest.json").read_text())
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base.resolve())
    assert config["target_modules"] and all("." not in t for t in config["target_modules"])  # SGLang's short form
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), folder).eval()
    with torch.no_grad():
        got = peft_model(ids).logits
        plain = AutoModelForCausalLM.from_pretrained(base)(ids).logits
    assert (want - plain).abs().max() > 1e-3  # the adapter learned something: the logits moved
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # offline: `forgetless export STATE_DIR --model hf:BASE` publishes the newest kept state (document 4) as v2
    result = CliRunner().invoke(app, ["export", str(tmp_path / "state"), "--model", f"hf:{base}"])
    # rich wraps the path at the terminal's width, inside words too: compare without any whitespace
    assert result.exit_code == 0 and "publish/v2:aPEFTadapter" in "".join(result.output.split()), result.output
    offline = publish.check_intact(tmp_path / "state" / "publish" / "v2")
    assert offline["parent"] == 1 and offline["documents"] == manifest["documents"] and offline["form"] == "peft"
    a, b = (load_file(folder / "adapter_model.safetensors") for folder in (folder, folder.with_name("v2")))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_export_of_a_serve_state_folder_needs_its_base_in_one_line(trained, tmp_path):
    engine(trained, tmp_path / "state").close()
    result = CliRunner().invoke(app, ["export", str(tmp_path / "state")])
    assert result.exit_code == 2 and "is a serve state folder: name the base it serves with --model" in result.output
    assert len(result.output.strip().splitlines()) == 1 and not (tmp_path / "state" / "publish").exists()


def test_publish_writes_the_last_good_state_and_versions_chain_with_their_documents(trained, tmp_path):
    e = engine(trained, tmp_path / "state", method="lora", max_canary_rise=100, screen_k=0, screen_low_k=0,
               canary_every=2, snapshot_every=2)
    try:
        c = local(make_app(e, TOKEN))
        for doc in DOCS[:3]:  # documents 1, 2 checked (the good state); 3 learned, not checked yet
            c.post("/v1/learn", json={"text": doc}, headers=AUTH)
        first = c.post("/v1/publish", headers=AUTH).json()
        assert first["form"] == "merged" and first["documents"]["through_seq"] == 2  # the good state, not 3
        weights = load_base(Path(first["path"]) / "base.safetensors")[0].state_dict()
        good = {k[len("model."):]: v for k, v in e.good["tensors"].items() if k.startswith("model.")}
        merged = e.learner.method.merge(detached(e.learner.adapted, e.good["tensors"]).model).state_dict()
        assert weights.keys() == merged.keys() and all(torch.equal(weights[k], merged[k]) for k in weights)
        assert any("lora" in k for k in good)  # the state held the adapter; the published file holds it merged
        c.post("/v1/learn", json={"text": DOCS[3]}, headers=AUTH)  # 4: checked
        assert c.post("/v1/rollback", json={"seq": 2}, headers=AUTH).status_code == 200  # undoes 3, 4
        c.post("/v1/learn", json={"text": DOCS[4]}, headers=AUTH)
        c.post("/v1/learn", json={"text": DOCS[5]}, headers=AUTH)  # 6: checked
        second = c.post("/v1/publish", headers=AUTH).json()
    finally:
        e.close()
    assert second["version"] == 2 and second["parent"] == 1
    assert second["documents"] == {"through_seq": 6, "count": 4, "undone": [[3, 4]]}
    assert sorted(publish.versions(tmp_path / "state" / "publish")) == [1, 2]


KILLED = """
import os, signal, sys
sys.path[:0] = [{tests!r}]
from forgetless.serve import publish
from test_serve import engine, TEXT
import test_serve, torch
from tiny_models import ours
e = engine(ours().state_dict(), {state!r}, method="lora")
publish.commit = lambda work, target: os.kill(os.getpid(), signal.SIGKILL)  # dies written, not renamed
e.release()
"""


def test_a_publish_killed_before_its_rename_leaves_the_last_version_intact_and_no_half_one(trained, tmp_path):
    state = tmp_path / "state"
    e = engine(trained, state, method="lora")
    try:
        first = e.release()
    finally:
        e.close()
    root = state / "publish"
    before = {p.name: p.read_bytes() for p in Path(first["path"]).iterdir()}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    run = subprocess.run([sys.executable, "-c", KILLED.format(tests=str(ROOT / "tests"), state=str(state))],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == -signal.SIGKILL, run.stderr[-2000:]
    (half,) = [p for p in root.iterdir() if p.name.startswith(".v2.tmp")]  # written whole, never renamed
    assert (half / "manifest.json").is_file() and (half / "base.safetensors").is_file()
    assert list(publish.versions(root)) == [1]
    assert {p.name: p.read_bytes() for p in Path(first["path"]).iterdir()} == before
    e = engine(trained, state, method="lora")
    try:
        def fails(work, target):
            raise OSError(28, "No space left on device")
        real = publish.commit
        publish.commit = fails  # a failure at the same step, in process: refused, nothing counted
        try:
            with pytest.raises(OSError):
                e.release()
        finally:
            publish.commit = real
        assert list(publish.versions(root)) == [1] and not [p for p in root.iterdir() if ".tmp" in p.name]
        again = e.release()
    finally:
        e.close()
    assert again["version"] == 2 and again["parent"] == 1 and publish.check_intact(Path(again["path"]))
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".lock")) == ["v1", "v2"]
