"""The OpenAI-compatible side of `forgetless serve`: request bodies, stop strings, the response and
server-sent-event chunk shapes of /v1/completions and /v1/chat/completions, errors as
`{"error": {"message", "type", "param", "code"}}`, and the completions remembered for /v1/feedback."""
from __future__ import annotations

import collections
import json
import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

PATHS = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/feedback")
REMEMBERED = 1000  # completion ids /v1/feedback can correct (the latest)
ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error", 429: "rate_limit_error",
               503: "server_error"}


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Message(Strict):
    role: Literal["system", "user", "assistant"]
    content: str


class StreamOptions(Strict):
    include_usage: bool = False


class Sampling(Strict):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, lt=2 ** 64)
    n: int = Field(default=1, ge=1, le=8)
    stream: bool = False
    stream_options: StreamOptions | None = None

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return [s for s in stops if s][:4]


class CompletionIn(Sampling):
    prompt: str


class ChatIn(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


class FeedbackIn(Strict):
    id: str = Field(min_length=1, max_length=200)
    answer: str
    key: str | None = Field(default=None, min_length=1, max_length=200)


def error(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"), "param": param,
                      "code": None}}


def until_stop(pieces, stops: list[str], usage: dict):
    """The pieces of text, cut before the first of `stops` (then usage["finish_reason"] = "stop" and sampling
    ends); text that may begin a stop string is held back until it cannot."""
    held = ""
    hold = max(map(len, stops), default=1) - 1
    for piece in pieces:
        held += piece
        cut = min((i for i in (held.find(s) for s in stops) if i >= 0), default=-1)
        if cut >= 0:
            pieces.close()
            usage["finish_reason"] = "stop"
            if held[:cut]:
                yield held[:cut]
            return
        if len(held) > hold:
            yield held[:len(held) - hold]
            held = held[len(held) - hold:]
    if held:
        yield held


class Completions:
    """Shapes of one request's responses (`chat`: chat.completion, else text_completion) and chunks."""

    def __init__(self, chat: bool, model: str):
        self.chat, self.model = chat, model
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def head(self, choices: list[dict], chunk: bool, **extra) -> dict:
        kind = self.object + ".chunk" if chunk and self.chat else self.object  # completions' chunks: text_completion
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices,
                **extra}

    def choice(self, index: int, text: str, finish: str | None, stream: bool) -> dict:
        if not self.chat:
            return {"index": index, "text": text, "finish_reason": finish, "logprobs": None}
        body = ({"content": text} if text else {}) if stream else {"role": "assistant", "content": text}
        return {"index": index, "delta" if stream else "message": body, "finish_reason": finish}

    def response(self, texts: list[str], usages: list[dict]) -> dict:
        return self.head([self.choice(i, t, u["finish_reason"], False) for i, (t, u) in enumerate(zip(texts, usages))],
                         False, usage=total(usages))

    def chunk(self, index: int, text: str, finish: str | None = None) -> str:
        return sse(self.head([self.choice(index, text, finish, True)], True))

    def opening(self, index: int) -> str:
        """A chat stream's first chunk of a choice: the assistant's role."""
        return sse(self.head([{"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
                             True))

    def usage_chunk(self, usages: list[dict]) -> str:
        return sse(self.head([], True, usage=total(usages)))


def total(usages: list[dict]) -> dict:
    prompt, completion = usages[0]["prompt_tokens"], sum(u["completion_tokens"] for u in usages)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


class Remembered(collections.OrderedDict):
    """Completion id -> the document it starts ({"prompt"} or {"messages"}), the latest REMEMBERED."""

    def add(self, key: str, record: dict):
        self[key] = record
        while len(self) > REMEMBERED:
            self.popitem(last=False)
