"""Tasks, reward functions and workflows: what the explorer runs for each task.

A `Task` is one question with its reference answer. A `Workflow` turns a task into a
group of rollouts: it builds the prompt, asks the engine for `n` samples and scores each
one. The training reward and the held-out accuracy both come from `Workflow.score`, so
they cannot drift apart (nanochat's rule).

Task sources:
  - a reasoning-gym generator: `task = "basic_arithmetic"` with `task_kwargs`; train and
    held-out sets are drawn with different seeds; held-out questions that also occur in
    the train set are dropped (so the held-out set can be smaller than eval_size). The reward is the dataset's own `score_answer`.
  - a JSONL file: `task = "path/to/tasks.jsonl"`, one `{"question": ..., "answer": ...}`
    per line; the last `eval_size` rows are held out. The reward is exact match.

Add a scenario by subclassing `Workflow` and adding it to `WORKFLOWS`.
"""
from __future__ import annotations

import importlib
import json
import re
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from buffer import Experience


@dataclass
class Task:
    """One question. `entry` is the raw reasoning-gym entry (or JSONL row) the verifier needs."""

    task_id: str
    question: str
    answer: str
    entry: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------- sources

def load_tasks(name: str, kwargs: dict, train_size: int, eval_size: int, seed: int) -> tuple[list[Task], list[Task], Any]:
    """Return (train tasks, held-out tasks, verifier dataset or None).

    Raises ValueError for an unknown reasoning-gym dataset, bad kwargs, or a malformed
    JSONL row (the message names the file and line); FileNotFoundError for a missing file.
    """
    if name.endswith(".jsonl"):
        tasks = _read_jsonl_tasks(Path(name))
        if len(tasks) <= eval_size:
            raise ValueError(f"{name}: {len(tasks)} rows, need more than eval_size={eval_size}")
        return tasks[:-eval_size], tasks[-eval_size:], None
    import reasoning_gym

    try:
        train_ds = reasoning_gym.create_dataset(name, size=train_size, seed=seed, **kwargs)
        # draw extra candidates: small task spaces repeat questions, and repeats are dropped
        eval_ds = reasoning_gym.create_dataset(name, size=4 * eval_size + 1, seed=seed + 1_000_003, **kwargs)
    except Exception as e:  # reasoning-gym raises several types for bad names/kwargs
        raise ValueError(f"reasoning-gym dataset {name!r} with {kwargs}: {e}") from None
    train = [Task(f"{name}/train/{i}", x["question"], str(x["answer"]), x) for i, x in enumerate(train_ds)]
    seen = {t.question for t in train}
    held = [Task(f"{name}/eval/{i}", x["question"], str(x["answer"]), x)
            for i, x in enumerate(eval_ds) if x["question"] not in seen]
    return train, held[:eval_size], train_ds


def _read_jsonl_tasks(path: Path) -> list[Task]:
    if not path.is_file():
        raise FileNotFoundError(f"task file not found: {path}")
    tasks = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} line {i}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict) or "question" not in row or "answer" not in row:
            raise ValueError(f"{path} line {i}: needs 'question' and 'answer' fields")
        tasks.append(Task(str(row.get("id", f"{path.stem}/{i}")), str(row["question"]), str(row["answer"]), row))
    return tasks


def _jsonl_rows(path: str | Path, what: str):
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} not found: {path}")
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                yield path, n, json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} line {n}: not valid JSON ({e.msg})") from None


def _template(tokenizer, messages: list[dict], generation_prompt: bool) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt,
                                              tokenize=True, return_dict=False))


def _is_messages(msgs) -> bool:
    return isinstance(msgs, list) and all(isinstance(m, dict) and {"role", "content"} <= set(m) for m in msgs)


def load_chat_jsonl(path: str | Path, tokenizer) -> list[list[Experience]]:
    """SFT / expert data: one {"messages": [{"role", "content"}, ...]} per line -> one group
    of one Experience per conversation, tokenised with the chat template, action_mask 1
    exactly on the assistant turns' tokens (each turn = template(messages[:i+1]) minus
    template(messages[:i], generation prompt)), reward 1.0, logprobs 0 (no behaviour
    policy), info["expert"]. Raises FileNotFoundError, or ValueError naming the file and
    line (bad JSON, no assistant turn, or turns that are not token prefixes of each other)."""
    out = []
    for path, n, row in _jsonl_rows(path, "chat data"):
        msgs = row.get("messages") if isinstance(row, dict) else None
        if not _is_messages(msgs):
            raise ValueError(f'{path} line {n}: needs {{"messages": [{{"role": ..., "content": ...}}, ...]}}')
        tokens, mask = [], []
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            prompt, full = _template(tokenizer, msgs[:i], True), _template(tokenizer, msgs[: i + 1], False)
            if prompt[: len(tokens)] != tokens or full[: len(prompt)] != prompt:
                raise ValueError(f"{path} line {n}: chat template output is not a token prefix across turns")
            mask += [0] * (len(prompt) - len(tokens)) + [1] * (len(full) - len(prompt))
            tokens = full
        if 1 not in mask:
            raise ValueError(f"{path} line {n}: no assistant message")
        p = mask.index(1)
        out.append([Experience(tokens, p, [0.0] * (len(tokens) - p), mask[p:], 1.0, f"{path.stem}/{n}",
                               f"{path.stem}/{n}", 0, {"expert": True})])
    return out


def load_preference_jsonl(path: str | Path, tokenizer) -> list[list[Experience]]:
    """DPO data: one {"prompt": str or messages, "chosen": str, "rejected": str} per line ->
    one group of two Experiences (chosen reward 1.0, rejected 0.0) sharing the templated
    prompt; the response is the assistant reply plus the template's end of turn. Raises
    FileNotFoundError or ValueError naming the file and line."""
    out = []
    for path, n, row in _jsonl_rows(path, "preference data"):
        if not (isinstance(row, dict) and {"prompt", "chosen", "rejected"} <= set(row)):
            raise ValueError(f"{path} line {n}: needs prompt, chosen and rejected fields")
        msgs = [{"role": "user", "content": row["prompt"]}] if isinstance(row["prompt"], str) else row["prompt"]
        if not _is_messages(msgs):
            raise ValueError(f"{path} line {n}: prompt must be a string or a list of messages")
        prompt = _template(tokenizer, msgs, True)
        group = []
        for key, reward in (("chosen", 1.0), ("rejected", 0.0)):
            full = _template(tokenizer, msgs + [{"role": "assistant", "content": str(row[key])}], False)
            if full[: len(prompt)] != prompt or len(full) == len(prompt):
                raise ValueError(f"{path} line {n}: chat template output is not a token prefix of the {key} reply")
            r = len(full) - len(prompt)
            group.append(Experience(full, len(prompt), [0.0] * r, [1] * r, reward, f"{path.stem}/{n}",
                                    f"{path.stem}/{n}", 0, {"expert": True, "preference": key}))
        out.append(group)
    return out


def load_offline_jsonl(path: str | Path, tokenizer) -> list[list[Experience]]:
    """Chat data (`load_chat_jsonl`) or preference pairs (`load_preference_jsonl`),
    told apart by the first row's fields."""
    first = next(_jsonl_rows(path, "offline data"), (None, None, {}))[2]
    pairs = isinstance(first, dict) and "chosen" in first
    return (load_preference_jsonl if pairs else load_chat_jsonl)(path, tokenizer)


# ----------------------------------------------------------------------------- rewards

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def last_number(text: str) -> str | None:
    """The last number in `text` ("-12", "3.5"), or None. Trailing ".0" is dropped."""
    found = _NUMBER.findall(text.replace(",", ""))
    if not found:
        return None
    x = found[-1]
    return x[:-2] if x.endswith(".0") else x


def reasoning_gym_reward(task: Task, completion: str, dataset: Any) -> float:
    """Reward in [0, 1]: the dataset's `score_answer` on the last number of the completion
    (exact match for JSONL tasks, where `dataset` is None)."""
    answer = last_number(completion)
    if dataset is None:
        return float(answer is not None and answer == last_number(task.answer))
    return float(dataset.score_answer(answer, task.entry))


def load_reward_fn(path: str) -> Callable[[Task, str, Any], float]:
    """`"reasoning_gym"` or an import path `"module.function"` with the same signature."""
    if path == "reasoning_gym":
        return reasoning_gym_reward
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"reward_fn {path!r} cannot be imported: {e}") from None


# ----------------------------------------------------------------------------- workflows

class Workflow:
    """Base class: turn one task into a group of Experiences.

    Subclasses implement `async run(task, engine, n)`; they call
    `await engine.generate(prompt_ids, n, sampling)` (see explorer.Engine), which batches
    the requests of all workflows in flight.
    """

    def __init__(self, tokenizer, reward_fn, dataset, system_prompt: str, sampling):
        self.tokenizer, self.reward_fn, self.dataset = tokenizer, reward_fn, dataset
        self.system_prompt, self.sampling = system_prompt, sampling

    def score(self, task: Task, completion: str) -> tuple[float, str | None]:
        """(reward, error). A reward function that raises scores 0 and returns the error text."""
        try:
            return float(self.reward_fn(task, completion, self.dataset)), None
        except Exception as e:
            return 0.0, f"{type(e).__name__}: {e}"

    async def run(self, task: Task, engine, n: int) -> list[Experience]:
        raise NotImplementedError


class MathWorkflow(Workflow):
    """Single turn: system prompt + question -> n sampled answers, each scored by `score`."""

    def prompt_ids(self, task: Task) -> list[int]:
        msgs = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        msgs.append({"role": "user", "content": task.question})
        return list(self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False))

    async def run(self, task: Task, engine, n: int) -> list[Experience]:
        prompt = self.prompt_ids(task)
        outs = await engine.generate(prompt, n, self.sampling)
        group_id = uuid.uuid4().hex
        group = []
        for out in outs:
            text = self.tokenizer.decode(out.tokens, skip_special_tokens=True)
            reward, error = self.score(task, text)
            info = {"finish_reason": out.finish_reason, "response": text, "answer": task.answer,
                    "versions": list(out.versions)}
            if error:
                info["reward_error"] = error
            group.append(Experience(
                tokens=prompt + out.tokens, prompt_length=len(prompt), logprobs=out.logprobs,
                action_mask=[1] * len(out.tokens), reward=reward, group_id=group_id,
                task_id=task.task_id, model_version=out.versions[0], info=info))
        return group


WORKFLOWS: dict[str, type[Workflow]] = {"math": MathWorkflow}
