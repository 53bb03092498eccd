"""Chat requests of the OpenAI-compatible endpoint: checked (`parse_request`), rendered
(`prompt_ids`), TOOL_PARSERS."""

import json
import math
import re
import uuid
from dataclasses import dataclass, field

MAX_N = 32  # completions per request
ROLES = {"system", "developer", "user", "assistant", "tool"}
UNSUPPORTED = {
    **dict.fromkeys(
        ("logit_bias", "presence_penalty", "frequency_penalty"),
        "it changes the sampling distribution",
    ),
    "top_logprobs": "logprobs true gives each sampled token's",
}  # field -> why it is refused
HERMES_TOOLS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>\n{tools}\n</tools>"
    "\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


class RequestError(ValueError):
    """A client's mistake: answered with HTTP `status` (4xx) and this message."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass
class ChatRequest:
    """A checked `POST /v1/chat/completions` body (max_tokens None: the endpoint's limit)."""

    messages: list[dict]
    tools: list[dict] = field(default_factory=list)
    n: int = 1
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    temperature: float | None = None
    top_p: float | None = None
    logprobs: bool = False
    tool_choice: str = "auto"
    model: str = ""
    stream: bool = False  # one server-sent event stream once the completion is done
    stream_usage: bool = False  # stream_options.include_usage


def parse_request(body) -> ChatRequest:
    """Check a decoded JSON body; RequestError (400) naming the first problem (one changing the
    sampling, say)."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    for key, why in UNSUPPORTED.items():
        if body.get(key) not in (None, False, 0, {}, 0.0):
            raise RequestError(f"{key} is not supported ({why})")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list")
    req = ChatRequest([_message(m, i) for i, m in enumerate(messages)], _tools(body.get("tools")))
    req.n = _number(body, "n", int, 1, MAX_N, 1)
    if key := next(
        (k for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None), None
    ):
        req.max_tokens = _number(body, key, int, 1, 1 << 30, None)
    req.temperature = _number(body, "temperature", float, 0.0, 2.0, None)
    req.top_p = _number(body, "top_p", float, 0.0, 1.0, None)
    req.logprobs = bool(body.get("logprobs") or False)
    req.stop = _stop(body.get("stop"))
    choice = body.get("tool_choice", "auto")
    if choice not in (None, "auto", "none"):
        raise RequestError(f"tool_choice {json.dumps(choice)[:80]} is not supported: auto or none")
    req.tool_choice = choice or "auto"
    req.model = str(body.get("model") or "")[:200]
    req.stream = bool(body.get("stream") or False)
    options = body.get("stream_options") or {}
    req.stream_usage = isinstance(options, dict) and bool(options.get("include_usage"))
    return req


def stream_events(body: dict, usage: bool) -> bytes:
    """A finished chat.completion `body` as the server-sent events of a streamed one."""
    head = {
        "id": body["id"],
        "object": "chat.completion.chunk",
        "created": body["created"],
        "model": body["model"],
    }
    chunks = []
    for c in body["choices"]:
        delta = {"role": "assistant", "content": c["message"]["content"]}
        if c["message"].get("tool_calls"):
            delta["tool_calls"] = [
                {"index": i, **t} for i, t in enumerate(c["message"]["tool_calls"])
            ]
        chunks.append(
            {
                **head,
                "choices": [
                    {
                        "index": c["index"],
                        "delta": delta,
                        "logprobs": c["logprobs"],
                        "finish_reason": None,
                    }
                ],
            }
        )
        chunks.append(
            {
                **head,
                "choices": [
                    {
                        "index": c["index"],
                        "delta": {},
                        "logprobs": None,
                        "finish_reason": c["finish_reason"],
                    }
                ],
            }
        )
    if usage:
        chunks.append({**head, "choices": [], "usage": body["usage"]})
    return (
        b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
    )


def _number(body: dict, key: str, kind: type, low, high, default):
    x = body.get(key)
    if x is None:
        return default
    ok = (
        isinstance(x, (int, float))
        and not isinstance(x, bool)
        and (kind is float or float(x).is_integer())
    )
    if not ok or not math.isfinite(x) or not low <= x <= high:
        raise RequestError(
            f"{key} must be {'an integer' if kind is int else 'a number'} from {low} to {high}, "
            f"got {json.dumps(x)[:80]}"
        )
    return kind(x)


def _stop(stop) -> list[str]:
    stops = [stop] if isinstance(stop, str) else stop or []
    if (
        not isinstance(stops, list)
        or len(stops) > 4
        or not all(isinstance(s, str) and s for s in stops)
    ):
        raise RequestError("stop must be a non-empty string or a list of at most 4 of them")
    return stops


def _text(content, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        if all(p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            return "".join(p["text"] for p in content)
        raise RequestError(f"{where}: only text content parts are supported")
    raise RequestError(f"{where}: content must be a string, a list of text parts or null")


def _message(m, i: int) -> dict:
    where = f"messages[{i}]"
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        raise RequestError(f"{where}: needs a role, one of {sorted(ROLES)}")
    role = "system" if m["role"] == "developer" else m["role"]
    out = {"role": role, "content": _text(m.get("content"), where)}
    if role == "assistant":
        out["tool_calls"] = [
            _tool_call(c, f"{where}.tool_calls[{j}]")
            for j, c in enumerate(m.get("tool_calls") or [])
        ]
        if not out["tool_calls"] and out["content"] is None:
            out["content"] = ""
    elif out["content"] is None:
        raise RequestError(f"{where}: a {role} message needs content")
    if role == "tool":
        out["tool_call_id"] = str(m.get("tool_call_id") or "")
    return out


def _tool_call(c, where: str) -> dict:
    fn = c.get("function") if isinstance(c, dict) else None
    if (
        not isinstance(fn, dict)
        or not isinstance(fn.get("name"), str)
        or not isinstance(fn.get("arguments", ""), str)
    ):
        raise RequestError(f"{where}: needs function.name and function.arguments (a JSON string)")
    return {
        "id": str(c.get("id") or ""),
        "type": "function",
        "function": {"name": fn["name"], "arguments": fn.get("arguments", "")},
    }


def _tools(tools) -> list[dict]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise RequestError("tools must be a list")
    for j, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if (
            t.get("type", "function") != "function"
            or not isinstance(fn, dict)
            or not isinstance(fn.get("name"), str)
        ):
            raise RequestError(f"tools[{j}]: needs type function and function.name")
        if not isinstance(fn.get("parameters", {}), dict):
            raise RequestError(f"tools[{j}]: function.parameters must be a JSON schema object")
    return tools


def _arguments(text: str):
    try:
        return json.loads(text) if text.strip() else {}
    except json.JSONDecodeError:
        return text


def hermes_messages(messages: list[dict], tools: list[dict]) -> list[dict]:
    """Messages for a template that knows no tools: schemas in the system message, Hermes-style tool
    text."""
    out = [dict(m) for m in messages]
    if tools:
        block = HERMES_TOOLS.format(
            tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        )
        if out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{block}" if out[0]["content"] else block
        else:
            out.insert(0, {"role": "system", "content": block})
    merged: list[dict] = []
    for m in out:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = "".join(
                "\n<tool_call>\n"
                + json.dumps(
                    {
                        "name": c["function"]["name"],
                        "arguments": _arguments(c["function"]["arguments"]),
                    },
                    ensure_ascii=False,
                )
                + "\n</tool_call>"
                for c in m["tool_calls"]
            )
            m = {"role": "assistant", "content": ((m["content"] or "") + calls).removeprefix("\n")}
        elif m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if merged and merged[-1].get("tool_results"):
                merged[-1]["content"] += "\n" + block
                continue
            m = {"role": "user", "content": block, "tool_results": True}
        merged.append({k: v for k, v in m.items() if k in ("role", "content", "tool_results")})
    return [{"role": m["role"], "content": m["content"]} for m in merged]


def native_messages(messages: list[dict]) -> list[dict]:
    """Messages for a template that knows tools: tool-call arguments as objects, null content as
    ''."""
    out = []
    for m in messages:
        m = {**m, "content": m["content"] or ""}
        if m.get("tool_calls"):
            m["tool_calls"] = [
                {
                    **c,
                    "function": {
                        "name": c["function"]["name"],
                        "arguments": _arguments(c["function"]["arguments"]),
                    },
                }
                for c in m["tool_calls"]
            ]
        elif "tool_calls" in m:
            del m["tool_calls"]
        out.append(m)
    return out


def prompt_ids(tokenizer, messages: list[dict], tools: list[dict]) -> list[int]:
    """Token ids of `messages` and `tools` under the chat template; RequestError when the template
    refuses them."""
    template = tokenizer.chat_template  # one that mentions tools renders them itself
    native = "tool_use" in template if isinstance(template, dict) else "tools" in (template or "")
    msgs = native_messages(messages) if native else hermes_messages(messages, tools)
    try:
        ids = tokenizer.apply_chat_template(
            msgs,
            tools=(tools or None) if native else None,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
    except Exception as e:  # jinja2's TemplateError and whatever a template raises on odd input
        raise RequestError(
            f"the model's chat template refused the messages: {type(e).__name__}: {e}"
        ) from None
    return list(ids)


def hermes_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """(content or None when only calls remain, calls) of Hermes/Qwen `<tool_call>{...}</tool_call>`
    blocks."""
    calls, kept, last = [], [], 0
    for m in _TOOL_CALL.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except json.JSONDecodeError:
            continue
        if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)):
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        calls.append(
            {"name": obj["name"], "arguments": args if isinstance(args, (dict, list, str)) else {}}
        )
        kept.append(text[last : m.start()])
        last = m.end()
    if not calls:
        return text, []
    content = ("".join(kept) + text[last:]).strip()
    return content or None, calls


TOOL_PARSERS = {"hermes": hermes_tool_calls}


def load_tool_parser(name: str):
    """A parser from TOOL_PARSERS or `module.function`; ValueError (one line) otherwise."""
    from losses import resolve

    return resolve(name, TOOL_PARSERS, "tool parser")


def openai_tool_calls(calls: list[dict]) -> list[dict]:
    """Parsed calls as the response's `tool_calls` (arguments as a JSON string, fresh ids)."""
    return [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {
                "name": c["name"],
                "arguments": c["arguments"]
                if isinstance(c["arguments"], str)
                else json.dumps(c["arguments"], ensure_ascii=False),
            },
        }
        for c in calls
    ]


def reply_key(content: str | None, tool_calls: list[dict]) -> str:
    """What identifies an assistant message the endpoint returned when a client sends it back."""
    return json.dumps(
        [
            content or "",
            [
                (c.get("id", ""), c["function"]["name"], c["function"]["arguments"])
                for c in tool_calls
            ],
        ]
    )
