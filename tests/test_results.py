"""results.json as typed objects (report/results.py): a file read and written back is the same text, key order
included; older files load; bad files are one-line errors; and scripts/compare_results.py, which checks that two
versions of the code wrote the same numbers. Each protocol's own results.json round trips in its test file
(tiny_results.round_trips)."""
import importlib.util
import json
import math
from pathlib import Path

import pytest

from forgetless.errors import ForgetlessError
from forgetless.report.results import MethodEntry, RunResult
from tiny_results import round_trips

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "compare_results.py"
spec = importlib.util.spec_from_file_location("compare_results", SCRIPT)
compare_results = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compare_results)


def entry(**stats) -> dict:
    return {"forgetting": {"mean": 0.1, "std": 0.0}, "method": "lora", "trainable_params": 8, "total_params": 100,
            "peak_rss_mb": 512.0, "options": {"r": 8}, "wall_s": {"mean": 1.5, "std": 0.0},
            "per_seed": {"0": {"forgetting": 0.1}}, **stats}


def two_domain() -> dict:
    return {"protocol": "two-domain", "preset": "smoke", "seeds": [0], "base_seeds": 1, "forgetless_version": "0.1",
            "code": "abc", "git_commit": None, "python": "3.12", "torch": "2.9", "device": "cpu", "model": "byte-gpt",
            "precision": {"used": "fp32", "requested": "fp32", "why": "the preset's"},
            "domains": {"a": "tinyshakespeare", "b": "renamed:tinyshakespeare"}, "date": "2026-11-27",
            "config": {"adapt": {"lr": 1e-3, "mix": 0.0}},
            "bases": {"dense": {"path": "/cache/bases/dense/base.safetensors", "pretrain_wall_s": 3.0}},
            "methods": {"lora": entry(), "lora[r=4]": entry(options={"r": 4}, trainable_params=4)}}


def test_a_file_read_and_written_back_is_the_same_text(tmp_path):
    path = tmp_path / "results.json"
    path.write_text(json.dumps(two_domain(), indent=2))
    assert round_trips(path)
    results = RunResult.load(tmp_path)  # the folder or the file
    lora = results.methods["lora[r=4]"]
    assert isinstance(lora, MethodEntry) and lora.method == "lora" and lora.trainable_params == 4
    assert lora.stats == {"forgetting": {"mean": 0.1, "std": 0.0}} and lora.per_seed == {"0": {"forgetting": 0.1}}
    assert results.provenance["git_commit"] is None and results.extra["domains"]["a"] == "tinyshakespeare"
    assert results["methods"]["lora"]["forgetting"]["mean"] == 0.1  # read as the dict the Python API returned
    assert results["methods"]["lora"]["wall_s"] == {"mean": 1.5, "std": 0.0} and "git_commit" in results
    assert set(results["methods"]["lora"]) == set(two_domain()["methods"]["lora"]) and len(results) == len(two_domain())
    results.extra["frontier"] = {"lora, r": {}}   # a key added (write_report's) goes after the others
    assert list(results.to_json())[-2:] == ["methods", "frontier"]
    assert list(results.with_keys(model="hf:x").to_json()) == list(results.to_json())  # set in place


def test_an_older_file_loads_and_is_written_back_as_it_was(tmp_path):
    """No `method` (the label up to '['), `replay` for `mix`, no base_seeds, precision, model or provenance."""
    old = two_domain()
    for key in ("base_seeds", "precision", "model", "forgetless_version", "code", "git_commit"):
        del old[key]
    old["config"]["adapt"] = {"lr": 1e-3, "replay": 0.25}
    for label in old["methods"]:
        del old["methods"][label]["method"]
    (tmp_path / "results.json").write_text(json.dumps(old, indent=2))
    assert round_trips(tmp_path / "results.json")
    results = RunResult.load(tmp_path)
    assert results.methods["lora[r=4]"].method == "lora" and results.adapt["mix"] == 0.25
    assert results.base_seeds == 1 and results.model == "byte-gpt" and results.precision is None
    assert "method" not in results.to_json()["methods"]["lora"] and "base_seeds" not in results.to_json()


def test_bad_files_are_one_line_errors(tmp_path):
    with pytest.raises(ForgetlessError, match="does not exist; give the --out folder"):
        RunResult.load(tmp_path / "results.json")
    (tmp_path / "results.json").write_text("{not json")
    with pytest.raises(ForgetlessError, match="is not valid JSON"):
        RunResult.load(tmp_path)
    (tmp_path / "results.json").write_text(json.dumps({"arms": {}}))  # another tool's results (AUNN, ...)
    with pytest.raises(ForgetlessError, match="no protocol, preset, seeds, date, methods .*not the results of"):
        RunResult.load(tmp_path)
    broken = two_domain()
    del broken["methods"]["lora"]["total_params"]
    with pytest.raises(ForgetlessError, match="method entry 'lora' has no total_params"):
        RunResult.from_json(broken)


def test_compare_results_counts_the_values_and_finds_a_changed_metric(tmp_path, capsys):
    a, b = two_domain(), two_domain()
    b["methods"]["lora"].update(wall_s={"mean": 9.0, "std": 0.0}, peak_rss_mb=700.0)  # times, memory, date,
    b.update(date="2026-11-28", git_commit="f00", bases={"dense": {"path": "/other/base.safetensors",  # provenance
                                                                   "pretrain_wall_s": 4.0}})         # and paths differ
    compared, differ = compare_results.compare(a, b)
    assert differ == [] and compared == 12 + 2 * 7  # per arm: forgetting (2), method, 2 sizes, r, per_seed
    for name, results in (("a.json", a), ("b.json", b)):
        (tmp_path / name).write_text(json.dumps(results))
    assert compare_results.main([str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 0
    assert capsys.readouterr().out.startswith("26 values compared, 0 differ")
    b["methods"]["lora[r=4]"]["per_seed"]["0"]["forgetting"] = math.nextafter(0.1, 1)  # the next float
    b["precision"]["why"] = "auto"
    b["kind"] = "instructions"
    compared, differ = compare_results.compare(a, b)
    assert compared == 26 and differ == ["kind: only in B", "precision.why: A \"the preset's\", B 'auto'",
                                         "methods.lora[r=4].per_seed.0.forgetting: A 0.1, B 0.10000000000000002"]
    assert compare_results.compare(a, b, ("kind", "per_seed", "precision"))[1] == []
    (tmp_path / "b.json").write_text(json.dumps(b))
    assert compare_results.main([str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 1
    assert "3 differ" in capsys.readouterr().out
    nan = {"methods": {"x": {"fwt": {"mean": float("nan")}, "steps": 1}}}
    assert compare_results.compare(nan, json.loads(json.dumps(nan)))[1] == []  # NaN is the same NaN
    assert compare_results.compare(nan, {"methods": {"x": {"fwt": {"mean": float("nan")}, "steps": 1.0}}})[1] == [
        "methods.x.steps: A 1, B 1.0"]  # 1 and 1.0 are written differently: not the same
