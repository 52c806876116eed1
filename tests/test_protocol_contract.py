"""The contract of every registered protocol (docs/DESIGN.md §3.0), as tests/test_contract.py is the methods':
`forgetless bench --protocol NAME` runs it on tiny models through the registry, its results.json has the keys it
declares and is written by the report it declares, `forgetless report` rewrites the same files from the registry,
and neither cli.py nor report/ compares a protocol's name."""
import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from forgetless.cli import app
from forgetless.continual import protocols
from forgetless.continual.protocol import Request, choose
from forgetless.errors import ForgetlessError
from forgetless.presets import build_config
from forgetless.report.kinds import report_for
from forgetless.report.results import RunResult
from tiny_lm import tiny_llama, trained_bpe

SRC = Path(__file__).resolve().parents[1] / "src" / "forgetless"
REGISTRY = protocols()
SMOKE = ["--preset", "smoke", "--seeds", "1", "--methods", "full,lora", "--workers", "1"]
TASKS = ["--preset", "real", "--tasks", "dbpedia,agnews", "--data-train-examples", "16", "--data-test-rows", "6",
         "--data-dev-rows", "4", "--data-eval-windows", "8", "--adapt-steps", "2", "--adapt-batch-size", "4",
         "--methods", "lora,mtl", "--seeds", "1", "--workers", "1"]
ARGS = {  # each protocol's smallest run: byte-gpt's smoke preset, or 2 cl500 tasks on a tiny random Llama ({model})
    "two-domain": SMOKE,
    "sequence": [*SMOKE, "--tasks", "shakespeare-folio,shakespeare-poems"],
    "online": [*SMOKE[:-4], "--methods", "lora", "--workers", "1"],
    "optimizers": [*SMOKE[:-4], "--optimizers", "adamw,muon", "--workers", "1"],
    "instructions": ["--model", "{model}", *TASKS],
    "study": ["--model", "{model}", *TASKS],
}


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> str:
    """hf:FOLDER of a tiny random Llama with a small BPE tokenizer (saved as transformers saves them)."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = trained_bpe()
    tiny_llama(len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return f"hf:{folder}"


def test_every_protocol_has_its_smallest_run_here():
    assert set(ARGS) == set(REGISTRY), "a protocol registered without a run in ARGS (or one gone): add its smallest run"


@pytest.mark.parametrize("name", list(REGISTRY))
def test_bench_and_report_run_every_protocol_through_the_registry(name, model_folder, tmp_path, one_thread):
    protocol, out = REGISTRY[name], tmp_path / "run"
    result = invoke("bench", "--protocol", name, *[a.format(model=model_folder) for a in ARGS[name]], "--out", out)
    assert result.exit_code == 0, result.output
    raw = json.loads((out / "results.json").read_text())
    assert set(protocol.result_keys) <= set(raw), set(protocol.result_keys) - set(raw)
    for label, entry in raw["methods"].items():
        assert set(protocol.method_keys) <= set(entry), (label, set(protocol.method_keys) - set(entry))
    assert report_for(RunResult.load(out)) is protocol.report
    written = {f: (out / f).read_bytes() for f in ("results.json", "results.csv", "results.md")}
    again = invoke("report", out)
    assert again.exit_code == 0, again.output
    assert {f: (out / f).read_bytes() for f in written} == written  # the registry's report writes the same files


def request(protocol: str, overrides: dict | None = None, **fields) -> Request:
    """A bench request on the smoke preset."""
    return Request(protocol, build_config("smoke", overrides), "smoke", **fields)


def test_a_protocol_that_refines_another_takes_its_requests():
    """sequence with instruction tasks runs the instructions protocol; two-domain with --optimizers the optimizers
    protocol (set up with them); a plain request the protocol named."""
    tasks = {"data": {"tasks": ["dbpedia", "agnews"]}}
    assert choose(REGISTRY, request("sequence", overrides=tasks, model="hf:x")).name == "instructions"
    assert choose(REGISTRY, request("sequence")).name == "sequence"
    chosen = choose(REGISTRY, request("two-domain", optimizers="adamw,muon", pretrain_seeds=2))
    assert chosen.name == "optimizers" and chosen.optimizers == ["adamw", "muon"] and chosen.pretrain_seeds == 2
    assert REGISTRY["optimizers"].optimizers == []  # the registered one is not changed by a request
    assert choose(REGISTRY, request("two-domain")).name == "two-domain"


@pytest.mark.parametrize("protocol, fields, message", [
    ("sequence", {"optimizers": "adamw"}, "--optimizers runs the two-domain protocol (optimizers)"),
    ("online", {"pretrain_seeds": 2}, "--pretrain-seeds runs the two-domain protocol"),
    ("optimizers", {}, "give --optimizers adamw,muon"),
    ("instructions", {}, "instruction tasks need a pretrained model"),
    ("study", {}, "a study runs instruction tasks on a pretrained model"),
    ("two-domain", {"base_seeds": 0}, "--base-seeds 0: give N >= 1"),
    ("three", {}, "unknown protocol 'three'; valid: instructions, online, optimizers, sequence, study, two-domain"),
])
def test_each_protocol_refuses_what_it_cannot_run_before_any_work(protocol, fields, message):
    with pytest.raises(ForgetlessError, match=re.escape(message)):
        choose(REGISTRY, request(protocol, **fields))


def test_no_protocol_name_is_compared_in_the_cli_or_the_reports():
    """bench and report find protocols by registry look-up: no `== "sequence"`, `!= "online"`, `in ("two-domain", ...`
    in cli.py or report/ (a name may be declared there, e.g. a Report's `protocol`, not tested)."""
    names = "|".join(re.escape(n) for n in REGISTRY)
    quoted = rf"""["'](?:{names})["']"""
    compared = re.compile(rf"(?:==|!=|\bin)\s*[(\[{{]?\s*{quoted}|{quoted}\s*(?:==|!=|\bin\b)")
    files = [SRC / "cli.py", *sorted((SRC / "report").glob("*.py"))]
    found = [f"{path.name}:{i}: {line.strip()}" for path in files
             for i, line in enumerate(path.read_text().splitlines(), 1) if compared.search(line)]
    assert not found, found
    assert compared.search('if results.protocol == "two-domain":') and compared.search('x in ("sequence", "online")')


def test_a_new_protocol_is_one_file_and_its_report(monkeypatch, tmp_path, one_thread):
    """What a file of one's own adds (docs/DESIGN.md §3.0): a protocol (here two-domain run from B back to A) and its
    report, registered; bench and report then run it by name, with no other change."""
    from forgetless.continual.protocol import PROTOCOLS
    from forgetless.continual.two_domain import TwoDomain
    from forgetless.report import kinds, two_domain_figures
    from forgetless.report.frontier import GAIN
    from forgetless.report.tables import domains_text, markdown, one_table, terminal_rows, write_csv

    class Backwards(TwoDomain):
        name = "backwards"
        report = kinds.Report("backwards", write_csv, markdown, two_domain_figures, one_table(terminal_rows),
                              domains_text, frontier=GAIN)

        def config_defaults(self, tasks):
            return {"data": {"domain_a": "shakespeare-folio", "domain_b": "shakespeare-modern"}}

    monkeypatch.setitem(PROTOCOLS, Backwards.name, Backwards())               # @register_protocol, undone after
    monkeypatch.setattr(kinds, "REPORTS", [*kinds.REPORTS, Backwards.report])  # register_report, undone after
    result = invoke("bench", "--protocol", "backwards", *SMOKE, "--out", tmp_path)
    assert result.exit_code == 0, result.output
    assert "backwards · smoke · A=shakespeare-folio → B=shakespeare-modern" in " ".join(result.output.split())
    results = RunResult.load(tmp_path)
    assert results.protocol == "backwards" and results.extra["domains"] == {"a": "shakespeare-folio",
                                                                           "b": "shakespeare-modern"}
    assert invoke("report", tmp_path).exit_code == 0 and "Protocol backwards" in (tmp_path / "results.md").read_text()
