"""An OpenAI-compatible endpoint served by the explorer's engine (`endpoint_for`); each rollout
opens an episode (base URL .../e/EPISODE/v1, or an X-Episode-Id header) and closes it to get its
calls' tokens and log-probs."""

import asyncio
import concurrent.futures
import itertools
import json
import socket
import threading
import time
import uuid
import weakref
from dataclasses import dataclass, field

from extras.chat_tools import (
    RequestError,
    load_tool_parser,
    openai_tool_calls,
    parse_request,
    prompt_ids,
    reply_key,
    stream_events,
)

MAX_BODY_BYTES = 8 << 20
_ENDPOINTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_ENDPOINTS_LOCK = threading.Lock()


def require_packages(what: str) -> None:
    """ValueError (one line, naming the pip install) when fastapi, uvicorn or openai is missing."""
    import importlib.util

    missing = [p for p in ("fastapi", "uvicorn", "openai") if importlib.util.find_spec(p) is None]
    if missing:
        raise ValueError(f"{what} needs {', '.join(missing)}: pip install openai fastapi uvicorn")


@dataclass
class Choice:
    """One sampled completion: tokens [R], behaviour_logprobs [R], weight versions, finish_reason,
    text and logprob_floors [R] (engines.Completion's, None without a truncation)."""

    tokens: list[int]
    behaviour_logprobs: list[float]
    versions: tuple[int, int]
    finish_reason: str
    text: str
    logprob_floors: list[float] | None = None


@dataclass
class Call:
    """One delivered chat completion: `seq` (arrival order), `prompt` (the ids the engine saw),
    choices."""

    seq: int
    prompt: list[int]
    choices: list[Choice]


@dataclass
class Episode:
    """The calls of one agent rollout. `url`: the base URL to give its OpenAI client."""

    id: str
    url: str
    loop: asyncio.AbstractEventLoop
    sampling: object  # engines.Sampling
    parser: object  # text -> (content, calls)
    wait_s: float  # the longest its calls wait at the gate for the other episodes' (seconds)
    calls: list[Call] = field(default_factory=list)
    replies: dict[str, str] = field(default_factory=dict)  # reply_key -> the model's exact text
    closed: bool = False
    seq: itertools.count = field(default_factory=itertools.count)


class _Gate:
    """Holds the calls of one event loop until every open episode waits (or `wait_s` has passed)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.open, self.timer = loop, 0, None
        self.waiting: list[tuple[Episode, asyncio.Future]] = []

    async def passage(self, ep: Episode) -> None:
        fut = self.loop.create_future()
        self.waiting.append((ep, fut))
        self.check()
        if not fut.done() and self.timer is None:
            self.timer = self.loop.call_later(ep.wait_s, self.release)
        try:
            await fut
        except asyncio.CancelledError:
            self.waiting = [w for w in self.waiting if w[1] is not fut]
            raise

    def check(self) -> None:
        if self.waiting and len({id(ep) for ep, _ in self.waiting}) >= self.open:
            self.release()

    def release(self) -> None:
        waiting, self.waiting = self.waiting, []
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        for _, fut in waiting:
            if not fut.done():
                fut.set_result(None)

    def drop(self, ep: Episode) -> None:
        """An episode ended: its waiting calls are cancelled, the others may now pass."""
        self.open -= 1
        for e, fut in self.waiting:
            if e is ep:
                fut.cancel()
        self.waiting = [w for w in self.waiting if w[0] is not ep]
        self.check()


def context_length(engine) -> int | None:
    """The most tokens (prompt + completion) the engine's model takes, or None if unknown."""
    try:
        if getattr(engine, "llm", None) is not None:  # VLLMEngine
            return int(engine.llm.llm_engine.model_config.max_model_len)
        return int(engine.model.config.max_position_embeddings)  # HFEngine
    except (AttributeError, TypeError, ValueError):
        return None


class Endpoint:
    """The server of one engine on a free local port (`url`); ValueError (one line) without fastapi,
    uvicorn, openai."""

    def __init__(self, engine, batch_wait_s: float = 0.1):
        require_packages("the OpenAI-compatible endpoint")
        import uvicorn

        self.engine, self.batch_wait_s = engine, batch_wait_s
        self.max_len = context_length(engine)
        self._episodes: dict[str, Episode] = {}
        self._gates: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()
        # queued until the server thread accepts
        self._sock = socket.create_server(("127.0.0.1", 0), backlog=512)
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = uvicorn.Server(
            uvicorn.Config(
                self._app(),
                log_level="warning",
                access_log=False,
                lifespan="off",
                loop="asyncio",
                timeout_graceful_shutdown=2,
            )
        )
        self._thread = threading.Thread(
            target=self._server.run,
            kwargs={"sockets": [self._sock]},
            daemon=True,
            name=f"nanorft-endpoint-{self.port}",
        )
        self._thread.start()

    def open_episode(
        self, sampling, tool_parser: str = "hermes", batch_wait_s: float | None = None
    ) -> Episode:
        """Open an episode in the running event loop; tool_parser: a chat_tools.TOOL_PARSERS name or
        import path."""
        loop, eid = asyncio.get_running_loop(), uuid.uuid4().hex
        wait_s = self.batch_wait_s if batch_wait_s is None else batch_wait_s
        ep = Episode(
            eid, f"{self.url}/e/{eid}/v1", loop, sampling, load_tool_parser(tool_parser), wait_s
        )
        with self._lock:
            self._episodes[eid] = ep
            self._gates.setdefault(loop, _Gate(loop)).open += 1
        return ep

    def close_episode(self, ep: Episode) -> list[Call]:
        """End an episode (later calls get 404, running ones are not recorded); its calls in arrival
        order."""
        with self._lock:
            closing, ep.closed = not ep.closed, True
            self._episodes.pop(ep.id, None)
            gate = self._gates.get(ep.loop)
        if closing and gate is not None:
            gate.drop(ep)
        return sorted(ep.calls, key=lambda c: c.seq)

    def close(self) -> None:
        """Stop the server thread (within a few seconds) and free the port."""
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()

    async def _complete(self, ep: Episode, req) -> tuple[Call, dict]:
        """In the episode's loop: render, wait at the gate, sample, cut, parse."""
        tok, seq = self.engine.tokenizer, next(ep.seq)
        msgs = [
            {"role": "assistant", "content": ep.replies[key]}
            if m["role"] == "assistant"
            and (key := reply_key(m["content"], m["tool_calls"])) in ep.replies
            else m
            for m in req.messages
        ]
        prompt = prompt_ids(tok, msgs, req.tools)
        cap = ep.sampling.max_tokens
        if self.max_len is not None and len(prompt) + cap > self.max_len:
            raise RequestError(
                f"the prompt is {len(prompt)} tokens; with up to {cap} completion tokens that is "
                f"over the model's {self.max_len}"
            )
        with self._lock:
            if ep.closed:
                raise RequestError(f"episode {ep.id} is over", 404)
            gate = self._gates[ep.loop]
        await gate.passage(ep)
        outs = await self.engine.generate(prompt, req.n, ep.sampling)
        choices = [self._cut(out, req, tok) for out in outs]
        sampled = sum(len(c.tokens) for c in choices)
        body = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": req.model or "nanorft",
            "choices": [self._choice(i, c, req, ep, tok) for i, c in enumerate(choices)],
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": sampled,
                "total_tokens": len(prompt) + sampled,
            },
        }
        return Call(seq, prompt, choices), body

    @staticmethod
    def _cut(out, req, tok) -> Choice:
        """The completion cut at max_tokens, then after the token that completes its first stop
        string."""
        tokens, behaviour, reason = (
            list(out.tokens),
            list(out.behaviour_logprobs),
            out.finish_reason,
        )
        if req.max_tokens is not None and len(tokens) > req.max_tokens:
            tokens, behaviour, reason = (
                tokens[: req.max_tokens],
                behaviour[: req.max_tokens],
                "length",
            )
        text = tok.decode(tokens, skip_special_tokens=True)
        hits = [text.find(s) for s in req.stop if s in text]
        if hits:
            lo, hi = 1, len(tokens)  # the fewest tokens whose text holds a stop string
            while lo < hi:
                mid = (lo + hi) // 2
                part = tok.decode(tokens[:mid], skip_special_tokens=True)
                lo, hi = (lo, mid) if any(s in part for s in req.stop) else (mid + 1, hi)
            tokens, behaviour, reason, text = tokens[:lo], behaviour[:lo], "stop", text[: min(hits)]
        floors = getattr(out, "logprob_floors", None)  # cut as the tokens are
        floors = None if floors is None else list(floors[: len(tokens)])
        return Choice(tokens, behaviour, tuple(out.versions), reason, text, floors)

    def _choice(self, i: int, c: Choice, req, ep: Episode, tok) -> dict:
        # what the model wrote, stop string included
        raw = tok.decode(c.tokens, skip_special_tokens=True)
        content, calls = (
            (c.text, []) if not req.tools or req.tool_choice == "none" else ep.parser(c.text)
        )
        tool_calls = openai_tool_calls(calls)
        if tool_calls and c.finish_reason == "stop":
            c.finish_reason = "tool_calls"
        ep.replies[reply_key(content, tool_calls)] = raw
        message = {
            "role": "assistant",
            "content": content,
            **({"tool_calls": tool_calls} if tool_calls else {}),
        }
        choice = {
            "index": i,
            "message": message,
            "finish_reason": c.finish_reason,
            "logprobs": None,
        }
        if req.logprobs:
            pieces = [tok.decode([t]) for t in c.tokens]
            choice["logprobs"] = {
                "content": [
                    {"token": p, "logprob": lp, "bytes": list(p.encode()), "top_logprobs": []}
                    for p, lp in zip(pieces, c.behaviour_logprobs)
                ]
            }
        return choice

    def _app(self):
        """The FastAPI app: plain Starlette routes, no schema layer."""
        from fastapi import FastAPI
        from fastapi.responses import JSONResponse, Response

        app = FastAPI(title="nanorft endpoint", docs_url=None, redoc_url=None, openapi_url=None)
        error = lambda status, message: JSONResponse(  # noqa: E731 - OpenAI's error shape
            {
                "error": {
                    "message": message,
                    "type": "invalid_request_error" if status < 500 else "server_error",
                    "param": None,
                    "code": status,
                }
            },
            status_code=status,
        )
        models = {
            "object": "list",
            "data": [{"id": "nanorft", "object": "model", "created": 0, "owned_by": "nanorft"}],
        }

        async def list_models(request):
            return JSONResponse(models)

        async def chat(request):
            eid = request.path_params.get("eid") or request.headers.get("x-episode-id", "")
            try:
                req, body = await self._chat(request, eid)
                return (
                    Response(stream_events(body, req.stream_usage), media_type="text/event-stream")
                    if req.stream
                    else JSONResponse(body)
                )
            except RequestError as e:
                return error(e.status, str(e))
            except _Gone:
                return JSONResponse({}, status_code=499)  # the client went away: nobody reads this
            except Exception as e:  # an engine failure: this call fails, the server goes on
                return error(500, f"{type(e).__name__}: {e}")

        for prefix in ("", "/e/{eid}"):
            app.add_route(prefix + "/v1/models", list_models, methods=["GET"])
            app.add_route(prefix + "/v1/chat/completions", chat, methods=["POST"])
        return app

    async def _chat(self, request, eid: str) -> tuple:
        """(the checked request, the response body) of one call, recorded once delivered."""
        with self._lock:
            ep = self._episodes.get(eid)
        if ep is None:
            raise RequestError(
                f"no open episode {eid[:64]!r}: use the base URL a rollout was given "
                "(.../e/EPISODE/v1) or an X-Episode-Id header"
                if eid
                else "no episode: use the base URL a rollout was given (.../e/EPISODE/v1)",
                404,
            )
        req = parse_request(await _read_json(request))
        try:
            fut = asyncio.run_coroutine_threadsafe(self._complete(ep, req), ep.loop)
        except RuntimeError:  # its event loop is closed
            raise RequestError(f"episode {eid} is over", 409) from None
        try:
            call, body = await asyncio.wrap_future(fut)
        except (asyncio.CancelledError, concurrent.futures.CancelledError):
            if not fut.cancelled():
                raise
            raise RequestError(f"episode {eid} ended before this completion", 409) from None
        if await request.is_disconnected():
            raise _Gone()
        with self._lock:
            if ep.closed:
                raise RequestError(f"episode {eid} ended before this completion", 409)
            ep.calls.append(call)
        return req, body


class _Gone(Exception):
    """The client disconnected before its response."""


async def _read_json(request):
    """The request body as JSON: RequestError 413 past MAX_BODY_BYTES, 400 for bad JSON."""
    from starlette.requests import ClientDisconnect

    chunks, total = [], 0
    try:
        async for chunk in request.stream():
            total += len(chunk)
            if total > MAX_BODY_BYTES:
                raise RequestError(f"request body over {MAX_BODY_BYTES} bytes", 413)
            chunks.append(chunk)
    except ClientDisconnect:
        raise _Gone() from None
    try:
        return json.loads(b"".join(chunks))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"the request body is not JSON: {e}") from None


def endpoint_for(engine) -> Endpoint:
    """The endpoint of `engine`, started on first use; engine.close stops it too."""
    with _ENDPOINTS_LOCK:
        endpoint = _ENDPOINTS.get(engine)
        if endpoint is None:
            endpoint = _ENDPOINTS[engine] = Endpoint(engine)
            engine.on_close(lambda: stop_endpoint(engine))
    return endpoint


def stop_endpoint(engine) -> None:
    """Close the endpoint of `engine`, if it has one (Engine.close runs it)."""
    with _ENDPOINTS_LOCK:
        endpoint = _ENDPOINTS.pop(engine, None)
    if endpoint is not None:
        endpoint.close()
