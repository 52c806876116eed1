"""`forgetless serve`: a model that keeps learning from accepted documents while it serves (docs/DESIGN.md §3.6).

`engine.py` holds the model, the learner, the guardrails and the durable state; `app.py` the HTTP API
(FastAPI, the optional `serve` extra); `wal.py` the write-ahead log."""
