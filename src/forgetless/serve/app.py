"""The HTTP API of `forgetless serve` (FastAPI): score, generate (streamed), learn (bearer token), metrics
(Prometheus text), stats (JSON) and the dashboard page that draws them, health, snapshot, rollback. Bad
input gets a 4xx with a one-line reason, as JSON `{"error": "..."}`."""
from __future__ import annotations

import collections
import hmac
import math
import threading
import time
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException

from forgetless.errors import ForgetlessError
from forgetless.serve.engine import Engine

DASHBOARD = Path(__file__).with_name("dashboard.html")


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextIn(Strict):
    text: str


class GenerateIn(Strict):
    prompt: str
    max_tokens: int = Field(default=64, ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    seed: int = 0


class Refused(Exception):
    def __init__(self, status: int, reason: str, headers: dict | None = None):
        self.status, self.reason, self.headers = status, reason, headers


def make_app(engine: Engine, token: str | None) -> FastAPI:
    """The app around `engine`; `token` guards /v1/learn, /v1/snapshot and /v1/rollback (None: they are refused)."""
    app = FastAPI(title="forgetless serve", docs_url=None, redoc_url=None)
    recent: collections.deque = collections.deque()  # times of accepted /v1/learn calls in the last minute
    rate_lock = threading.Lock()

    def refuse(status: int, reason: str, count: str | None = None, headers: dict | None = None):
        if count:
            engine.rejected[count] = engine.rejected.get(count, 0) + 1
        raise Refused(status, reason, headers)

    def authorize(request: Request, what: str):
        if token is None:
            refuse(403, f"{what} is disabled: start the server with --token-file FILE or FORGETLESS_SERVE_TOKEN set",
                   "auth")
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            refuse(401, f"{what} needs the header 'Authorization: Bearer <token>' with the server's token", "auth",
                   {"WWW-Authenticate": "Bearer"})

    def checked(text: str, what: str, counted: bool = False) -> str:
        """`text` when it is neither empty nor over the size limit (refusals of /v1/learn are counted)."""
        if not text.strip():
            refuse(422, f"{what} is empty; send some text", "empty" if counted else None)
        if len(text.encode()) > engine.cfg.max_doc_bytes:
            refuse(413, f"{what} has {len(text.encode())} bytes, more than the limit of {engine.cfg.max_doc_bytes} "
                        "(--serve-max-doc-bytes); split it", "oversize" if counted else None)
        return text

    def rate_limit():
        limit = engine.cfg.learn_per_minute
        with rate_lock:
            now = time.monotonic()
            while recent and now - recent[0] > 60:
                recent.popleft()
            if limit and len(recent) >= limit:
                wait = math.ceil(60 - (now - recent[0]))
                refuse(429, f"rate limit: at most {limit} documents per minute; retry in {wait} s", "rate",
                       {"Retry-After": str(wait)})
            recent.append(now)

    @app.exception_handler(Refused)
    async def refused(request: Request, e: Refused):
        return JSONResponse({"error": e.reason}, e.status, headers=e.headers)

    @app.exception_handler(ForgetlessError)
    async def bad_input(request: Request, e: ForgetlessError):
        return JSONResponse({"error": str(e)}, 422)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError):
        return JSONResponse({"error": validation_reason(e.errors())}, 400 if is_body_error(e.errors()) else 422)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        reason = "the body is not valid UTF-8 JSON" if e.status_code == 400 else str(e.detail)
        return JSONResponse({"error": reason}, e.status_code, headers=getattr(e, "headers", None))

    @app.get("/v1/health")
    def health():
        return {"status": "ok", "method": engine.cfg.method, "seq": engine.seq, "updates": engine.learner.steps,
                "serving": engine.serving[0], "snapshot_seq": engine.snapshot_seq}

    @app.post("/v1/score")
    def score(body: TextIn):
        return engine.score(checked(body.text, "text"))

    @app.post("/v1/generate")
    def generate(body: GenerateIn):
        pieces = engine.generate(checked(body.prompt, "prompt"), body.max_tokens, body.temperature, body.seed)
        first = next(pieces, "")  # bad input fails here, before the stream starts
        return StreamingResponse(chain(first, pieces), media_type="text/plain; charset=utf-8")

    @app.post("/v1/learn")
    def learn(body: TextIn, request: Request):
        authorize(request, "learning")
        text = checked(body.text, "text", counted=True)
        rate_limit()
        return engine.learn(text)

    @app.post("/v1/snapshot")
    def snapshot(request: Request):
        authorize(request, "a snapshot")
        return engine.snapshot()

    @app.post("/v1/rollback")
    def rollback(request: Request):
        authorize(request, "a rollback")
        return engine.manual_rollback()

    @app.get("/v1/metrics")
    def metrics():
        return PlainTextResponse(prometheus(engine.metrics()), media_type="text/plain; version=0.0.4")

    @app.get("/v1/stats")
    def stats():
        return JSONResponse(finite(engine.stats()))

    page = DASHBOARD.read_text()

    @app.get("/", response_class=HTMLResponse)
    def dashboard():
        return page

    return app


def chain(first: str, rest):
    yield first
    yield from rest


def is_body_error(errors: list) -> bool:
    return any(e.get("type") in ("json_invalid", "model_attributes_type", "dict_type") for e in errors)


def validation_reason(errors: list) -> str:
    """One line from pydantic's errors, in words: a body that is not JSON, then unknown fields, then the rest."""
    rank = {"json_invalid": 0, "extra_forbidden": 1}
    e = min(errors, key=lambda err: rank.get(err.get("type"), 2))
    field = ".".join(str(p) for p in e.get("loc", ()) if p != "body")
    kind = e.get("type", "")
    if kind == "json_invalid":
        return "the body is not valid UTF-8 JSON"
    if kind == "extra_forbidden":
        return f"unknown field {field!r}; send only the documented fields"
    if kind == "missing":
        return f"missing field {field!r}" if field else "missing JSON body"
    return f"{field or 'body'}: {e.get('msg', 'invalid')}"


def finite(value):
    """`value` with every NaN or infinite float as None (JSON has no NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    return value


def number(value) -> str:
    if isinstance(value, float):
        return "NaN" if math.isnan(value) else repr(value)
    return str(value)


def prometheus(metrics: dict) -> str:
    """Prometheus text exposition format 0.0.4."""
    lines = []
    for name, (kind, text, value) in metrics.items():
        name = f"forgetless_{name}"
        lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
        if isinstance(value, dict):
            lines += [f'{name}{{reason="{k}"}} {number(v)}' for k, v in sorted(value.items())] or [f"{name} 0"]
        else:
            lines.append(f"{name} {number(value)}")
    return "\n".join(lines) + "\n"
