import pytest

from forgetless.continual.instruct import metrics
from forgetless.continual.metrics import sequence_metrics
from forgetless.errors import ForgetlessError


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
