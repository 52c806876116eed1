"""`forgetless aunn ...`: train an AUNN on a data list, condition it on a prompt, generate, run the experiments.

Model and training flags (`--model-d-model`, `--train-mode`, ...) are generated from AUNNConfig
and AUNNTrainConfig; experiment options are `--set KEY=VALUE` (`forgetless aunn experiments` lists them).
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from forgetless.aunn.model import AUNNConfig, size_overrides
from forgetless.aunn.train import AUNNTrainConfig
from forgetless.cliutil import config_flags, friendly, merge_overrides, out_console
from forgetless.config import from_dict, help_of
from forgetless.errors import ForgetlessError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Absolute Unit NN: an MLP from an absolute index to the byte stored there.")
SECTIONS = {"model": AUNNConfig, "train": AUNNTrainConfig}
section_flags = config_flags(lambda: SECTIONS)


def build_configs(size: str, config_file: Optional[Path], flags: dict) -> tuple[AUNNConfig, AUNNTrainConfig]:
    """Size preset < config file < flags."""
    sections = merge_overrides(config_file, flags)
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        raise ForgetlessError(f"unknown config section {unknown[0]!r}; valid: {', '.join(SECTIONS)}")
    return (from_dict(AUNNConfig, {**size_overrides(size), **sections.get("model", {})}, "model"),
            from_dict(AUNNTrainConfig, sections.get("train", {}), "train"))


@app.callback()
def threads_option(threads: int = typer.Option(1, help="torch CPU threads (CPU times are measured with this many); "
                                               "small MLP steps run best on one")):
    import torch

    if threads <= 0:
        raise typer.BadParameter(f"must be positive, got {threads}")
    torch.set_num_threads(threads)


def check_out(out: Optional[Path], checkpoint: Optional[Path] = None):
    """Refuse to overwrite an existing --out, unless it is the --checkpoint being updated."""
    if out and out.exists() and not (checkpoint and out.resolve() == checkpoint.resolve()):
        also = ", or pass --out equal to --checkpoint to update it" if checkpoint else ""
        raise ForgetlessError(f"{out} exists; choose another --out or delete it{also}")


def save_updated(out: Path, learner, meta: dict):
    """Write a conditioned learner, keeping the name and size of the data it was trained on."""
    from forgetless.aunn.use import save_learner

    save_learner(out, learner, **{k: meta[k] for k in ("data", "data_bytes") if k in meta})


SIZE = typer.Option("small", help="AUNN size preset: tiny, small, base or large (width and depth)")
CONFIG = typer.Option(None, "--config", help="YAML/JSON file with sections model and train")


@app.command()
@friendly
@section_flags
def train(data: str = typer.Option(..., help="corpus spec or path: its bytes, in order, are the list"),
          out: Path = typer.Option(..., help="checkpoint to write (.safetensors): model, optimizer, position"),
          limit: Optional[int] = typer.Option(None, help="use only the first N bytes"),
          size: str = SIZE, config_file: Optional[Path] = CONFIG, flags: dict | None = None):
    """Train an AUNN on a byte list (index i -> byte i)."""
    from forgetless.aunn.train import build_learner, fit
    from forgetless.aunn.use import save_learner
    from forgetless.data.corpora import load_corpus
    from forgetless.data.splits import join
    from forgetless.data.tokenizers import ByteTokenizer

    model_cfg, train_cfg = build_configs(size, config_file, flags)
    check_out(out)
    if limit is not None and limit <= 0:
        raise ForgetlessError(f"--limit must be positive, got {limit}")
    tokens = ByteTokenizer().encode(join(load_corpus(data).docs))[:limit]
    learner = build_learner(model_cfg, train_cfg)
    t0 = time.perf_counter()
    curve = fit(learner, tokens)
    save_learner(out, learner, data=data, data_bytes=len(tokens))
    out_console.print(f"wrote {out} · {learner.model.num_params():,} parameters · {len(tokens):,} bytes · "
                      f"final loss {curve['loss'][-1]:.3f} nats · {time.perf_counter() - t0:.1f} s")


def show(learner, start: int, n: int) -> str:
    """The argmax bytes at indices start..start+n-1, printable."""
    import torch

    from forgetless.data.tokenizers import ByteTokenizer
    return ByteTokenizer().decode(learner.predict(torch.arange(start, start + n)).argmax(-1))


@app.command("condition")
@friendly
def condition_cmd(checkpoint: Path = typer.Option(..., help="AUNN checkpoint"),
                  prompt: str = typer.Option(..., help="text appended at the next indices"),
                  steps: int = typer.Option(3, help="gradient steps on the prompt's (index, byte) pairs"),
                  peek: int = typer.Option(32, help="bytes of the argmax prediction to print after the prompt"),
                  out: Optional[Path] = typer.Option(None, help="write the conditioned checkpoint here "
                                                     "(a new file, or --checkpoint itself)")):
    """Append a prompt at the next indices, take k gradient steps on it, show the predictions after it."""
    from forgetless.aunn.use import condition, load_learner
    from forgetless.data.tokenizers import ByteTokenizer

    check_out(out, checkpoint)
    learner, meta = load_learner(checkpoint)
    data = ByteTokenizer().encode(prompt.encode())
    if not len(data):
        raise ForgetlessError("--prompt is empty; give the text to condition on")
    start = learner.position
    before = show(learner, start + len(data), peek)
    condition(learner, data, steps)
    after = show(learner, learner.position, peek)
    if out:
        save_updated(out, learner, meta)
    out_console.print(f"prompt at indices {start}..{start + len(data) - 1}; next {peek} bytes (argmax)\n"
                      f"  before: {before!r}\n  after {steps} step(s): {after!r}" + (f"\nwrote {out}" if out else ""),
                      highlight=False, markup=False)


@app.command()
@friendly
def generate(checkpoint: Path = typer.Option(..., help="AUNN checkpoint"),
             length: int = typer.Option(200, help="bytes to generate"),
             prompt: Optional[str] = typer.Option(None, help="condition on this text first"),
             prompt_steps: int = typer.Option(3, help="gradient steps on the prompt"),
             temperature: float = typer.Option(1.0, help="sampling temperature (0 = argmax)"),
             seed: int = typer.Option(0, help="sampling seed (same seed and checkpoint -> same text)"),
             out: Optional[Path] = typer.Option(None, help="write the checkpoint after generation here "
                                                "(a new file, or --checkpoint itself)")):
    """Predict the next index, sample, take one step on the sample, move on."""
    from forgetless.aunn.use import condition, load_learner
    from forgetless.aunn.use import generate as run_generate
    from forgetless.data.tokenizers import ByteTokenizer

    if length <= 0:
        raise ForgetlessError(f"--length must be positive, got {length}")
    check_out(out, checkpoint)
    learner, meta = load_learner(checkpoint)
    tok = ByteTokenizer()
    if prompt:
        condition(learner, tok.encode(prompt.encode()), prompt_steps)
    text = tok.decode(run_generate(learner, length, temperature, seed))
    if out:
        save_updated(out, learner, meta)
    typer.echo((prompt or "") + text)


@app.command()
@friendly(resume="run the same command again to resume from the finished seeds")
def bench(experiment: str = typer.Argument(..., help="toy, shakespeare or digits (`forgetless aunn experiments`)"),
          seeds: int = typer.Option(3, help="number of seeds (0..N-1); tables show mean ± std"),
          out: Optional[Path] = typer.Option(None, help="output folder (default runs/aunn-<experiment>)"),
          set_: Optional[list[str]] = typer.Option(None, "--set", help="an experiment option, KEY=VALUE (repeatable)"),
          config_file: Optional[Path] = typer.Option(None, "--config", help="YAML/JSON file of experiment options")):
    """Run one of the AUNN experiments; write results.json, results.md and figures."""
    from forgetless.aunn.experiments import EXPERIMENTS

    run_bench(EXPERIMENTS, "aunn", experiment, seeds, out, set_, config_file, example="tasks=5")


def run_bench(registry: dict, prefix: str, experiment: str, seeds: int, out: Optional[Path],
              set_: Optional[list[str]], config_file: Optional[Path], example: str):
    """The body of a `bench` command over `registry`'s experiments: run, print the table, list the files."""
    from forgetless.aunn.experiments import run_experiment

    if seeds <= 0:
        raise ForgetlessError(f"--seeds must be positive, got {seeds}")
    options = merge_overrides(config_file, {}, set_, example=example)
    out = out or Path("runs") / f"{prefix}-{experiment}"
    _, files = run_experiment(experiment, options, list(range(seeds)), out, registry)
    typer.echo(files[1].read_text())
    out_console.print("wrote " + ", ".join(str(f) for f in files))


@app.command()
@friendly
def experiments():
    """List the experiments and their options (set them with `bench --set KEY=VALUE`)."""
    from forgetless.aunn.experiments import EXPERIMENTS

    list_experiments(EXPERIMENTS)


def list_experiments(registry: dict):
    """One table per experiment of `registry`: its options, defaults and help."""
    from forgetless.aunn.experiments import experiment

    for name, (_, about) in registry.items():
        table = Table("option", "default", "about", title=f"{name}: {about}", title_justify="left")
        for f in dataclasses.fields(experiment(name, registry).Config):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            table.add_row(f.name, str(default), help_of(f))
        out_console.print(table)
