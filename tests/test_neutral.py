"""Neutral Residues (gated adapters, l1 on original rows, init), mixing, and EWC."""
import json

import pytest
import torch

from forgetless import attach
from forgetless.adapted import CONFIG, from_pretrained
from forgetless.data.splits import Batch, Sampler
from forgetless.errors import ForgetlessError
from forgetless.methods import build_method
from forgetless.methods.ewc import empirical_fisher, fisher_rows, random_windows
from forgetless.models.gpt import logits_of
from forgetless.nn.neutral import GatedAdapter, NeutralConfig
from tiny_models import ours
from tiny_results import run_result


def batch(from_other: list[bool], seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (len(from_other), 13), generator=g)
    return Batch(data[:, :-1], data[:, 1:], torch.tensor(from_other))


@pytest.mark.parametrize("options", [{}, {"vector_gate": True}, {"gate": "sigmoid"}, {"gate": "none"}])
def test_attached_model_equals_the_base_before_training(options):
    model = ours().eval()
    x = torch.randint(0, 256, (2, 12))
    before = logits_of(model, x)
    model = attach(model, "neutral", **options).eval()
    assert torch.equal(logits_of(model, x), before)  # W_o = 0: the residue is exactly zero


def test_size_is_a_fraction_of_the_base():
    base = sum(p.numel() for p in ours().parameters())
    method = build_method("neutral", {"size": 0.2})
    model = method.attach(ours())
    extra = sum(p.numel() for _, p in method.trainable_parameters(model))
    assert 0.18 * base < extra < 0.22 * base


def test_init_variances():
    d, layers = 512, 8
    adapter = GatedAdapter(d, 256, layers, NeutralConfig())
    for w in (adapter.w_i.weight, adapter.w_g.weight, adapter.gate.weight):
        assert w.var().item() == pytest.approx(1 / (d * layers), rel=0.1)
    assert torch.equal(adapter.w_o.weight, torch.zeros_like(adapter.w_o.weight))
    he = GatedAdapter(d, 256, layers, NeutralConfig(low_variance_init=False))
    assert he.w_i.weight.var().item() == pytest.approx(2 / d, rel=0.1)


def test_l1_term_uses_only_original_rows():
    method = build_method("neutral", {"alpha": 0.5})
    model = method.attach(ours())
    with torch.no_grad():
        for a in method.adapters(model):
            a.w_o.weight.normal_()
            a.gate.bias.fill_(1.0)  # gates open
    rows = [False, True, False, True]
    b = batch(rows)
    logits_of(model, b.x)
    loss = method.extra_loss(model, b)
    expected = torch.stack([a.last_out[torch.tensor(rows)].abs().sum(-1).mean() / 32
                            for a in method.adapters(model)]).mean() * 0.5
    assert loss.item() == pytest.approx(expected.item())
    changed = Batch(b.x.clone(), b.y, b.from_other)
    changed.x[0] = (changed.x[0] + 1) % 256  # a new-domain row: the term must not move
    logits_of(model, changed.x)
    assert method.extra_loss(model, changed).item() == pytest.approx(loss.item())
    changed.x[1] = (changed.x[1] + 1) % 256  # an original row: it must
    logits_of(model, changed.x)
    assert method.extra_loss(model, changed).item() != pytest.approx(loss.item())
    none = batch([False] * 4)
    logits_of(model, none.x)
    assert method.extra_loss(model, none) is None  # no original rows, no term


def test_sigmoid_gate_learns_the_domain_label():
    method = build_method("neutral", {"gate": "sigmoid"})
    model = method.attach(ours())
    b = batch([False, False, True, True])
    logits_of(model, b.x)
    before = method.extra_loss(model, b)
    params = [p for _, p in method.trainable_parameters(model)]
    opt = torch.optim.Adam(params, lr=1e-2)
    for _ in range(30):
        opt.zero_grad()
        logits_of(model, b.x)
        method.extra_loss(model, b).backward()
        opt.step()
    logits_of(model, b.x)
    assert method.extra_loss(model, b) < 0.5 * before


def test_bad_options():
    with pytest.raises(ForgetlessError, match="gate must be one of relu, sigmoid, none"):
        build_method("neutral", {"gate": "tanh"})
    with pytest.raises(ForgetlessError, match="mix must be in \\[0, 1\\]"):
        build_method("full", {"mix": 1.5})


@pytest.mark.parametrize("p", [0.01, 0.1, 0.3, 0.5])
def test_mixing_ratio_is_honoured_over_many_batches(p):
    main, other = torch.zeros(500, dtype=torch.long), torch.ones(500, dtype=torch.long)
    sampler = Sampler(main, 16, 8, seed=0, other=other, p=p)
    rows = [sampler.next().from_other for _ in range(2000)]
    share = torch.cat(rows).float().mean().item()
    assert share == pytest.approx(p, abs=0.01 + 0.05 * p)
    assert all(((b.sum() == int(16 * p)) | (b.sum() == int(16 * p) + 1)).item() for b in rows[:50])


def test_ewc_penalty_zero_at_the_anchor_and_positive_away():
    from forgetless.data.domains import Domain
    tokens = torch.randint(0, 256, (2000,), generator=torch.Generator().manual_seed(0))
    learned = Domain("a", tokens, tokens, tokens[:17 * 4].view(4, 17), [], "fp")
    method = build_method("ewc", {"lam": 10.0, "fisher_samples": 8})
    model = ours()
    with pytest.raises(ForgetlessError, match="call adapted.start_task\\(1, previous=old_rows\\)"):
        attach(model, method).start_task(1)   # without what it protects EWC would be plain full fine-tuning
    attach(model, method).start_task(1, previous=learned)
    b = batch([False, False])
    assert method.extra_loss(model, b).item() == 0.0
    assert all((f >= 0).all() for f in method.terms[0].fisher.values()) and any(f.sum() > 0 for f in method.terms[0].fisher.values())
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    assert method.extra_loss(model, b).item() > 0
    state = method.hook_state()
    other = build_method("ewc", {"lam": 10.0})
    other.load_hook_state(state)
    assert other.extra_loss(model, b).item() == pytest.approx(method.extra_loss(model, b).item())


def test_fisher_is_the_mean_squared_window_gradient():
    model = ours(d=16, n_layer=1)
    tokens = torch.randint(0, 256, (500,), generator=torch.Generator().manual_seed(1))
    fisher = empirical_fisher(model, fisher_rows(random_windows(tokens, 12, 3, seed=5), 3))
    starts = torch.randint(len(tokens) - 13, (3,), generator=torch.Generator().manual_seed(5)).tolist()
    w = dict(model.named_parameters())["lm_head.weight" if "lm_head.weight" in dict(model.named_parameters())
                                       else "transformer.wte.weight"]
    expected = torch.zeros_like(w)
    for s in starts:
        window = tokens[s:s + 13][None]
        loss = torch.nn.functional.cross_entropy(logits_of(model.eval(), window[:, :-1])[0], window[0, 1:])
        (g,) = torch.autograd.grad(loss, [w])
        expected += g.square() / 3
    name = [n for n, p in model.named_parameters() if p is w][0]
    assert torch.allclose(fisher[name], expected, atol=1e-8)


def test_gate_report_and_figure(tmp_path):
    from forgetless.report.diagnostics import method_figures, shown_layers
    adapted = attach(ours(), "neutral")
    method, model = adapted.method, adapted.model
    wa, wb = torch.randint(0, 128, (4, 13)), torch.randint(128, 256, (4, 13))
    report = method.report(model, wa, wb)
    assert len(report["gate_hist_a"]) == 2 and len(report["gate_bins"]) == 41
    assert all(sum(h) == pytest.approx(1.0) for h in report["gate_hist_a"] + report["gate_hist_b"])
    assert all(0 <= c <= 1 for c in report["gate_closed_a"])
    assert build_method("neutral", {"gate": "none"}).report(model, wa, wb) == {}
    results = run_result("two-domain", {"neutral": {"report": {"before": report, "after": report}}, "full": {}})
    assert method_figures(results, tmp_path) == [tmp_path / "gates.png"]
    assert (tmp_path / "gates.png").stat().st_size > 1000
    assert shown_layers(4) == [0, 1, 2, 3] and shown_layers(30) == [0, 6, 12, 17, 23, 29]
    assert adapted.figures(tmp_path / "api", wa, wb) == [tmp_path / "api" / "gates.png"]


def test_mix_sweep_figure_needs_three_ratios(tmp_path):
    from forgetless.report.figures import mix_sweep

    def arm(mix, f):
        return {"options": {"mix": mix}, "forgetting": {"mean": f, "std": 0.01},
                "adaptation_gain": {"mean": 1 - f, "std": 0.01}}
    arms = {"full": arm(None, 0.2), "full[mix=0.1]": arm(0.1, 0.1), "lora[r=4;mix=0.5]": arm(0.5, 0.0)}
    config = {"adapt": {"replay": 0.0}}  # a file from before the knob's rename
    assert not mix_sweep(run_result("two-domain", arms, config=config), tmp_path / "a.png")  # the lora arm changes
    arms["full[mix=0.5]"] = arm(0.5, 0.05)                                                  # another option: no point
    assert mix_sweep(run_result("two-domain", arms, config=config), tmp_path / "b.png")
    assert (tmp_path / "b.png").stat().st_size > 0


def test_adapter_reads_its_input_at_unit_scale():
    """Pretrained FFN inputs are often RMS 0.1-0.4: rescaled per token, the gate and the adapter see the
    scale their low-variance init assumes, whatever the model; off, they see the raw input."""
    torch.manual_seed(0)
    x = torch.randn(2, 5, 64)
    for normalize in (True, False):
        adapter = GatedAdapter(64, 32, 4, NeutralConfig(normalize_input=normalize))
        torch.nn.init.normal_(adapter.w_o.weight)
        big, small = adapter(x), adapter(0.1 * x)
        assert torch.allclose(big, small, atol=1e-3) == normalize  # eps aside


def test_a_save_made_before_normalize_input_existed_loads_as_it_was_trained(tmp_path):
    adapted = attach(ours(), "neutral")
    adapted.save_pretrained(tmp_path)
    config = json.loads((tmp_path / CONFIG).read_text())
    assert config["options"]["normalize_input"] is True
    del config["options"]["normalize_input"]  # as written by forgetless before the option existed
    (tmp_path / CONFIG).write_text(json.dumps(config))
    assert from_pretrained(ours(), tmp_path).method.cfg.normalize_input is False


def test_on_a_pretrained_model_neutral_starts_at_the_lr_chosen_for_it():
    """3e-4 on the real presets (LoRA's pace on SmolLM2, chosen on validation windows); 1e-3 on the byte GPT."""
    from forgetless.presets import build_config
    for preset in ("real", "real-full"):
        assert build_method("neutral", build_config(preset).methods.get("neutral")).cfg.lr == 3e-4
    for preset in ("smoke", "first", "quick", "paper"):
        assert build_method("neutral", build_config(preset).methods.get("neutral")).cfg.lr == 1e-3
