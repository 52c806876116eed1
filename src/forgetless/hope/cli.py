"""`forgetless hope ...`: the HOPE experiments (language modelling, needle recall) over seeds.

Options are `--set KEY=VALUE` (`forgetless hope experiments` lists them). The continual experiment is the
two-domain protocol: `forgetless bench --methods 'hope,hope[writes=false]'`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from forgetless.aunn.cli import list_experiments, run_bench, threads_option
from forgetless.cliutil import friendly

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="HOPE vs the byte GPT vs Titans memory: language modelling and recall at equal CPU time.")
app.callback()(threads_option)


@app.command()
@friendly(resume="run the same command again to resume from the finished seeds")
def bench(experiment: str = typer.Argument(..., help="lm or needle (`forgetless hope experiments`)"),
          seeds: int = typer.Option(3, help="number of seeds (0..N-1); tables show mean ± std"),
          out: Optional[Path] = typer.Option(None, help="output folder (default runs/hope-<experiment>)"),
          set_: Optional[list[str]] = typer.Option(None, "--set", help="an experiment option, KEY=VALUE (repeatable)"),
          config_file: Optional[Path] = typer.Option(None, "--config", help="YAML/JSON file of experiment options")):
    """Run one of the HOPE experiments; write results.json, results.md and figures."""
    from forgetless.hope import EXPERIMENTS

    run_bench(EXPERIMENTS, "hope", experiment, seeds, out, set_, config_file, example="budget_s=60")


@app.command()
@friendly
def experiments():
    """List the experiments and their options (set them with `bench --set KEY=VALUE`)."""
    from forgetless.hope import EXPERIMENTS

    list_experiments(EXPERIMENTS)
