"""The OpenAI-compatible HTTP API over an :class:`~leapfx.serve.engine.Engine` (FastAPI).

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (the
tokenizer's chat template), ``GET /health``. ``stream: true`` answers with server-sent events
(``data: {chunk}`` ... ``data: [DONE]``); every answer carries ``usage`` and leapfx's own
``leapfx`` field (drafts verified and kept, acceptance, tokens/s of the request's decode).

What maps: ``max_tokens`` / ``max_completion_tokens``, ``temperature`` (0: greedy; default 1,
as OpenAI), ``top_p``, ``stop`` (a string or up to 4: the text is cut before the first and
the row stops), ``seed`` (a generator a request), ``n`` = 1, ``frequency_penalty`` and
``presence_penalty`` = 0, ``stream``, ``stream_options.include_usage``, ``user``. Anything
else non-null (``logprobs``, ``tools``, ``response_format``, ...) is refused with a 400 that
names it, as are out-of-range values; errors are OpenAI's body,
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..runtime.decode import decode_request
from .engine import Engine, Job, QueueFull, Stopping

log = logging.getLogger(__name__)

# accepted fields: (their check) -- anything else non-null is refused by name
COMMON = {"model", "max_tokens", "temperature", "top_p", "stop", "seed", "n", "stream",
          "stream_options", "frequency_penalty", "presence_penalty", "user"}  # fmt: skip
CHAT = COMMON | {"messages", "max_completion_tokens"}
COMPLETION = COMMON | {"prompt"}


class ApiError(Exception):
    """An OpenAI-style error: HTTP ``status`` and the body's message, type, param, code."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = (
            status, message, param, kind, code
        )  # fmt: skip

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}  # fmt: skip


@dataclass
class Parsed:
    """A checked request: its prompt ids, decode request and what the answer needs."""

    prompt: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    stop: list[str]
    seed: int | None
    stream: bool
    include_usage: bool


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise ApiError(400, f"{name}: {value!r} is invalid; allowed: a number in [{low}, {high}]",
                       name)  # fmt: skip
    return float(value)


def parse(body: Any, fields: set[str], tokenizer, engine: Engine, model_name: str) -> Parsed:
    """Check an OpenAI request body (chat when ``messages`` is among ``fields``) and build its
    prompt; raises :class:`ApiError` naming the first field that is wrong."""
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    chat = "messages" in fields
    for name, value in body.items():
        if name not in fields and value is not None:
            raise ApiError(400, f"{name}: not supported by leapfx serve; allowed fields: "
                           f"{', '.join(sorted(fields))}", name)  # fmt: skip
    model = body.get("model")
    if model is not None and model != model_name:
        raise ApiError(404, f"model: {model!r} does not exist; allowed: {model_name!r}", "model",
                       code="model_not_found")  # fmt: skip
    n = body.get("n")
    if n is not None and n != 1:
        raise ApiError(400, f"n: {n!r} is not supported; allowed: 1", "n")
    for name in ("frequency_penalty", "presence_penalty"):
        value = body.get(name)
        if value not in (None, 0, 0.0):
            raise ApiError(400, f"{name}: {value!r} is not supported; allowed: 0", name)
    if chat:
        messages = body.get("messages")
        ok = isinstance(messages, list) and messages and all(
            isinstance(m, dict) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str) for m in messages
        )  # fmt: skip
        if not ok:
            raise ApiError(400, "messages: must be a non-empty list of {role, content} with "
                           "string content", "messages")  # fmt: skip
        if getattr(tokenizer, "chat_template", None) is None:
            raise ApiError(400, "messages: this model has no chat template; allowed: "
                           "/v1/completions", "messages")  # fmt: skip
        conversation = [{"role": m["role"], "content": m["content"]} for m in messages]
        prompt = tokenizer.apply_chat_template(conversation, add_generation_prompt=True,
                                               tokenize=True)  # fmt: skip
        if isinstance(prompt, dict) or hasattr(prompt, "keys"):
            prompt = prompt["input_ids"]
        prompt = list(prompt)
    else:
        text = body.get("prompt")
        if isinstance(text, list) and len(text) == 1 and isinstance(text[0], str):
            text = text[0]
        if not isinstance(text, str) or not text:
            raise ApiError(400, "prompt: must be a non-empty string", "prompt")
        prompt = tokenizer(text)["input_ids"]
    room = engine.room(len(prompt))
    if room < 1:
        raise ApiError(
            400,
            f"the prompt's {len(prompt)} tokens leave no room in the server's "
            f"{engine.max_len} positions (--max-len)",
            "messages" if chat else "prompt",
        )
    names = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    max_tokens, param = None, "max_tokens"
    for name in names:
        if body.get(name) is not None:
            max_tokens, param = body[name], name
            break
    if max_tokens is None:
        max_tokens = min(room, 512)
    whole = isinstance(max_tokens, int) and not isinstance(max_tokens, bool)
    if not whole or not 1 <= max_tokens <= room:
        raise ApiError(400, f"{param}: {max_tokens!r} is invalid; allowed: an int in [1, {room}] "
                       "for this prompt", param)  # fmt: skip
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    strings = isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)
    if not strings or len(stop) > 4:
        raise ApiError(400, f"stop: {stop!r} is invalid; allowed: a string or up to 4", "stop")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ApiError(400, f"seed: {seed!r} is invalid; allowed: an int", "seed")
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise ApiError(400, f"stream: {stream!r} is invalid; allowed: true or false", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise ApiError(400, f"stream_options: {options!r} is invalid; allowed: "
                       "{include_usage: bool}", "stream_options")  # fmt: skip
    return Parsed(
        prompt=prompt, max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0), stop=stop, seed=seed, stream=stream,
        include_usage=bool(options.get("include_usage")),
    )  # fmt: skip


class Detokenizer:
    """The text of a growing list of token ids, decoded a window at a time: each ``push``
    decodes the tokens since the last text it gave out together with the group before them
    (the context a tokenizer's leading-space and byte-merging rules read) and hands out what
    the new ones add, so an answer of n tokens costs O(n) to detokenize, not O(n^2). Text that
    ends inside a multi-byte character waits for the tokens that finish it (``flush`` gives it
    out at the end). What it hands out, joined, is ``decode(ids, skip_special_tokens=True)``."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # the window's first token (context, already handed out)
        self.read = 0  # tokens before this one are handed out

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, ids: list[int]) -> str:
        """The text ``ids`` add ("" while a multi-byte character is unfinished)."""
        self.ids.extend(ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """What is left, an unfinished character's replacement included."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        before = self._decode(self.ids[self.prefix : self.read])
        after = self._decode(self.ids[self.prefix :])
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before) :]


class Answer:
    """One request's answer as it decodes: its text so far (incrementally detokenized, cut at
    a stop string), its finish reason, and the asyncio queue the engine's thread feeds."""

    def __init__(self, parsed: Parsed, tokenizer, loop: asyncio.AbstractEventLoop) -> None:
        self.parsed, self.tokenizer, self.loop = parsed, tokenizer, loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.tokens: list[int] = []
        self.detokenizer = Detokenizer(tokenizer)
        self.text = ""
        self.sent = 0  # characters already handed out
        self.finish: str | None = None
        self.job: Job | None = None

    # engine thread
    def on_tokens(self, tokens: list[int]) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, ("tokens", tokens))

    def on_end(self, error: BaseException | None) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, ("end", error))

    # event loop
    def add(self, tokens: list[int], eos: frozenset[int]) -> str:
        """The new text ``tokens`` add (held back while a stop string may be starting)."""
        self.tokens.extend(tokens)
        return self._extend(self.detokenizer.push([t for t in tokens if t not in eos]))

    def _extend(self, added: str) -> str:
        if self.finish is not None:
            return ""
        longest = max(map(len, self.parsed.stop), default=0)
        searched = max(0, len(self.text) - longest + 1)  # a stop string ending in the new text
        self.text += added
        for s in self.parsed.stop:
            at = self.text.find(s, searched)
            if at >= 0:
                self.text, self.finish = self.text[:at], "stop"
        hold = 0
        if self.finish is None:  # a stop string's beginning at the end: not yet out
            for s in self.parsed.stop:
                for k in range(min(len(s) - 1, len(self.text)), 0, -1):
                    if self.text.endswith(s[:k]):
                        hold = max(hold, k)
                        break
        new = self.text[self.sent : len(self.text) - hold]
        self.sent += len(new)
        return new

    def rest(self) -> str:
        """The text not yet handed out, at the end of the answer."""
        self._extend(self.detokenizer.flush())
        new = self.text[self.sent :]
        self.sent = len(self.text)
        return new

    def finish_reason(self, eos: frozenset[int]) -> str:
        if self.finish is not None:
            return self.finish
        if self.tokens and self.tokens[-1] in eos:
            return "stop"
        return "length" if len(self.tokens) >= self.parsed.max_tokens else "stop"


def create_app(sm, tokenizer, *, model_name: str, engine: Engine | None = None, **engine_kw):
    """The FastAPI app serving ``sm`` (its tokenizer ``tokenizer``) as ``model_name``; its
    :class:`Engine` (``engine_kw``: ``max_batch``, ``max_queue``, ``max_len``) starts with the
    app and stops (finishing what is in flight) when it shuts down."""
    from contextlib import asynccontextmanager

    engine = engine or Engine(sm, **engine_kw)
    config = sm._hf_model.generation_config
    eos = decode_request(config, 0, max_new_tokens=1, eos_token_id=None, sampling={},
                         generator=None).eos_token_ids  # fmt: skip
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        await asyncio.get_running_loop().run_in_executor(None, engine.stop)

    app = FastAPI(title="leapfx serve", lifespan=lifespan)
    app.state.engine = engine

    def error(e: ApiError) -> JSONResponse:
        headers = {"Retry-After": "1"} if e.status == 429 else None
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(Exception)
    async def internal(request, exc):  # an unexpected fault: a 500 body, logged
        log.exception("request failed")
        return error(ApiError(500, f"internal error: {exc}", kind="server_error"))

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_name, "recipe": sm.recipe.name, **engine.stats()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model",
                                            "created": created, "owned_by": "leapfx"}]}  # fmt: skip

    async def serve(request: Request, chat: bool):
        try:
            try:
                body = json.loads(await request.body())
            except (ValueError, UnicodeDecodeError) as e:
                raise ApiError(400, f"the body is not valid JSON: {e}") from None
            parsed = parse(body, CHAT if chat else COMPLETION, tokenizer, engine, model_name)
            answer = Answer(parsed, tokenizer, asyncio.get_running_loop())
            generator = None
            if parsed.seed is not None:
                generator = torch.Generator().manual_seed(parsed.seed)
            do_sample = parsed.temperature > 0
            sampling = {"do_sample": do_sample}
            if do_sample:
                sampling.update(temperature=parsed.temperature, top_p=parsed.top_p)
            decode = decode_request(
                config, len(parsed.prompt), max_new_tokens=parsed.max_tokens, eos_token_id=None,
                sampling=sampling, generator=generator,
            )  # fmt: skip
            prompt = torch.tensor([parsed.prompt], device=sm._layout.device)
            job = Job(prompt, decode, answer.on_tokens, answer.on_end)
            answer.job = job
            try:
                engine.submit(job)
            except QueueFull as e:
                raise ApiError(429, f"the server is busy: {e}; retry later",
                               kind="rate_limit_error") from None  # fmt: skip
            except Stopping as e:
                raise ApiError(503, str(e), kind="server_error") from None
        except ApiError as e:
            return error(e)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        if parsed.stream:
            return StreamingResponse(
                _events(answer, engine, eos, rid, chat, model_name, created),
                media_type="text/event-stream",
            )
        return await _whole(answer, engine, eos, rid, chat, model_name, created)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await serve(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serve(request, chat=False)

    return app


def _usage(answer: Answer) -> dict:
    job = answer.job
    seconds = max(time.perf_counter() - job.admitted, 1e-9) if job.admitted else None
    n = len(answer.tokens)
    return {
        "prompt_tokens": len(answer.parsed.prompt), "completion_tokens": n,
        "total_tokens": len(answer.parsed.prompt) + n,
        "leapfx": {
            "drafted": job.drafted, "kept": job.kept,
            "acceptance": job.kept / job.drafted if job.drafted else None,
            "tokens_per_second": n / seconds if seconds else None,
        },
    }  # fmt: skip


async def _next(answer: Answer, engine: Engine, eos) -> tuple[str, str | None, Exception | None]:
    """Wait for the engine: (new text, finish reason or None, error or None)."""
    kind, value = await answer.queue.get()
    if kind == "end":
        if value is not None:
            return "", "error", value
        return answer.rest(), answer.finish_reason(eos), None
    new = answer.add(value, eos)
    if answer.finish is not None:  # a stop string: the row stops here
        engine.cancel(answer.job.index)
        return new, "stop", None
    return new, None, None


async def _whole(answer, engine, eos, rid, chat, model_name, created):
    text, finish = "", None
    while finish is None:
        new, finish, err = await _next(answer, engine, eos)
        text += new
    if finish == "error":
        log.error("request %s failed: %s", rid, err)
        return JSONResponse(ApiError(500, f"decoding failed: {err}", kind="server_error").body(),
                            status_code=500)  # fmt: skip
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "finish_reason": finish, "logprobs": None}  # fmt: skip
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        obj = "text_completion"
    return JSONResponse({"id": rid, "object": obj, "created": created, "model": model_name,
                         "choices": [choice], "usage": _usage(answer)})  # fmt: skip


async def _events(answer, engine, eos, rid, chat, model_name, created):
    """The SSE stream of one answer; a client that leaves cancels its row."""
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(text: str | None, finish: str | None, first: bool = False, usage=None) -> str:
        if chat:
            delta = {"role": "assistant", "content": text or ""} if first else (
                {"content": text} if text else {})  # fmt: skip
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
        body = {"id": rid, "object": obj, "created": created, "model": model_name,
                "choices": [choice]}  # fmt: skip
        if usage is not None:
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n"

    finished = False
    try:
        if chat:
            yield chunk("", None, first=True)
        while True:
            new, finish, err = await _next(answer, engine, eos)
            if finish == "error":
                log.error("request %s failed: %s", rid, err)
                body = ApiError(500, f"decoding failed: {err}", kind="server_error").body()
                yield f"data: {json.dumps(body)}\n\n"
                finished = True
                return
            if new:
                yield chunk(new, None)
            if finish is not None:
                break
        finished = True
        yield chunk(None, finish)
        if answer.parsed.include_usage:
            body = {"id": rid, "object": obj, "created": created, "model": model_name,
                    "choices": [], "usage": _usage(answer)}  # fmt: skip
            yield f"data: {json.dumps(body)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        if not finished and answer.job is not None:  # the client left mid-stream
            engine.cancel(answer.job.index)
