"""Tasks (`load_tasks`: reasoning-gym's), their order (`Shuffle`), rewards and workflows: a
`Workflow` turns a task into a group of rollouts (`MathWorkflow`: n samples of one prompt); new
ones are named by `--workflow module.Class`."""

import asyncio
import contextlib
import importlib.util
import itertools
import math
import numbers
import random
import re
import threading
import uuid
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

from buffer import Experience


@dataclass
class Task:
    """One question. `entry`: the raw reasoning-gym entry (or JSONL row) the verifier needs."""

    task_id: str
    question: str
    answer: str
    entry: dict = field(default_factory=dict)
    difficulty: float | None = None  # higher = harder (set by a task pipeline)


def is_reasoning_gym(name: str) -> bool:
    """Whether task `name` is a dataset of reasoning-gym (installed), the core's task source."""
    if importlib.util.find_spec("reasoning_gym") is None:
        return False
    from reasoning_gym.factory import DATASETS

    return name in DATASETS


def load_tasks(
    name: str,
    kwargs: dict,
    train_size: int,
    eval_size: int,
    seed: int,
    eval_seed: int | None = None,
) -> tuple[list[Task], list[Task], Any]:
    """(train, held-out tasks, verifier dataset) of the reasoning-gym dataset `name`: the
    held-out tasks drawn with `eval_seed` (default: `seed`), the training tasks, none with a
    held-out question, with `seed`. ValueError: bad dataset or kwargs; the other task sources
    (a JSONL file, a Hugging Face dataset, ...) are the composition root's to pick."""
    try:
        import reasoning_gym
    except ImportError:
        raise ValueError(
            f"task {name!r} is a reasoning-gym dataset, and reasoning-gym is not installed: pip "
            "install reasoning-gym, or --task guess_number, a .jsonl file or a Hugging Face dataset"
        ) from None
    # reasoning-gym seeds item i with base + i: seeds 0 and 1 must not overlap
    base = seed * 10_000_019 % 2**31
    eval_base = (seed if eval_seed is None else eval_seed) * 10_000_019 % 2**31
    try:
        eval_ds = reasoning_gym.create_dataset(
            name, size=max(eval_size, 1), seed=eval_base + 1_000_003, **kwargs
        )
        # extra training candidates replace the ones whose question is held out
        train_ds = reasoning_gym.create_dataset(name, size=2 * train_size + 16, seed=base, **kwargs)
    except Exception as e:  # reasoning-gym raises several types for bad names/kwargs
        raise ValueError(f"reasoning-gym dataset {name!r} with {kwargs}: {e}") from None

    def task(split: str, i: int, x: dict) -> Task:
        return Task(f"{name}/{split}/{i}", x["question"], str(x["answer"]), x)

    # the held-out set is not filtered (that would skew it towards the rarest questions): training
    # gives way
    held = [task("eval", i, x) for i, x in enumerate(eval_ds)][:eval_size]
    seen = {t.question for t in held}
    fresh = (task("train", i, x) for i, x in enumerate(train_ds) if x["question"] not in seen)
    train = list(itertools.islice(fresh, train_size))
    if len(train) < train_size:
        raise ValueError(
            f"reasoning-gym dataset {name!r} with {kwargs}: only {len(train)} training tasks whose "
            f"question is not among the {eval_size} held-out ones; lower train_size or eval_size"
        )
    return train, held, train_ds


class Selector:
    """The indices of the next training tasks: `order`, cycled (Trinity-RFT
    trinity/buffer/selector/selector.py @ 3e9eb605)."""

    def __init__(self, tasks: list[Task], seed: int):
        self.tasks = tasks
        self.seed = seed
        self.cursor = 0
        self.order = list(range(len(tasks)))

    def next(self, k: int) -> list[int]:
        out = [self.order[(self.cursor + i) % len(self.order)] for i in range(k)]
        self.cursor += k
        return out

    def update(self, pass_rates: dict[str, float]) -> None:
        """task_id -> mean reward of its latest group."""

    def metrics(self) -> dict:
        return {}

    def state(self) -> dict:
        return {"cursor": self.cursor}

    def restore(self, state: dict) -> None:
        self.cursor = state["cursor"]


class Shuffle(Selector):
    """A seeded permutation of the tasks, cycled (`--selector shuffle`, the default)."""

    def __init__(self, tasks: list[Task], seed: int):
        super().__init__(tasks, seed)
        self.order = random.Random(seed).sample(range(len(tasks)), len(tasks))


def chat_ids(tokenizer, messages: list[dict], generation_prompt: bool) -> list[int]:
    """Token ids of `messages` under the chat template (with the assistant's turn prompt)."""
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=generation_prompt, tokenize=True, return_dict=False
    )
    return list(ids)


def last_number(text: str) -> str | None:
    """The last number in `text` ("-12", "3.5"; no trailing ".0"), or None."""
    found = re.findall(r"-?\d+(?:\.\d+)?", text.replace(",", ""))
    return found[-1].removesuffix(".0") if found else None


def extract_answer(completion: str, reference: str) -> str | None:
    """The last <answer>...</answer> block, else the last number (numeric reference), else the last
    line, or None."""
    if tagged := re.findall(r"<answer>(.*?)</answer>", completion, re.DOTALL):
        return tagged[-1].strip()
    if last_number(reference) == reference.strip().replace(",", "").removesuffix(".0"):
        return last_number(completion)
    lines = [x.strip() for x in completion.strip().splitlines() if x.strip()]
    return lines[-1] if lines else None


def readable(info: dict) -> bool | None:
    """Whether a reply (an Experience's info) ended within its budget with an answer; None without
    "response"."""
    if "response" not in info:
        return None
    answer = extract_answer(info["response"], info.get("answer", ""))
    return info.get("finish_reason") == "stop" and answer is not None


def reasoning_gym_reward(task: Task, completion: str, dataset: Any) -> float:
    """The dataset's `score_answer` of the completion's answer; without a dataset (JSONL) exact
    match."""
    answer = extract_answer(completion, task.answer)
    if dataset is None:
        return float(answer is not None and answer == extract_answer(task.answer, task.answer))
    return float(dataset.score_answer(answer, task.entry))


# --reward-fn name -> function fn(task, completion, dataset) -> float, or None (a lagged reward)
REWARD_FNS = {"reasoning_gym": reasoning_gym_reward}


def load_reward_fn(
    path: str, kwargs: dict | None = None, registry: dict = REWARD_FNS
) -> Callable[[Task, str, Any], float]:
    """The reward function `registry` names `path`, or at import path `module.function`, with
    `kwargs` bound. ValueError (one line): bad path or keyword."""
    from losses import resolve

    fn = resolve(path, registry, "reward_fn", kwargs)
    return partial(fn, **kwargs) if kwargs else fn


async def in_thread(fn, *args):
    """Await a blocking call in a daemon thread, so that a timeout can abandon a hanging one."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle(result, error) -> None:
        if not fut.done():
            fut.set_exception(error) if error is not None else fut.set_result(result)

    def target():
        try:
            result, error = fn(*args), None
        except BaseException as e:  # delivered to the awaiting coroutine
            result, error = None, e
        # the event loop is gone: nobody waits for this call any more
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=target, daemon=True).start()
    return await fut


def floors_info(floors: list[float] | None) -> dict:
    """What an Experience's info records of its response's kept sets: {"logprob_floors": floors
    [R]} of a top-k or top-p truncation (engines.Completion.logprob_floors: the trainer replays
    them), {} without one."""
    return {} if floors is None else {"logprob_floors": list(floors)}


class Workflow:
    """A task -> a group of Experiences (reward None: lagged); subclasses implement `async run(task,
    engine, n)`."""

    def __init__(
        self, tokenizer, reward_fn, dataset, system_prompt: str, sampling, run_dir: str = ""
    ):
        self.tokenizer = tokenizer
        self.reward_fn = reward_fn
        self.dataset = dataset
        self.system_prompt = system_prompt
        self.sampling = sampling
        self.run_dir = run_dir

    async def score(self, task: Task, completion: str) -> tuple[float | None, str | None]:
        """(reward, error): the reward function in a thread; an error or a non-finite reward scores
        0."""
        try:
            r = await in_thread(self.reward_fn, task, completion, self.dataset)
        except Exception as e:
            return 0.0, f"{type(e).__name__}: {e}"
        if r is None:
            return None, None
        if not isinstance(r, numbers.Real) or not math.isfinite(r):
            return 0.0, f"reward function returned {r!r}, not a finite number"
        return float(r), None

    def system(self) -> list[dict]:
        return [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []

    async def run(self, task: Task, engine, n: int) -> list[Experience]:
        raise NotImplementedError


class MathWorkflow(Workflow):
    """Single turn: system prompt + question -> n sampled answers, each scored by `score`."""

    def prompt_ids(self, task: Task) -> list[int]:
        messages = self.system() + [{"role": "user", "content": task.question}]
        return chat_ids(self.tokenizer, messages, True)

    async def run(self, task: Task, engine, n: int) -> list[Experience]:
        prompt = self.prompt_ids(task)
        outs = await engine.generate(prompt, n, self.sampling)
        group_id = uuid.uuid4().hex
        group = []
        texts = [self.tokenizer.decode(out.tokens, skip_special_tokens=True) for out in outs]
        scores = await asyncio.gather(*(self.score(task, text) for text in texts))
        for out, text, (reward, error) in zip(outs, texts, scores):
            info = {
                "finish_reason": out.finish_reason,
                "question": task.question,
                "response": text,
                "answer": task.answer,
                "versions": list(out.versions),
                **floors_info(out.logprob_floors),
            }
            if error:
                info["reward_error"] = error
            group.append(
                Experience(
                    prompt + out.tokens,
                    len(prompt),
                    out.behaviour_logprobs,
                    [1] * len(out.tokens),
                    reward,
                    group_id,
                    task.task_id,
                    out.versions[0],
                    info,
                )
            )
        return group


# --workflow name -> class
WORKFLOWS: dict[str, type[Workflow]] = {"math": MathWorkflow}


def load_workflow(name: str, registry: dict = WORKFLOWS) -> type[Workflow]:
    """The workflow class `registry` names `name`, or at import path `module.Class`; ValueError
    (one line) for another name or a class that is no Workflow."""
    from losses import resolve

    cls = resolve(name, registry, "workflow")
    if not (isinstance(cls, type) and issubclass(cls, Workflow)):
        raise ValueError(f"workflow {name!r} is not a subclass of workflows.Workflow")
    return cls
