import pytest

from forgetless.continual.instruct import metrics
from forgetless.continual.metrics import sequence_metrics
from forgetless.errors import ForgetlessError
from tiny_results import run_result


def test_sequence_metrics_by_hand():
    R = [[50, 10, 20],   # base
         [45, 60, 25],   # after task 1
         [40, 55, 70]]   # after task 2
    m = sequence_metrics(R)
    assert m["op"] == pytest.approx((40 + 55 + 70) / 3)
    assert m["bwt"] == pytest.approx(((40 - 50) + (55 - 60)) / 2)
    assert m["forgetting"] == pytest.approx(((50 - 40) + (60 - 55)) / 2)
    assert m["fwt"] == pytest.approx(25 - 20)  # task 2 before training it; task 1 has no earlier task
    assert m["la"] == pytest.approx((60 + 70) / 2) and m["bwt_drop"] == -m["bwt"]
    assert m["op_tasks"] == pytest.approx((55 + 70) / 2) and m["bwt_tasks"] == pytest.approx(55 - 60)
    assert m["bwt_drop_clipped"] == pytest.approx(60 - 55)


def test_clipped_drop_counts_gains_as_no_drop():
    """MoRAM's BWT column as a drop where gains do not cancel losses: task 1 drops 8, task 2 gains 5."""
    R = [[50, 10, 20, 30],
         [45, 60, 25, 31],
         [44, 52, 70, 33],
         [40, 52, 75, 80]]
    m = sequence_metrics(R)
    assert m["bwt_tasks"] == pytest.approx((-8 + 5) / 2) and m["bwt_drop_clipped"] == pytest.approx((8 + 0) / 2)


def test_task_columns_leave_general_ability_out():
    """Instruction streams: column 0 is general ability; bwt_tasks / forgetting_tasks / op_tasks cover
    tasks 1..T only (the TRACE / MoRAM columns), by hand."""
    R = [[50, 10, 20, 30],
         [45, 60, 25, 31],
         [44, 52, 70, 33],
         [40, 48, 66, 80]]
    m = metrics(R, [10.0, 11.0, 12.0, 12.5])
    assert m["bwt_tasks"] == pytest.approx(((48 - 60) + (66 - 70)) / 2)
    assert m["forgetting_tasks"] == pytest.approx(((60 - 48) + (70 - 66)) / 2)
    assert m["bwt"] == pytest.approx(((40 - 50) + (48 - 60) + (66 - 70)) / 3)
    assert m["op_tasks"] == pytest.approx((48 + 66 + 80) / 3) and m["general_ppl_change"] == pytest.approx(0.25)
    assert metrics([[50, 10], [45, 60]], [10.0, 11.0])["bwt_tasks"] is None  # one task: nothing learned before it


def test_no_forgetting_when_nothing_drops():
    R = [[1, 0], [1, 1]]
    assert sequence_metrics(R)["bwt"] == 0 and sequence_metrics(R)["forgetting"] == 0
    assert sequence_metrics(R)["fwt"] is None  # one task: nothing came before it


def test_fwt_counts_every_task_after_the_first():
    R = [[50, 10, 20, 30],
         [50, 60, 24, 33],
         [50, 60, 70, 36],
         [50, 60, 70, 80]]
    assert sequence_metrics(R)["fwt"] == pytest.approx(((24 - 20) + (36 - 30)) / 2)


def test_bad_matrix():
    with pytest.raises(ForgetlessError, match="square"):
        sequence_metrics([[1, 2]])
    with pytest.raises(ForgetlessError, match="square"):
        sequence_metrics([[1, 2], [3]])


def test_frontier_curves_and_operating_points():
    """A method run at several values of one option is a curve (its plain arm at the protocol's lr joins it);
    operating points pick the best arm under each limit, None when no arm qualifies."""
    from forgetless.report.frontier import curves, operating_points

    def arm(f, g, lr=None):
        return {"forgetting": {"mean": f, "std": 0.0}, "adaptation_gain": {"mean": g, "std": 0.0},
                "options": {"lr": lr}}
    arms = {"full": arm(0.20, 1.0), "full[lr=1e-4]": arm(0.04, 0.8), "full[lr=3e-5]": arm(0.01, 0.5),
            "lora": arm(0.015, 0.7, lr=1e-3)}
    config = {"adapt": {"lr": 3e-4, "mix": 0.0}}
    results = run_result("two-domain", arms, config=config)
    assert [(v, label) for v, label, _ in curves(results)["full, lr"]] == [
        ("3e-5", "full[lr=3e-5]"), ("1e-4", "full[lr=1e-4]"), ("3e-4", "full")]  # one label format
    grid = run_result("two-domain", {**arms, "adapter": arm(0.2, 0.8, lr=1e-3), "adapter[bottleneck=512]": arm(0.3, 1.0, lr=1e-3),
                                     "adapter[bottleneck=512;lr=3e-4]": arm(0.25, 0.9), "lora[r=4]": arm(0.01, 0.6),
                                     "lora[r=16]": arm(0.02, 0.8)}, config=config)
    found = curves(grid)  # arms sharing every other option make one lr curve; an r sweep joins the plain arm
    assert [label for _, label, _ in found["adapter[bottleneck=512], lr"]] == [
        "adapter[bottleneck=512;lr=3e-4]", "adapter[bottleneck=512]"]
    assert [(v, label) for v, label, _ in found["lora, r"]] == [("4", "lora[r=4]"), ("16", "lora[r=16]")]
    assert "adapter, bottleneck" not in found and "adapter, lr" not in found  # the plain adapter is one point
    points = operating_points(results)  # no validation numbers: chosen on the held-out ones
    held = {"chosen_on": "held-out"}
    assert points["full, lr"] == {"best_g_at_f_le_5": {"value": 0.8, "arm": "full[lr=1e-4]", "chosen_value": 0.8, **held},
                                  "best_g_at_f_le_2": {"value": 0.5, "arm": "full[lr=3e-5]", "chosen_value": 0.5, **held},
                                  "best_f_at_g_ge_0.9": {"value": 20.0, "arm": "full", "chosen_value": 20.0, **held}}
    assert points["lora"]["best_f_at_g_ge_0.9"] is None and points["lora"]["best_g_at_f_le_2"]["value"] == 0.7
    for label, (f_dev, g_dev) in {"full": (0.21, 1.0), "full[lr=1e-4]": (0.06, 0.85), "full[lr=3e-5]": (0.012, 0.55),
                                  "lora": (0.01, 0.7)}.items():
        results.methods[label].stats.update(forgetting_dev={"mean": f_dev, "std": 0.0},
                                         adaptation_gain_dev={"mean": g_dev, "std": 0.0})
    chosen = operating_points(results)["full, lr"]["best_g_at_f_le_5"]  # 1e-4 forgets 6 % on validation: not it
    assert chosen == {"value": 0.5, "arm": "full[lr=3e-5]", "chosen_value": 0.55, "chosen_on": "validation"}
    sequence = run_result("sequence", {"a": {"la": {"mean": 50.0}, "bwt": {"mean": -9.0}},
                                       "a[lr=1e-4]": {"la": {"mean": 49.5}, "bwt": {"mean": -4.0}},
                                       "b": {"la": {"mean": 40.0}, "bwt": {"mean": -1.0}}}, config={"adapt": {"lr": 1e-3}})
    seq_points = operating_points(sequence)
    assert seq_points["a, lr"]["best_bwt_at_matched_la"] == {"value": -4.0, "arm": "a[lr=1e-4]", "chosen_value": -4.0,
                                                             "chosen_on": "held-out"}
    assert seq_points["b"]["best_bwt_at_matched_la"] is None  # LA 10 points below the best: not matched


def test_matched_adaptation_reads_each_seeds_curve_and_pairs_them():
    """F at G = 0.9 along each seed's own lr curve (linear between the arms around it; past an end it extrapolates
    and says so); paired differences per seed; BWT at the best LA - 1 on a sequence."""
    from forgetless.report.frontier import matched, matched_markdown

    def arm(lr, g, f):  # per seed: adaptation gain, forgetting
        return {"options": {"lr": lr}, "per_seed": {str(s): {"adaptation_gain": g[s], "forgetting": f[s]} for s in (0, 1)}}
    arms = {"a[lr=1e-4]": arm(1e-4, (0.7, 0.8), (0.10, 0.12)), "a": arm(3e-4, (0.85, 0.95), (0.15, 0.18)),
            "a[lr=1e-3]": arm(1e-3, (1.0, 1.05), (0.25, 0.30)),
            "b": arm(3e-4, (0.6, 0.9), (0.05, 0.10)), "b[lr=1e-3]": arm(1e-3, (0.8, 1.0), (0.10, 0.20)),
            "c": arm(None, (0.5, 0.5), (0.0, 0.0))}  # one point: no curve to read
    config = {"adapt": {"lr": 3e-4, "mix": 0.0}}
    results = run_result("two-domain", arms, config=config)
    held = matched(results)["held_out"]
    assert held["at"] == 0.9 and set(held["curves"]) == {"a, lr", "b, lr"} and "validation" not in matched(results)
    a, b = held["curves"]["a, lr"], held["curves"]["b, lr"]
    assert a["values"] == pytest.approx({"0": 15 + 10 / 3, "1": 16.0}) and a["extrapolated"] == 0
    assert b["values"] == pytest.approx({"0": 12.5, "1": 10.0}) and b["extrapolated"] == 1  # seed 0 ends at G 0.8
    assert a["value"]["mean"] == pytest.approx((15 + 10 / 3 + 16) / 2)
    assert held["paired"]["a, lr − b, lr"]["mean"] == pytest.approx(((15 + 10 / 3 - 12.5) + 6) / 2)
    text = "\n".join(matched_markdown(results.with_keys(matched=matched(results))))
    assert b["beyond"] == pytest.approx({"0": 0.1})  # seed 0's curve ends 0.1 below G 0.9
    assert "F % read at G = 0.9 (held-out)" in text and "| b, lr | 11.25 (" in text and ") +1 |" in text
    assert "| a, lr − b, lr | +5.92 (" in text
    assert a["not_monotone"] == b["not_monotone"] == 0 and "!" not in text.split("\n\n")[-1]
    results = run_result("two-domain", {**arms, "b[lr=3e-3]": arm(3e-3, (0.7, 1.1), (0.5, 0.6))},  # seed 0's G falls
                         config=config)                                                             # again at 3e-3
    bent = matched(results)["held_out"]["curves"]["b, lr"]
    assert bent["not_monotone"] == 1 and ") +1 !1 |" in "\n".join(matched_markdown(results.with_keys(matched=matched(results))))
    sequence = run_result("sequence", {
        label: {"la": {"mean": sum(la) / 2}, "bwt": {"mean": sum(bwt) / 2},
                "per_seed": {str(s): {"la": la[s], "bwt": bwt[s]} for s in (0, 1)}}
        for label, la, bwt in [("m[lr=1e-4]", (40.0, 42.0), (-2.0, -3.0)), ("m", (50.0, 52.0), (-8.0, -10.0))]},
        config={"adapt": {"lr": 1e-3}})
    seq = matched(sequence)["held_out"]
    assert "LA = 50.00 (held-out)" in "\n".join(matched_markdown(sequence.with_keys(matched=matched(sequence))))
    assert seq["at"] == 50.0 and seq["curves"]["m, lr"]["values"] == pytest.approx({"0": -8.0, "1": -8.6})
    assert seq["curves"]["m, lr"]["extrapolated"] == 0 and seq["paired"] == {}


def test_seeds_text_counts_the_bases_the_seeds_used():
    """--seeds 3 --seed-start 3 --base-seeds 6 adapts bases 3-5: three bases, not six; seeds sharing a base say so."""
    from forgetless.report.tables import seeds_text
    assert seeds_text([3, 4, 5], 6).endswith("each seed on its own pretrained base: 3 bases, pretraining seeds [3, 4, 5])")
    assert "on 2 pretrained bases: seed s adapts base s mod 2" in seeds_text([0, 1, 2, 3], 2)
    assert seeds_text([0, 1], 1) == "seeds [0, 1] (mean ± std over adaptation seeds on one pretrained base)"


def test_a_sequence_of_one_task_has_no_frontier_and_its_report_says_so(tmp_path):
    """`bench --protocol sequence` with one task and --lrs: no BWT (nothing learned before the task), so no
    frontier, matched reading or frontier figure; results.md says why (it crashed in the frontier before)."""
    from forgetless.report import write_report
    results = run_result("sequence", {label: {"la": {"mean": la, "std": 0.0}, "bwt": {"mean": None, "std": None},
                                              "r_matrix": [[15.0, la], [15.0, la]],
                                              "per_seed": {"0": {"la": la, "bwt": None}}}
                                      for label, la in (("m[lr=1e-4]", 40.0), ("m", 50.0))},
                         config={"adapt": {"lr": 1e-3}}, tasks=["shakespeare-modern", "shakespeare-folio"],
                         score="next-token accuracy on held-out windows, %")
    files = write_report(results, tmp_path, figures=False)
    text = (tmp_path / "results.md").read_text()
    assert "No trade-off frontier: some arms have no bwt" in text and "frontier" not in results.extra
    assert tmp_path / "results.json" in files
