"""`forgetless serve`'s protection while serving (issue 51, item 3): retained rows (`--retain FILE`) mixed into every
learning batch at the mixer's share, a restart that must mix the same rows, composed method specs (`lora+ewc`)
learning online with their term acting, methods that cannot learn online refused in one line, and a held-out canary
file read whole."""
import pytest
import torch

pytest.importorskip("fastapi", reason="forgetless serve needs FastAPI (bash scripts/setup.sh dev or serve)")

from test_serve import DOCS, LINES, engine, trained  # noqa: E402,F401

from forgetless.cli import whole  # noqa: E402
from forgetless.data.splits import eval_windows  # noqa: E402
from forgetless.data.tokenizers import ByteTokenizer  # noqa: E402
from forgetless.errors import ForgetlessError  # noqa: E402
from forgetless.serve.engine import ServeConfig  # noqa: E402

OLD = "".join(f"NURSE:\nGood even, my lord; the {k}th hour is past.\n" for k in range(200))  # the retained text
GATE_OPEN = {"max_canary_rise": 100, "screen_k": 0, "screen_low_k": 0}


def weights(e) -> dict:
    return {k: v.clone() for k, v in e.learner.model.state_dict().items()}


def test_retained_rows_are_mixed_into_each_learning_batch_and_a_restart_must_mix_the_same(trained, tmp_path):
    old = ByteTokenizer().encode(OLD.encode())  # (N,)
    mixed = engine(trained, tmp_path / "mixed", old, mix=0.5, **GATE_OPEN)
    plain = engine(trained, tmp_path / "plain", **GATE_OPEN)
    try:
        for doc in DOCS[:4]:
            mixed.learn(doc)
            plain.learn(doc)
        windows = mixed.example(DOCS[4])  # (W, 17)
        batch = mixed.learner.batch(windows)
        rows = batch.x[batch.from_other.bool()]  # (n, 16): the retained rows of this batch
        assert len(rows) == round(0.5 * len(windows)) and len(batch.x) == len(windows) + len(rows)
        text = OLD.encode()
        assert all(bytes(r.tolist()) in text for r in rows)  # drawn from the retained text, not the documents
        assert all(bytes(r.tolist()) not in "".join(LINES).encode() for r in rows)
        assert any(not torch.equal(v, weights(plain)[k]) for k, v in weights(mixed).items())  # the rows were learned
        learned = weights(mixed)
    finally:
        mixed.close()
        plain.close()
    again = engine(trained, tmp_path / "mixed", old, mix=0.5, **GATE_OPEN)  # replays documents 1-4, mixing again
    try:
        assert again.seq == 4 and all(torch.equal(v, learned[k]) for k, v in weights(again).items())
    finally:
        again.close()
    with pytest.raises(ForgetlessError, match="learned with other mixed rows"):
        engine(trained, tmp_path / "mixed", old[:-100], mix=0.5, **GATE_OPEN)


def test_a_composed_method_learns_online_with_its_term_acting(trained, tmp_path):
    """lora+ewc (a large lam) moves the adapter less from its start than lora alone on the same documents."""
    runs = {}
    for spec in ("lora", "lora+ewc[lam=1e6]"):
        e = engine(trained, tmp_path / spec, method=spec, **GATE_OPEN)
        try:
            start = weights(e)
            for doc in DOCS[:4]:
                assert e.learn(doc)["seq"]
            moved = {k: (v - start[k]).norm() for k, v in weights(e).items() if "lora_" in k}
            runs[spec] = torch.stack(list(moved.values())).norm().item()
        finally:
            e.close()
    assert 0 < runs["lora+ewc[lam=1e6]"] < 0.8 * runs["lora"], runs  # measured 0.155 vs 0.265 (margin set after)


@pytest.mark.parametrize("spec, said", [
    ("lora,full", "takes one method spec"), ("mtl", "(joint)"), ("full[joint=true]", "(joint)"),
    ("wise-ft", "cannot learn online"),
])
def test_a_method_that_cannot_learn_online_is_refused_in_one_line(spec, said):
    with pytest.raises(ForgetlessError) as e:
        ServeConfig(method=spec)
    assert said in str(e.value) and "\n" not in str(e.value)


def test_a_held_out_canary_file_is_read_whole(tmp_path):
    held = tmp_path / "held-out.txt"
    held.write_text(OLD)
    ids = whole(str(held), ByteTokenizer(), 16)
    assert ids.tolist() == list(OLD.encode())
    windows = eval_windows(ids, 16, 32)  # (32, 17), spread over the whole file, not a held-out share of it
    last = OLD.encode().index(bytes(windows[-1].tolist()))
    assert windows.shape == (32, 17) and windows[0].tolist() == ids[:17].tolist() and last > 0.9 * len(ids)
