"""Named instruction-task streams in the orders the field runs them, and how `forgetless study STREAM` runs
them (continual/study.py): its lr grid and the rule that picks an lr from the grid (its default arms: the
study protocol's `default_methods`).

`standard`: the standard CL benchmark of O-LoRA's paper (Wang et al., 2023) in its three orders; the field
reports its average accuracy over the three. `trace`: TRACE's short-answer tasks in one order. The task
names are cl500 folders (data/instructions.py); a stream can also be written out: task specs separated by
commas, orders by ';' (e.g. `a.jsonl,b.jsonl;b.jsonl,a.jsonl`).
"""
from __future__ import annotations

from forgetless.errors import ForgetlessError

STREAMS: dict[str, dict[str, list[str]]] = {
    "standard": {"1": ["dbpedia", "amazon", "yahoo", "agnews"],
                 "2": ["dbpedia", "amazon", "agnews", "yahoo"],
                 "3": ["yahoo", "amazon", "agnews", "dbpedia"]},
    "trace": {"1": ["FOMC", "ScienceQA", "NumGLUE-cm", "NumGLUE-ds"]},
}
# a task never trained on, scored after every task (general classification ability): none of the stream's own
HELD_OUT = {"standard": ["FOMC"], "trace": ["dbpedia"]}

DEFAULT_GRID = "x1/3,x1,x3"  # each method's own lr times 1/3, 1 and 3: the same budget for every method
EDGE_STEPS = 2  # grid points a study adds beyond an end of the grid its best point sits at, at most, per end
LR_RULE = ("the grid point with the highest validation OP (mean over the tasks of their validation-row scores after "
           "the last task of order 1, one seed); ties (equal within 1e-9) go to the lower lr; while that point is at "
           f"an end of the grid, one more point is run a grid step beyond that end (up to {EDGE_STEPS} per end), so "
           "that the choice is inside the grid where it can be")


def stream_orders(stream: str) -> dict[str, list[str]]:
    """Order name -> its tasks in training order: a named stream's, or those written out in `stream`."""
    if stream in STREAMS:
        return STREAMS[stream]
    if "," not in stream:
        raise ForgetlessError(f"unknown stream {stream!r}; valid: {', '.join(STREAMS)}, or task specs separated "
                              "by commas (orders by ';'), e.g. dbpedia,agnews")
    orders = {str(k): [t.strip() for t in order.split(",") if t.strip()]
              for k, order in enumerate(stream.split(";"), start=1)}
    if any(len(tasks) != len(set(tasks)) or len(tasks) < 2 for tasks in orders.values()) or \
            len({frozenset(tasks) for tasks in orders.values()}) > 1:
        raise ForgetlessError(f"stream {stream!r}: every order must hold the same tasks (at least 2), each once")
    return orders


def pick_orders(stream: str, orders: str | None) -> dict[str, list[str]]:
    """The orders named in `orders` ('1,2,3'; None: all of the stream's), in the stream's order."""
    every = stream_orders(stream)
    if orders is None:
        return dict(every)
    wanted = [o.strip() for o in orders.split(",") if o.strip()]
    unknown = [o for o in wanted if o not in every]
    if unknown or not wanted:
        raise ForgetlessError(f"stream {stream} has order{'s' if len(every) > 1 else ''} {', '.join(every)}; "
                              f"got --orders {orders!r}")
    return {k: v for k, v in every.items() if k in wanted}
