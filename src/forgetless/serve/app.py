"""The HTTP API of `forgetless serve` (FastAPI): score, generate (streamed), learn (bearer token), metrics
(Prometheus text), stats (JSON) and the dashboard page that draws them, health, snapshot, rollback (to the last
good state or a kept one), states (the kept ones), publish (the last good state as a versioned adapter or merged
model: serve/publish.py). Bad
input gets a 4xx with a one-line reason, as JSON `{"error": "..."}`: the token is checked before the body
is read, and the body is capped while it is read, before it is parsed.

- **Reads never wait on learning.** Learn, snapshot and rollback run one at a time on the learner's own thread
  (`Learner`), at most `max_queued` waiting (more: 503 + Retry-After), so they never hold the request threads;
  health, metrics, states and stats run on the event loop and take no lock.
- **Private.** Every request must name an allowed Host (`Guard`: the localhost names by default, against DNS
  rebinding) and every POST body must be JSON (Content-Type application/json: a cross-origin form or text/plain
  POST is refused 415 before it reaches a route)."""
from __future__ import annotations

import asyncio
import collections
import contextlib
import hmac
import json
import math
import re
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException

from forgetless.errors import ForgetlessError
from forgetless.serve import compat
from forgetless.serve.compat import ChatIn, CompletionIn, Completions, FeedbackIn, Message, Remembered, until_stop
from forgetless.serve.engine import Engine, KeyReused, Screened
from forgetless.serve.wal import Unavailable

DASHBOARD = Path(__file__).with_name("dashboard.html")
MIN_TOKEN = 16  # characters
LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")


def load_token(token_file: Path | None, environment: str) -> str | None:
    """The bearer token of the learning endpoints: the one line of `token_file` (readable by its owner only,
    UTF-8), else `environment` ($FORGETLESS_SERVE_TOKEN); None (learning off) when neither is given."""
    if token_file is None:
        where, token = "$FORGETLESS_SERVE_TOKEN", environment.strip()
        if not token:
            return None
    else:
        where = f"--token-file {token_file}"
        if not token_file.is_file():
            raise ForgetlessError(f"{where} does not exist; write the token into it")
        if token_file.stat().st_mode & 0o077:
            raise ForgetlessError(f"{where} can be read by other users (mode {token_file.stat().st_mode & 0o777:o}); "
                                  f"run chmod 600 {token_file}")
        try:
            token = token_file.read_bytes().decode().strip()
        except UnicodeDecodeError:
            raise ForgetlessError(f"{where} is not UTF-8 text; write the token alone on one line") from None
        if not token:
            raise ForgetlessError(f"{where} is empty; write the token into it (or leave --token-file out to serve "
                                  "without learning)")
        if "\n" in token or "\r" in token:
            raise ForgetlessError(f"{where} holds more than one line; write the token alone on one line")
    if not re.fullmatch(r"[\x21-\x7e]+", token):
        raise ForgetlessError(f"{where}: the token must be printable ASCII without spaces (it is sent in a header)")
    if len(token) < MIN_TOKEN:
        raise ForgetlessError(f"{where}: the token has {len(token)} characters, fewer than {MIN_TOKEN}; make a "
                              "longer one, e.g. python -c 'import secrets; print(secrets.token_urlsafe())'")
    return token



class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextIn(Strict):
    text: str


class LearnIn(Strict):
    """One document: {"text"}, {"prompt", "answer"} (or "completion") or {"messages": [...]}."""
    text: str | None = None
    prompt: str | None = None
    answer: str | None = None
    completion: str | None = None
    messages: list[Message] | None = None
    key: str | None = Field(default=None, min_length=1, max_length=200)

    def document(self) -> tuple[str, str]:
        """(format, text): the text, or the record's JSON."""
        answer = self.answer if self.answer is not None else self.completion
        given = [name for name, v in (("text", self.text), ("prompt", self.prompt), ("messages", self.messages)) if
                 v is not None]
        forms = "{\"text\"}, {\"prompt\", \"answer\"} or {\"messages\": [...]}"
        if not given and answer is None:
            raise Refused(422, f"missing field 'text'; send one document: {forms}")
        if len(given) != 1 or (self.prompt is None) != (answer is None) or self.answer is not None and self.completion:
            raise Refused(422, f"send one document, not parts of several: {forms}")
        if self.text is not None:
            return "text", self.text
        if self.prompt is not None:
            return "prompt", record({"prompt": self.prompt, "answer": answer})
        return "chat", record({"messages": [m.model_dump() for m in self.messages]})


def record(fields: dict) -> str:
    return json.dumps(fields, ensure_ascii=False, sort_keys=True)


class GenerateIn(Strict):
    prompt: str
    max_tokens: int = Field(default=64, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, allow_inf_nan=False)
    seed: int = Field(default=0, ge=0, lt=2 ** 64)


class RollbackIn(Strict):
    seq: int | None = Field(default=None, ge=0, lt=2 ** 63)


class Refused(Exception):
    def __init__(self, status: int, reason: str, headers: dict | None = None):
        self.status, self.reason, self.headers = status, reason, headers


def host_name(header: str) -> str:
    """The name in a Host header, without its port, lower case: "[::1]:8000" -> "::1"."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].partition("]")[0]
    return header.rpartition(":")[0] if header.count(":") == 1 else header.rstrip(".")


def is_json(content_type: str) -> bool:
    kind = content_type.partition(";")[0].strip().lower()
    return kind == "application/json" or kind.startswith("application/") and kind.endswith("+json")


class Guard:
    """ASGI middleware: a request whose Host is not in `allowed` ("*": any) is refused 400; a POST with a body
    that is not declared JSON is refused 415; both before any route runs."""

    def __init__(self, app, allowed: tuple[str, ...]):
        self.app, self.allowed = app, {host_name(h) for h in allowed}

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
            name, error = host_name(headers.get("host", "")), None
            if "*" not in self.allowed and name not in self.allowed:
                error = (400, f"Host {name!r} is not served here (allowed: {', '.join(sorted(self.allowed))}); start "
                              "the server with --allowed-hosts naming it")
            elif scope["method"] == "POST" and not is_json(headers.get("content-type", "")) and (
                    headers.get("content-length", "0") not in ("", "0") or "transfer-encoding" in headers):
                error = (415, f"the body must be JSON (Content-Type: application/json), not "
                              f"{headers.get('content-type') or 'undeclared'}")
            if error:
                return await JSONResponse(shaped(scope["path"], *error), error[0])(scope, receive, send)
        await self.app(scope, receive, send)


class Learner:
    """One thread that runs learn, snapshot and rollback in turn, with at most `bound` waiting: more are refused
    503 with Retry-After, so a burst of large learns never holds the request threads."""

    def __init__(self, bound: int):
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="forgetless-learner")
        self.bound, self.waiting, self.lock = bound, 0, threading.Lock()

    async def run(self, fn, *args):
        with self.lock:
            if self.waiting >= self.bound:
                raise Refused(503, f"the learner is busy ({self.waiting} requests waiting, the most "
                                   "--serve-max-queued allows); retry later", {"Retry-After": "2"})
            self.waiting += 1
        try:
            return await asyncio.wrap_future(self.pool.submit(fn, *args))
        finally:
            with self.lock:
                self.waiting -= 1


def shaped(path: str, status: int, message: str) -> dict:
    """An error body: OpenAI's shape on the OpenAI-compatible paths, else {"error": message}."""
    return compat.error(status, message) if path in compat.PATHS else {"error": message}


def make_app(engine: Engine, token: str | None, allowed_hosts: tuple[str, ...] = LOCAL_HOSTS,
             model_name: str = "forgetless") -> FastAPI:
    """The app around `engine`; `token` guards /v1/learn, /v1/feedback, /v1/snapshot, /v1/rollback and /v1/publish
    (None: they are refused); requests must name one of `allowed_hosts` in their Host header ("*": any). The OpenAI-compatible
    endpoints serve the model as `model_name`."""
    app = FastAPI(title="forgetless serve", docs_url=None, redoc_url=None)
    app.add_middleware(Guard, allowed=tuple(allowed_hosts))
    learner = Learner(engine.cfg.max_queued)
    recent: collections.deque = collections.deque()  # times of accepted /v1/learn calls in the last minute
    rate_lock = threading.Lock()
    body_limit = 6 * engine.cfg.max_doc_bytes + 1024  # the largest document, every byte escaped (\u00XX), and fields

    def refuse(status: int, reason: str, count: str | None = None, headers: dict | None = None):
        if count:
            engine.rejected[count] = engine.rejected.get(count, 0) + 1
        raise Refused(status, reason, headers)

    def authorize(request: Request, what: str):
        if token is None:
            refuse(403, f"{what} is disabled: start the server with --token-file FILE or FORGETLESS_SERVE_TOKEN set",
                   "auth")
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip(" ").encode(), token.encode()):
            refuse(401, f"{what} needs the header 'Authorization: Bearer <token>' with the server's token", "auth",
                   {"WWW-Authenticate": "Bearer"})

    async def parsed(request: Request, model: type[Strict], counted: bool = False, optional: bool = False):
        """The body as `model`, refused (413) as soon as more than the body limit has been read (`optional`: an
        empty body is the model's defaults)."""
        declared, body = request.headers.get("content-length", ""), bytearray()
        if not (declared.isdigit() and int(declared) > body_limit):
            async for chunk in request.stream():
                body += chunk
                if len(body) > body_limit:
                    break
        if len(body) > body_limit or declared.isdigit() and int(declared) > body_limit:
            refuse(413, f"the body is over {body_limit} bytes (6 x --serve-max-doc-bytes + 1 KiB); send a smaller "
                        "document", "oversize" if counted else None)
        if optional and not body.strip():
            return model()
        try:
            return model.model_validate_json(bytes(body))
        except ValidationError as e:
            refuse(400 if is_body_error(e.errors()) else 422, validation_reason(e.errors()))

    def checked(text: str, what: str, counted: bool = False) -> str:
        """`text` when it is neither empty nor over the size limit (refusals of /v1/learn are counted)."""
        if not text.strip():
            refuse(422, f"{what} is empty; send some text", "empty" if counted else None)
        if len(text.encode()) > engine.cfg.max_doc_bytes:
            refuse(413, f"{what} has {len(text.encode())} bytes, more than the limit of {engine.cfg.max_doc_bytes} "
                        "(--serve-max-doc-bytes); split it", "oversize" if counted else None)
        return text

    @contextlib.contextmanager
    def rate_slot():
        """One of the minute's `learn_per_minute` slots, given back when the document is refused after all."""
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
        try:
            yield
        except Exception:
            with rate_lock:
                if now in recent:
                    recent.remove(now)
            raise

    @app.exception_handler(Refused)
    async def refused(request: Request, e: Refused):
        return JSONResponse(shaped(request.url.path, e.status, e.reason), e.status, headers=e.headers)

    @app.exception_handler(Unavailable)
    async def unavailable(request: Request, e: Unavailable):
        engine.rejected["unavailable"] = engine.rejected.get("unavailable", 0) + 1
        return JSONResponse(shaped(request.url.path, 503, str(e)), 503, headers={"Retry-After": "60"})

    @app.exception_handler(ForgetlessError)
    async def bad_input(request: Request, e: ForgetlessError):
        status = 409 if isinstance(e, KeyReused) else 422
        reason = {"reason": e.reason} if isinstance(e, Screened) else {}  # the screen's refusals name their rule
        return JSONResponse({**shaped(request.url.path, status, str(e)), **reason}, status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        return JSONResponse(shaped(request.url.path, e.status_code, str(e.detail)), e.status_code,
                            headers=getattr(e, "headers", None))

    # ---- reads: on the event loop, no lock ---------------------------------------------------------
    @app.get("/v1/health")
    async def health():
        return {"status": "ok", "method": engine.cfg.method, "seq": engine.seq, "updates": engine.learner.steps,
                "serving": engine.serving[0], "snapshot_seq": engine.snapshot_seq, "learning": engine.learning(),
                "queued": learner.waiting, **({"recovered": engine.recovered} if engine.recovered else {})}

    @app.get("/v1/states")
    async def states():
        return JSONResponse(finite(engine.states()))

    @app.get("/v1/metrics")
    async def metrics():
        return PlainTextResponse(prometheus(engine.metrics()), media_type="text/plain; version=0.0.4")

    @app.get("/v1/stats")
    async def stats():
        return JSONResponse(finite(engine.stats()))

    page = DASHBOARD.read_text()

    @app.get("/", response_class=HTMLResponse)
    async def dashboard():
        return page

    # ---- the model: scoring and generation (request threads) -------------------------------------

    @app.post("/v1/score")
    async def score(request: Request):
        body = await parsed(request, TextIn)
        return await run_in_threadpool(engine.score, checked(body.text, "text"))

    @app.post("/v1/generate")
    async def generate(request: Request):
        body = await parsed(request, GenerateIn)
        pieces = engine.generate(checked(body.prompt, "prompt"), body.max_tokens, body.temperature, body.seed)
        first = await run_in_threadpool(next, pieces, "")  # bad input fails here, before the stream starts
        return StreamingResponse(chain(first, pieces), media_type="text/plain; charset=utf-8")

    # ---- learning: the learner's thread, bounded queue ---------------------------------------------
    @app.post("/v1/learn")
    async def learn(request: Request):
        authorize(request, "learning")  # before the body is read
        body = await parsed(request, LearnIn, counted=True)
        form, text = body.document()
        return await learned(text, body.key, form)

    async def learned(text: str, key: str | None, form: str) -> dict:
        text = checked(text, "text" if form == "text" else "the document", counted=True)
        with rate_slot():
            return await learner.run(engine.learn, text, key, form)

    @app.post("/v1/feedback")
    async def feedback(request: Request):
        authorize(request, "feedback")
        body = await parsed(request, FeedbackIn, counted=True)
        start = remembered.get(body.id)
        if start is None:
            refuse(404, f"completion {body.id!r} is not among the last {compat.REMEMBERED} served since the server "
                        "started; send the document to /v1/learn instead")
        if "messages" in start:
            form, doc = "chat", {"messages": [*start["messages"], {"role": "assistant", "content": body.answer}]}
        else:
            form, doc = "prompt", {**start, "answer": body.answer}
        return await learned(record(doc), body.key, form)

    # ---- OpenAI-compatible reads: the same generation, requests threads ----------------------------
    remembered = Remembered()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(engine.started),
                                            "owned_by": "forgetless"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await parsed(request, CompletionIn)
        return await complete(body, checked(body.prompt, "prompt"), {"prompt": body.prompt}, body.max_tokens or 16)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await parsed(request, ChatIn)
        messages = [m.model_dump() for m in body.messages]
        try:
            ids = await run_in_threadpool(engine.chat_prompt, messages)
        except ForgetlessError as e:  # no chat template, or one that refuses these messages
            refuse(400, str(e))
        return await complete(body, ids, {"messages": messages},
                              body.max_completion_tokens or body.max_tokens or engine.cfg.max_new_tokens)

    async def complete(body, prompt, start: dict, max_tokens: int):
        """The n choices of one request, whole or streamed; its id is remembered for /v1/feedback."""
        if body.model not in (None, model_name):
            refuse(404, f"model {body.model!r} is not served here; GET /v1/models names {model_name!r}")
        shapes, seed = Completions("messages" in start, model_name), body.seed
        if seed is None:
            seed = secrets.randbits(63)
        remembered.add(shapes.id, start)
        usages = [{} for _ in range(body.n)]

        def choice(i: int):
            pieces = engine.generate(prompt, max_tokens, body.temperature, (seed + i) % 2 ** 64, body.top_p,
                                     usages[i])
            return until_stop(pieces, body.stops(), usages[i])

        if not body.stream:
            texts = await run_in_threadpool(lambda: ["".join(choice(i)) for i in range(body.n)])
            return shapes.response(texts, usages)

        def events():
            for i in range(body.n):
                if shapes.chat:
                    yield shapes.opening(i)
                for piece in choice(i):
                    yield shapes.chunk(i, piece)
                yield shapes.chunk(i, "", usages[i]["finish_reason"])
            if body.stream_options and body.stream_options.include_usage:
                yield shapes.usage_chunk(usages)
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.post("/v1/snapshot")
    async def snapshot(request: Request):
        authorize(request, "a snapshot")
        return await learner.run(engine.snapshot)

    @app.post("/v1/publish")
    async def publish(request: Request):
        authorize(request, "publishing")
        await parsed(request, Strict, optional=True)  # no fields: an empty body or {}
        return await learner.run(engine.release, model_name)

    @app.post("/v1/rollback")
    async def rollback(request: Request):
        authorize(request, "a rollback")
        body = await parsed(request, RollbackIn, optional=True)
        return await learner.run(engine.manual_rollback, body.seq)

    return app


def chain(first: str, rest):
    yield first
    yield from rest


def is_body_error(errors: list) -> bool:
    return any(e.get("type") in ("json_invalid", "model_type") for e in errors)


def validation_reason(errors: list) -> str:
    """One line from pydantic's errors, in words: a body that is not JSON, then unknown fields, then the rest."""
    rank = {"json_invalid": 0, "extra_forbidden": 1}
    e = min(errors, key=lambda err: rank.get(err.get("type"), 2))
    field = ".".join(str(p) for p in e.get("loc", ()) if p != "body")
    kind = e.get("type", "")
    if kind == "json_invalid":
        detail = e.get("msg", "").removeprefix("Invalid JSON: ")
        hint = "; a \\ud800-\\udfff escape must be half of a surrogate pair" if "hex escape" in detail else ""
        return f"the body is not valid UTF-8 JSON ({detail}){hint}"
    if kind == "model_type":
        return "the body is not a JSON object; send {\"field\": value, ...}"
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
