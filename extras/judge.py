"""An LLM as judge: `ask_judge` (also the pipelines' ratings) and `--reward-fn judge`
(`judge_reward`)."""

import json
from typing import Any

from workflows import Task, chat_ids

_JUDGES: dict = {}
RATINGS = ("1", "2", "3", "4", "5")


def ask_judge(
    messages: list[dict],
    choices: tuple[str, ...],
    model: str = "",
    url: str = "",
    timeout_s: float = 60.0,
) -> list[float]:
    """The judge's probability of starting its reply with each of `choices`: a local model directory
    `model` (softmax of its next-token logits) or an OpenAI-compatible endpoint `url` (1.0 for its
    greedy reply's); else ValueError."""
    if url:
        import urllib.request

        body = json.dumps(
            {"model": model, "messages": messages, "max_tokens": 4, "temperature": 0}
        ).encode()
        req = urllib.request.Request(
            url.rstrip("/") + "/chat/completions", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            reply = json.loads(r.read())["choices"][0]["message"]["content"].strip().lower()
        return [float(reply.startswith(c.lower())) for c in choices]
    if not model:
        raise ValueError(
            "a judge needs a local model directory (model) or an OpenAI-compatible endpoint (url)"
        )
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if model not in _JUDGES:
        tok = AutoTokenizer.from_pretrained(model)
        _JUDGES[model] = (
            tok,
            AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval(),
        )
    tok, lm = _JUDGES[model]
    ids = torch.tensor([chat_ids(tok, messages, True)])
    with torch.no_grad():
        logits = lm(input_ids=ids).logits[0, -1]  # [vocab]
    first = [tok.encode(c, add_special_tokens=False)[0] for c in choices]
    return torch.softmax(logits[first].float(), -1).tolist()


def judge_reward(
    task: Task,
    completion: str,
    dataset: Any,
    model: str = "",
    url: str = "",
    timeout_s: float = 60.0,
) -> float:
    """The judge's P("yes") / (P("yes") + P("no")) that the completion is correct; ValueError
    without `model`/`url`."""
    question = (
        f"Question: {task.question}\nReference answer: {task.answer}\n"
        f"Student answer: {completion}\n"
        "Is the student answer correct? Reply with yes or no."
    )
    if not (model or url):
        raise ValueError("judge reward needs reward_kwargs model (a local model directory) or url")
    return ask_judge([{"role": "user", "content": question}], ("yes", "no"), model, url, timeout_s)[
        0
    ]


def expected_rating(p: list[float]) -> float:
    """The mean of 1..5 under probabilities `p` (normalised); 3.0 when they are all 0."""
    total = sum(p)
    return sum((i + 1) * x for i, x in enumerate(p)) / total if total else 3.0
