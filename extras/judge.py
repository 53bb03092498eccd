"""An LLM as judge: `ask_judge` (a local model's next-token probabilities over the choices,
or an OpenAI-compatible endpoint's reply) and `--reward-fn judge` (`judge_reward`,
registered in workflows.REWARD_FNS by import path); pipelines' difficulty ratings use
ask_judge too.
"""
from __future__ import annotations

import json
from typing import Any

from workflows import Task, chat_ids


_JUDGES: dict = {}


def ask_judge(messages: list[dict], choices: tuple[str, ...], model: str = "", url: str = "",
              timeout_s: float = 60.0) -> list[float]:
    """The judge's probability of starting its reply with each of `choices` (strings whose
    first token differs): for a local Hugging Face model directory `model` (loaded once per
    process), the softmax of the next-token logits over the choices' first tokens; for an
    OpenAI-compatible endpoint `url` (POST {url}/chat/completions with `model`, greedy),
    1.0 for the choice its reply starts with (case ignored) and 0.0 for the others (all 0.0
    when none matches). Raises ValueError without `model` or `url`; the endpoint's errors
    propagate."""
    if url:
        import urllib.request

        body = json.dumps({"model": model, "messages": messages, "max_tokens": 4, "temperature": 0}).encode()
        req = urllib.request.Request(url.rstrip("/") + "/chat/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            reply = json.loads(r.read())["choices"][0]["message"]["content"].strip().lower()
        return [float(reply.startswith(c.lower())) for c in choices]
    if not model:
        raise ValueError("a judge needs a local model directory (model) or an OpenAI-compatible endpoint (url)")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if model not in _JUDGES:
        tok = AutoTokenizer.from_pretrained(model)
        _JUDGES[model] = tok, AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    tok, lm = _JUDGES[model]
    ids = torch.tensor([chat_ids(tok, messages, True)])
    with torch.no_grad():
        logits = lm(input_ids=ids).logits[0, -1]                                     # [vocab]
    first = [tok.encode(c, add_special_tokens=False)[0] for c in choices]
    return torch.softmax(logits[first].float(), -1).tolist()


def judge_reward(task: Task, completion: str, dataset: Any, model: str = "", url: str = "",
                 timeout_s: float = 60.0) -> float:
    """LLM-as-judge reward in [0, 1]: asks a second model (`ask_judge`) whether the
    completion answers the task correctly (reference answer given) and returns
    P("yes") / (P("yes") + P("no")) for a local model directory `model`, or 1.0 / 0.0 from
    the reply of an OpenAI-compatible endpoint `url`. Raises ValueError without either;
    errors of the endpoint propagate (the workflow scores 0 and counts a reward error)."""
    question = (f"Question: {task.question}\nReference answer: {task.answer}\nStudent answer: {completion}\n"
                "Is the student answer correct? Reply with yes or no.")
    if not (model or url):
        raise ValueError("judge reward needs reward_kwargs model (a local model directory) or url")
    return ask_judge([{"role": "user", "content": question}], ("yes", "no"), model, url, timeout_s)[0]


RATINGS = ("1", "2", "3", "4", "5")


def expected_rating(p: list[float]) -> float:
    """The mean of 1..5 under probabilities `p` (normalised); 3.0 when they are all 0."""
    total = sum(p)
    return sum((i + 1) * x for i, x in enumerate(p)) / total if total else 3.0
