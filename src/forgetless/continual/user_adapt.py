"""`forgetless adapt --data NEW [--retain OLD]`: a method on a pretrained model, trained on the user's own
data (replaying rows of their old data where given), with a report of both sides before and after.

A tenth of each data set (at least one row) is held out and scored before and after: the loss and
token accuracy of the trained tokens of NEW (the answers of prompt/answer records), and the perplexity
of OLD (what should not be forgotten). The trained model is exported in the most portable form."""
from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

import torch
import torch.nn as nn

from forgetless import distributed
from forgetless.adapted import attach
from forgetless.checkpoint import write_json
from forgetless.data.instructions import Encoded, InstructionSampler
from forgetless.data.splits import Batch
from forgetless.data.user import Collator, load
from forgetless.device import autocast
from forgetless.errors import ForgetlessError
from forgetless.loss import scored_totals
from forgetless.methods import Method
from forgetless.models.hf import LoadConfig, describe
from forgetless.monitor import PeakRSS
from forgetless.presets import AdaptConfig
from forgetless.progress import console, progress_task
from forgetless.train import train

HELD_OUT = 0.1  # of each data set, scored before and after
REPLAY = 0.2  # of each batch from --retain where neither the config nor the method sets a mix
MIN_HELD_OUT = 20  # held-out rows below which a report says its numbers are noisy


def data_config(method: Method, cfg: AdaptConfig, has_old: bool) -> AdaptConfig:
    """What `adapt --data` trains `method` at: its own lr, mix and optimizer over `cfg`'s; with old data and no mix
    set in either, `REPLAY` of each batch old rows; without old data, none (the guide's settings are these)."""
    if has_old and not cfg.mix:
        cfg = dataclasses.replace(cfg, mix=REPLAY)
    cfg = method.training_config(cfg)
    return cfg if has_old else dataclasses.replace(cfg, mix=0.0)


def adapt_on_data(model: nn.Module, tokenizer, method: Method, new, old, cfg: AdaptConfig, seed: int, out: Path,
                  max_length: int, model_spec: str | None = None, loaded: LoadConfig | None = None,
                  fsdp: bool = False, rss_start_mb: float | None = None) -> dict:
    """Train `method` on `new` (mixing rows of `old` where given) and write out/report.{json,md},
    out/report.png and the exported model in out/model; returns the report (`loaded`: how the model was loaded;
    `rss_start_mb`: the process's resident memory before it was, reported beside the training's peak).
    `fsdp`: the model sharded over the processes of torchrun once the method is attached (Adapted.shard)."""
    new_train, new_held = held_out(load(new, tokenizer, max_length), "--data")
    old_train, old_held = held_out(load(old, tokenizer, max_length), "--retain") if old is not None else (None, None)
    notes = [*thin(new_train, new_held, "--data"), *(thin(old_train, old_held, "--retain") if old is not None else [])]
    for note in notes:
        console.print(f"[yellow]warning:[/yellow] {note}", highlight=False, soft_wrap=True)
    cfg = data_config(method, cfg, old is not None)
    mix = cfg.mix
    pad = Collator(tokenizer).pad_id
    before = None if fsdp else scores(model, new_held, old_held, pad, cfg.precision)
    torch.manual_seed(seed)
    adapted = attach(model, method)
    if fsdp:  # scored once sharded (ranks other than 0 may have built the model without weights)
        adapted.shard(cfg.precision)
        before = scores(adapted.model, new_held, old_held, pad, cfg.precision)
    adapted.start_task(1, old_train if method.needs_previous else None)
    params = adapted.trainable_parameters()
    sampler = InstructionSampler(encoded(new_train, pad), cfg.batch_size, seed,
                                 encoded(old_train, pad) if mix > 0 else None, mix,
                                 group=cfg.group_by_length)
    with PeakRSS() as memory:
        t0 = time.perf_counter()
        history = train(adapted.model, params, sampler, cfg, lambda m, batch: adapted.losses(batch), hooks=method,
                        ckpt_path=out / "training.safetensors", desc=f"adapt {method.name}",
                        run_config={"model": model_spec, "method": method.name, "options": method.options(),
                                    "adapt": cfg.__dict__, "seed": seed})
        wall = time.perf_counter() - t0
    adapted.end_task(1)
    after = scores(adapted.model, new_held, old_held, pad, cfg.precision)
    form, folder = adapted.export(out / "model", tokenizer)
    (out / "training.safetensors").unlink(missing_ok=True)
    report = {"model": model_spec, "method": method.name, "options": method.options(), "seed": seed,
              "rows": {"new_train": len(new_train), "new_held_out": len(new_held),
                       "old_train": len(old_train or []), "old_held_out": len(old_held or [])},
              "mix": mix, "steps": cfg.steps, "lr": cfg.lr, "precision": cfg.precision,
              "load": {**dataclasses.asdict(loaded or LoadConfig()), "dtype_used": describe(model)["dtype"]},
              "before": before, "after": after,
              "trainable_params": sum(p.numel() for _, p in params),
              "total_params": sum(p.numel() for p in adapted.model.parameters()),
              "wall_s": wall, "peak_rss_mb": memory.peak_mb, "rss_start_mb": rss_start_mb, "loss": history.loss,
              "export": {"form": form, "folder": str(folder)}, "notes": notes}
    write_json(out / "report.json", report)
    if distributed.is_main():
        drawn = figure(report, out / "report.png")
        (out / "report.md").write_text(markdown(report, image=drawn))
    return report


def held_out(data, flag: str):
    """(train rows, held-out rows): HELD_OUT of the rows, at least one, picked by a fixed seed."""
    if len(data) < 2:
        raise ForgetlessError(f"{flag} has {len(data)} row(s); give at least 2 (one is held out to score)")
    n = max(1, round(HELD_OUT * len(data)))
    picks = set(torch.randperm(len(data), generator=torch.Generator().manual_seed(0))[:n].tolist())
    return (data.select([i for i in range(len(data)) if i not in picks]), data.select(sorted(picks)))


def thin(train, held, flag: str) -> list[str]:
    """What makes the held-out scores of one data set weak evidence: fewer than MIN_HELD_OUT rows, or rows that
    repeat training rows (their scores measure memorisation)."""
    notes = []
    if len(held) < MIN_HELD_OUT:
        notes.append(f"{flag}: only {len(held)} held-out row(s) scored (fewer than {MIN_HELD_OUT}), so its before/after "
                     f"numbers are noisy; give {MIN_HELD_OUT * 10} or more rows")
    seen = {tuple(r["input_ids"]) for r in train}
    if repeats := sum(tuple(r["input_ids"]) in seen for r in held):
        notes.append(f"{flag}: {repeats} of {len(held)} held-out rows repeat training rows, so their scores measure "
                     "memorisation, not what was learned; remove the duplicates")
    return notes


def encoded(rows, pad: int) -> Encoded:
    """Rows of input_ids and labels (transformers' alignment) as the sampler's shifted rows."""
    xs = [torch.tensor(r["input_ids"][:-1]) for r in rows]
    ys = [torch.tensor(r["labels"][1:]) for r in rows]
    return Encoded(xs, ys, pad)


@torch.no_grad()
def scores(model: nn.Module, new_held, old_held, pad: int, precision: str = "fp32", batch_size: int = 8) -> dict:
    """Loss and token accuracy on the trained tokens of the held-out new rows; perplexity of the old ones; the
    forwards under `precision`'s autocast (the training's)."""
    with autocast(next(model.parameters()).device, precision):
        out = {f"new_{k}": v for k, v in score(model, new_held, pad, batch_size).items()}
        old = score(model, old_held, pad, batch_size) if old_held is not None else None
    if old is not None:
        out.update(old_loss=old["loss"], old_ppl=math.exp(old["loss"]), old_acc=old["acc"])
    return out


def score(model: nn.Module, rows, pad: int, batch_size: int) -> dict:
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    collate, total, correct, n = Collator(pad_id=pad), 0.0, 0, 0
    with progress_task("score held-out rows", len(rows)) as advance:
        for i in range(0, len(rows), batch_size):
            batch = collate([rows[j] for j in range(i, min(i + batch_size, len(rows)))])
            ids, mask, labels = (batch[k].to(device) for k in ("input_ids", "attention_mask", "labels"))
            loss, hits, count = scored_totals(model, Batch.of_hf(ids, mask, labels))
            total, correct, n = total + loss, correct + hits, n + count
            advance(len(ids))
    model.train(was_training)
    return {"loss": total / max(n, 1), "acc": correct / max(n, 1), "tokens": n}


def markdown(r: dict, image: bool = True) -> str:
    b, a = r["before"], r["after"]
    lines = [f"# forgetless adapt: {r['method']} on {r['model']}", "",
             f"{r['rows']['new_train']} new rows trained ({r['rows']['new_held_out']} held out), "
             f"{r['rows']['old_train']} old rows ({r['rows']['old_held_out']} held out), {r['mix']:.0%} of each batch old; "
             f"{r['steps']} steps at lr {r['lr']:g}; {r['trainable_params']:,} of {r['total_params']:,} parameters trained; "
             f"{r['wall_s']:.0f} s; peak memory {r['peak_rss_mb'] / 1024:.2f} GiB; exported as {r['export']['form']} "
             f"to {r['export']['folder']}.", "",
             "| held-out rows | before | after |", "|---|---|---|",
             f"| new data: loss of the trained tokens | {b['new_loss']:.3f} | {a['new_loss']:.3f} |",
             f"| new data: token accuracy | {b['new_acc']:.1%} | {a['new_acc']:.1%} |"]
    if "old_ppl" in b:
        change = a["old_ppl"] / b["old_ppl"] - 1
        lines.append(f"| old data: perplexity (forgetting {change:+.1%}) | {b['old_ppl']:.3f} | {a['old_ppl']:.3f} |")
    else:
        lines += ["", "No old data was given (--retain), so forgetting was not measured."]
    if r.get("notes"):
        lines += ["", *(f"**Warning:** {note}" for note in r["notes"])]
    return "\n".join(lines) + ("\n\n![before and after](report.png)\n" if image else "\n")


def figure(r: dict, path: Path) -> bool:
    """Training loss, and held-out loss of new and old rows before and after; without matplotlib (the
    `plots` extra) nothing is drawn, one line says so, and False is returned."""
    from forgetless.report.figures import PLOTS_MISSING, available, plt, save
    if not available():
        console.print(PLOTS_MISSING.replace("`forgetless report DIR`", "run again"), markup=False, highlight=False, soft_wrap=True)
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.2))
    steps, losses = zip(*r["loss"]) if r["loss"] else ((), ())
    left.plot(steps, losses, color="tab:blue")
    left.set(xlabel="step", ylabel="training LM loss", title=f"{r['method']}: training")
    sides = [("new data", "new_loss")] + ([("old data", "old_loss")] if "old_loss" in r["before"] else [])
    for i, (name, key) in enumerate(sides):
        right.bar([i - 0.18, i + 0.18], [r["before"][key], r["after"][key]], width=0.34,
                  color=["tab:gray", "tab:orange"], label=["before", "after"] if i == 0 else None)
    right.set_xticks(range(len(sides)), [name for name, _ in sides])
    right.set(ylabel="held-out loss (nats/token)", title="held-out rows")
    right.legend(fontsize=8)
    save(fig, path, dpi=100)
    return True
