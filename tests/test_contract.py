"""The contract of `forgetless.attach`, checked for every registered method on three tiny models
(our GPT, a random HF GPT-2 with Conv1D layers, a random HF Llama), like PEFT's common tester.

The `check_*` helpers take a method name and a model kind, so tests/test_new_method.py runs the same
checks on a method registered by a file of its own.
"""
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peft.tuners.lora import LoraLayer
from peft.tuners.osf.layer import OSFLayer
from safetensors.torch import load_file, save_file

from forgetless import attach, from_pretrained
from forgetless.adapted import CONFIG, Adapted
from forgetless.data.splits import Batch
from forgetless.errors import ForgetlessError
from forgetless.methods import METHODS, build_method, method_names
from forgetless.methods.base import ALL, FINE_TUNING_LR, MODULES
from forgetless.models.gpt import GPTConfig, logits_of
from forgetless.presets import build_config
from tiny_models import hf_gpt2, hf_llama, ours, tiny

KINDS = ["gpt", "gpt2", "llama"]
NAMES = method_names()
# (kind, method) -> the ForgetlessError attach gives: peft's OSF wraps nn.Linear only, GPT-2's layers are Conv1D
REFUSED = {("gpt2", "osf"): "OSF wraps torch.nn.Linear layers only"}
MATRIX = [pytest.param(kind, name, id=f"{kind}-{name}", marks=[pytest.mark.skip(
    reason=f"attach refuses it: {REFUSED[kind, name]} (test_refused_pairs_say_why)")] if (kind, name) in REFUSED else [])
    for kind in KINDS for name in NAMES]
T = 12  # tokens per window (the GPT's context is 16)

SMALL_APN = {"n_patches": 8, "top_k": 2, "rank": 4}
OWN_BASE = {n for n in NAMES if build_method(n).base_config(GPTConfig()) != GPTConfig()}  # apn, cms, ...
OTHER_ARCHITECTURE = {"gpt": lambda method: ours(d=48, method=method),
                      "gpt2": lambda method: hf_llama(), "llama": lambda method: hf_gpt2()}


# ---- building ----------------------------------------------------------------------------------
def options(kind: str, name: str) -> dict:
    """Small APNs (every other method with its defaults, which name each architecture's own layers)."""
    return {"apn": SMALL_APN} if hasattr(build_method(name).cfg, "apn") else {}


def base(kind: str, name: str):
    """A fresh tiny model of `kind`: for our GPT, the base the method (with its options) asks for."""
    return tiny(kind, build_method(name, options(kind, name)))


def attached(kind: str, name: str, model=None):
    return attach(base(kind, name) if model is None else model, name, **options(kind, name))


def windows(n: int = 4, seed: int = 1) -> torch.Tensor:
    """(n, T+1) random token ids."""
    return torch.randint(0, 256, (n, T + 1), generator=torch.Generator().manual_seed(seed))


def start(adapted, task: int = 1):
    """start_task, with windows of what was learned before for the methods that protect it (EWC)."""
    adapted.start_task(task, previous=windows(seed=2) if adapted.method.needs_previous else None)
    return adapted


def train_step(adapted):
    """One AdamW step (lr 1e-2, no weight decay) on the adapted loss of a batch of windows."""
    opt = torch.optim.AdamW([p for _, p in adapted.trainable_parameters()], lr=1e-2, weight_decay=0.0)
    adapted.train()
    adapted.loss(windows()).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return adapted


@torch.no_grad()
def logits(model, x=None) -> torch.Tensor:
    model.eval()
    return logits_of(model, windows()[:, :-1] if x is None else x).contiguous()


def snapshot(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def requiring_grad(adapted) -> set[str]:
    return {n for n, p in adapted.model.named_parameters() if p.requires_grad}


# ---- the checks (shared with test_new_method.py) -------------------------------------------------
def check_output_neutral(kind: str, name: str):
    """attach and the first start_task change no logit: bit for bit, or within the method's `attach_rounding`
    (the protocols reuse the base's scores for the attached model when it is 0)."""
    model = base(kind, name)
    before = logits(model)
    adapted = attached(kind, name, model)
    atol = adapted.method.attach_rounding
    for when, after in (("attach", logits(adapted)), ("start_task(1)", logits(start(adapted)))):
        if atol:
            torch.testing.assert_close(after, before, rtol=0, atol=atol)
        else:
            assert torch.equal(before, after), f"{when} changed the logits by {(after - before).abs().max():.3g}"


def check_trainable(kind: str, name: str, everything: bool | None = None):
    """requires_grad is set exactly on trainable_parameters() (non-empty), after attach and start_task;
    with `everything`, they are (True) or are not (False) all the model's parameters."""
    adapted = attached(kind, name)
    for when in ("attach", "start_task"):
        if when == "start_task":
            start(adapted)
        trainable = {n for n, _ in adapted.trainable_parameters()}
        assert trainable, f"{name} trains nothing after {when}"
        assert requiring_grad(adapted) == trainable, when
        if everything is not None:
            assert (trainable == {n for n, _ in adapted.model.named_parameters()}) == everything, when


def check_one_step(kind: str, name: str):
    """One optimizer step leaves every frozen parameter bit-identical and moves a trainable one."""
    adapted = start(attached(kind, name))
    trainable = {n for n, _ in adapted.trainable_parameters()}
    before = snapshot(adapted.model)
    train_step(adapted)
    changed = {n for n, p in adapted.model.named_parameters() if not torch.equal(p, before[n])}
    assert changed, "no trainable parameter moved"
    assert changed <= trainable, f"frozen parameters changed: {sorted(changed - trainable)[:3]}"


RELOAD = """
import importlib, json, pkgutil, sys
from pathlib import Path
import torch
from safetensors.torch import load_file, save_file
tests, folder, *plugins = sys.argv[1:]
sys.path.insert(0, tests)
import forgetless.methods
from forgetless import from_pretrained
from forgetless.methods import build_method
from forgetless.models.gpt import logits_of
from tiny_models import tiny
torch.set_num_threads(2)
for plugin in plugins:  # methods that live in a file of their own
    forgetless.methods.__path__.append(plugin)
    for info in pkgutil.iter_modules([plugin]):
        importlib.import_module(f"forgetless.methods.{info.name}")
folder = Path(folder)
x = load_file(folder / "input.safetensors")["x"]
out = {}
for saved in sorted(folder.glob("*/*/" + CONFIG)):
    config = json.loads(saved.read_text())
    kind = saved.parent.parent.name
    fresh = tiny(kind, build_method(config["method"], config["options"])).eval()  # as transformers loads a model
    adapted = from_pretrained(fresh, saved.parent)  # no .eval(): what it injects follows the model's mode
    assert not any(m.training for m in adapted.modules()), f"{saved}: modules in training mode after loading"
    with torch.no_grad():
        out[f"{kind}/{saved.parent.name}"] = logits_of(adapted, x).contiguous()
save_file(out, folder / "reloaded.safetensors")
"""


def save_and_reload(kinds: list[str], names: list[str], folder: Path, plugins: tuple[str, ...] = ()) -> dict:
    """Train every method in `names` one step on each model kind (but the pairs attach refuses) and save it
    in folder/kind/name; one fresh process loads them all onto freshly built models in eval mode (`plugins`:
    folders of methods it imports first). Returns (kind, name) -> (logits here in eval mode, logits there, the
    fresh base's logits): everything that shapes the output, the modules' mode included, must come back."""
    x = windows(seed=3)[:, :-1].contiguous()
    save_file({"x": x}, folder / "input.safetensors")
    here = {}
    for kind in kinds:
        for name in names:
            if (kind, name) in REFUSED:
                continue
            adapted = train_step(start(attached(kind, name)))
            adapted.save_pretrained(folder / kind / name)
            here[kind, name] = logits(adapted, x), logits(base(kind, name), x)
    script = folder / "reload.py"
    script.write_text(f"CONFIG = {CONFIG!r}\n{RELOAD}")
    done = subprocess.run([sys.executable, str(script), str(Path(__file__).parent), str(folder), *plugins],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    there = load_file(folder / "reloaded.safetensors")
    return {key: (ref, there["/".join(key)], base_logits) for key, (ref, base_logits) in here.items()}


def check_reloaded(reference: torch.Tensor, reloaded: torch.Tensor, base_logits: torch.Tensor):
    assert not torch.equal(reference, base_logits), "the training step changed nothing to reload"
    assert torch.equal(reference, reloaded), f"reloaded logits differ by {(reloaded - reference).abs().max():.3g}"


def check_pretrained_lr(names: list[str]):
    """The real presets start each method that trains the model's own weights at its declared `pretrained_lr`,
    else at an lr its config sets, else at FINE_TUNING_LR; methods training their own modules keep theirs."""
    for preset in ("real", "real-full"):
        methods = build_config(preset).methods
        for name in names:
            cls, lr = METHODS[name], build_method(name, methods.get(name)).cfg.lr
            own = build_method(name).cfg.lr
            if cls.pretrained_lr is not None:
                assert lr == cls.pretrained_lr, (preset, name)
            elif cls.trains == MODULES:
                assert lr == own, (preset, name)
            else:
                assert lr == (FINE_TUNING_LR if own is None else own), (preset, name)


def check_other_architecture(kind: str, name: str, folder: Path):
    attached(kind, name).save_pretrained(folder)
    other = OTHER_ARCHITECTURE[kind](build_method(name, options(kind, name)))
    with pytest.raises(ForgetlessError, match="another architecture"):
        from_pretrained(other, folder)


# ---- the matrix --------------------------------------------------------------------------------
def test_matrix_covers_every_registered_method():
    assert len(NAMES) >= 15 and {"full", "lora", "apn", "ewc", "cms-fast"} <= set(NAMES)
    assert {"apn", "apn-local", "apn-param-matched", "cms", "cms-fast"} <= OWN_BASE
    assert "apn-retrofit" not in OWN_BASE


def test_refused_pairs_say_why():
    for (kind, name), message in REFUSED.items():
        with pytest.raises(ForgetlessError, match=message):
            attached(kind, name)


@pytest.mark.parametrize("kind, name", MATRIX)
def test_attach_is_output_neutral(kind, name):
    check_output_neutral(kind, name)


@pytest.mark.parametrize("kind, name", MATRIX)
def test_only_the_methods_parameters_train(kind, name):
    """...and they are every weight exactly where the method's `trains` trait says ALL."""
    check_trainable(kind, name, everything=METHODS[name].trains == ALL)


def test_methods_training_a_pretrained_models_weights_default_to_a_fine_tuning_lr():
    """On a pretrained model the preset's lr (5e-4, for added modules) wrecks its weights: in the real presets
    every method that trains them (its `trains` trait) starts at its own lr, else at FINE_TUNING_LR."""
    check_pretrained_lr(NAMES)


@pytest.mark.parametrize("kind, name", MATRIX)
def test_one_step_moves_only_trainable_parameters(kind, name):
    check_one_step(kind, name)


@pytest.fixture(scope="module")
def reloaded(tmp_path_factory):
    """save_and_reload of every method on every model kind: one subprocess for the whole matrix."""
    return save_and_reload(KINDS, NAMES, tmp_path_factory.mktemp("saved"))


@pytest.mark.parametrize("kind, name", MATRIX)
def test_save_and_load_in_a_fresh_process_is_bit_exact(kind, name, reloaded):
    check_reloaded(*reloaded[kind, name])


@pytest.mark.parametrize("kind, name", MATRIX)
def test_loading_onto_another_architecture_fails(kind, name, tmp_path):
    check_other_architecture(kind, name, tmp_path)


@pytest.mark.parametrize("kind, name", MATRIX)
def test_new_modules_follow_a_meta_model(kind, name):
    with torch.device("meta"):
        model = base(kind, name)
    adapted = attached(kind, name, model)
    elsewhere = [n for n, t in [*adapted.named_parameters(), *adapted.named_buffers()] if not t.is_meta]
    assert not elsewhere, f"not on meta: {elsewhere[:3]}"


@pytest.mark.parametrize("kind, name", MATRIX)
def test_new_modules_follow_a_bfloat16_model(kind, name):
    adapted = attached(kind, name, base(kind, name).to(torch.bfloat16))
    injected = adapted.injected()
    assert all(p.dtype == torch.bfloat16 for n, p in adapted.model.named_parameters() if n in injected)
    assert all(p.dtype == torch.bfloat16 for _, p in adapted.trainable_parameters())
    out = logits(adapted)
    assert out.dtype == torch.bfloat16 and out.shape == (4, T, 256) and torch.isfinite(out).all()


@pytest.mark.parametrize("kind, name", MATRIX)
def test_merge_and_unload(kind, name):
    """The `injects` and `merges` traits hold: a method that injects nothing (or, on our GPT, has a base of its
    own) gives the model back; one that merges folds into the base weights; any other refuses."""
    adapted = train_step(start(attached(kind, name)))
    inject_nothing = not METHODS[name].injects or kind == "gpt" and name in OWN_BASE
    assert (not adapted.injected()) == inject_nothing
    if inject_nothing:
        assert adapted.merge_and_unload() is adapted.model
    elif METHODS[name].merges:
        expected = logits(adapted)
        merged = adapted.merge_and_unload()
        assert merged is adapted.model and not isinstance(merged, Adapted)
        leftovers = [n for n, m in merged.named_modules() if isinstance(m, (LoraLayer, OSFLayer)) or "lora_" in n
                     or "osf_" in n]
        leftovers += [n for n, _ in merged.named_parameters() if ".down." in n or ".up." in n]  # o-lora banks
        assert not leftovers, f"peft layers left: {leftovers[:3]}"
        torch.testing.assert_close(logits(merged), expected, rtol=0, atol=1e-5)
    else:
        with pytest.raises(ForgetlessError, match="cannot be folded"):
            adapted.merge_and_unload()


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_answers_only_loss_runs_the_head_on_scored_positions_only(kind):
    """With targets of -100 (prompt tokens), a transformers model computes logits only for the tokens scored
    (forgetless.loss runs the head over them, in chunks); loss and gradients equal the all-positions loss."""
    adapted = start(attached(kind, "lora")).eval()                   # no dropout: both passes alike
    x = windows()[:, :-1]                                              # (4, T)
    y = torch.full_like(x, -100)
    y[0, 5:7], y[1, 9], y[3, 6] = x[0, 6:8], x[1, 10], x[3, 7]         # scored: positions 5, 6, 9
    seen = []
    head = adapted.model.get_output_embeddings()
    hook = head.register_forward_hook(lambda m, inputs, out: seen.append(out.shape[:-1].numel()))  # logits made
    loss = adapted.loss(Batch(x, y, torch.zeros(4, dtype=torch.bool)))
    hook.remove()
    grads = torch.autograd.grad(loss, [p for _, p in adapted.trainable_parameters()])
    logits = logits_of(adapted.model, x)                               # (4, T, V): every position
    full = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100)
    full_grads = torch.autograd.grad(full, [p for _, p in adapted.trainable_parameters()])
    assert sum(seen) == 4  # the 4 scored tokens (rows 0, 0, 1, 3), over all the head's calls
    torch.testing.assert_close(loss, full)
    for g, f in zip(grads, full_grads):
        torch.testing.assert_close(g, f)


@pytest.mark.parametrize("name, explicit", [("apn", {"apn": {"n_patches": 6}}), ("cms", {"level_hidden": 5})])
def test_retrofits_on_transformers_models_follow_their_size_budget(name, explicit):
    """APN and CMS beside a transformers model's MLPs have about retrofit_size x its parameters
    (byte-GPT sizes would outweigh a pretrained model); a width given explicitly wins."""
    total = sum(p.numel() for p in hf_llama().parameters())
    for size in (0.5, 1.0):  # the tiny model is too small for a smaller budget of top_k patches at rank 32
        adapted = attach(hf_llama(), name, retrofit_size=size)
        added = sum(p.numel() for _, p in adapted.trainable_parameters())
        assert added == pytest.approx(size * total, rel=0.15), (size, added, total)
    given = attach(hf_llama(), name, **explicit)
    widths = {m.cfg.n_patches for m in given.modules() if type(m).__name__ == "APN"} if name == "apn" else \
        {level.c_fc.out_features for level in given.modules() if type(level).__name__ == "Level"}
    assert widths == {6 if name == "apn" else 5}
    with pytest.raises(ForgetlessError, match="retrofit_size must be positive"):
        attach(hf_llama(), name, retrofit_size=0)


def test_param_matched_on_a_transformers_model_says_it_is_the_retrofit(capsys):
    """param_matched sizes forgetless's own APN base; on a transformers model it would silently be apn."""
    matched = attach(hf_llama(), "apn-param-matched", retrofit_size=0.5)
    plain = attach(hf_llama(), "apn", retrofit_size=0.5)
    assert "param_matched sizes forgetless's own APN base" in capsys.readouterr().err
    assert sum(p.numel() for _, p in matched.trainable_parameters()) == \
        sum(p.numel() for _, p in plain.trainable_parameters())
