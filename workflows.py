"""Tasks, reward functions and workflows: what the explorer runs for each task.

A `Task` is one question with its reference answer. A `Workflow` turns a task into a
group of rollouts: it builds the prompt, asks the engine for `n` samples and scores each
one. The training reward and the held-out accuracy both come from `Workflow.score`, so
they cannot drift apart (nanochat's rule).

Task sources:
  - a reasoning-gym generator: `task = "basic_arithmetic"` with `task_kwargs`; the held-out
    set is the generator's first `eval_size` tasks at another seed (a sample of the task
    distribution as it is), and training tasks whose question is held out are dropped and
    replaced by further draws. The reward is the dataset's own `score_answer`.
  - a JSONL file: `task = "path/to/tasks.jsonl"`, one `{"question": ..., "answer": ...}`
    per line; the last `eval_size` rows are held out. The reward is exact match.
  - a Hugging Face dataset (`datasets.load_dataset`): a Hub id (`task = "openai/gsm8k"`,
    `task_kwargs = {"config": "main", "eval_split": "test"}`), a local directory laid out
    like one, or a local .parquet / .json / .csv file; see extras/hub.py. Score math
    answers with `reward_fn = "math_verify"` (extras/math_verify_reward.py).
  - the bundled multi-turn game `guess_number` (extras/guess_number.py).
  - an installed verifiers environment's tasks, `task = "verifiers:NAME"`, run with
    `workflow = "verifiers:NAME"` (extras/verifiers_env.py).

Offline data (SFT chats, DPO preference pairs, MIX expert data) is read by
`load_chat_jsonl`, `load_preference_jsonl` and `load_offline_jsonl` and drawn by
`OfflineSampler`.

Add a scenario by subclassing `Workflow` and adding it to `WORKFLOWS` (or give its import
path: `--workflow mymod.MyWorkflow`); an agent written against the `openai` client is
`--workflow agent:mymod.my_agent` (extras/agent.py). Optional parts (the Hub, the LLM judge,
math-verify, reflection, the guess-number game, agents) live in extras/ and are registered by
import path.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import random
import math
import numbers
import re
import threading
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
    difficulty: float | None = None  # higher = harder; set by a task pipeline operator (pipelines.py)


# ----------------------------------------------------------------------------- sources

# task sources in extras/, by import path: name -> f(kwargs, train_size, eval_size, seed);
# prefix -> f(text after "prefix:", train_size, eval_size); Hugging Face datasets: (is_dataset(name), tasks(...))
TASK_SOURCES = {"guess_number": "extras.guess_number.guess_number_tasks"}
TASK_PREFIXES = {"verifiers": "extras.verifiers_env.verifiers_tasks"}
HF_DATASETS = ("extras.hub.is_dataset", "extras.hub.hf_dataset_tasks")


def load_tasks(name: str, kwargs: dict, train_size: int, eval_size: int, seed: int) -> tuple[list[Task], list[Task], Any]:
    """Return (train tasks, held-out tasks, verifier dataset or None).

    Raises ValueError for an unknown reasoning-gym dataset, bad kwargs, a reasoning-gym
    task without reasoning-gym installed, or a malformed JSONL row (the message names the
    file and line); FileNotFoundError for a missing file.
    """
    from losses import resolve

    if name in TASK_SOURCES:  # the bundled multi-turn game
        return (*resolve(TASK_SOURCES[name], {}, "task")(kwargs, train_size, eval_size, seed), None)
    prefix, _, rest = name.partition(":")
    if rest and prefix in TASK_PREFIXES:  # an installed verifiers environment's tasks
        return (*resolve(TASK_PREFIXES[prefix], {}, "task")(rest, train_size, eval_size), None)
    if name.endswith(".jsonl"):
        return (*hold_out(name, _read_jsonl_tasks(Path(name)), eval_size), None)
    is_dataset, dataset_tasks = (resolve(p, {}, "task") for p in HF_DATASETS)
    if is_dataset(name):  # Hugging Face datasets
        return (*dataset_tasks(name, kwargs, train_size, eval_size), None)
    try:
        import reasoning_gym
    except ImportError:
        raise ValueError(f"task {name!r} is a reasoning-gym dataset, and reasoning-gym is not installed: pip install "
                         "reasoning-gym, or --task guess_number, a .jsonl file or a Hugging Face dataset") from None
    # reasoning-gym draws item i with the seed `seed + i` (numpy's below 2**32 in some generators):
    # run seeds 0 and 1 must not share all but one task
    base = seed * 10_000_019 % 2**31
    try:
        eval_ds = reasoning_gym.create_dataset(name, size=max(eval_size, 1), seed=base + 1_000_003, **kwargs)
        # extra training candidates replace the ones whose question is held out
        train_ds = reasoning_gym.create_dataset(name, size=2 * train_size + 16, seed=base, **kwargs)
    except Exception as e:  # reasoning-gym raises several types for bad names/kwargs
        raise ValueError(f"reasoning-gym dataset {name!r} with {kwargs}: {e}") from None
    # The held-out set is not filtered: rejecting held-out questions that training has would
    # skew it towards the rarest (hardest) ones where the task space is small (the default task:
    # 3% one-digit sums held out against 41% drawn). Training gives way instead.
    held = [Task(f"{name}/eval/{i}", x["question"], str(x["answer"]), x) for i, x in enumerate(eval_ds)][:eval_size]
    seen = {t.question for t in held}
    train = list(itertools.islice((Task(f"{name}/train/{i}", x["question"], str(x["answer"]), x)
                                   for i, x in enumerate(train_ds) if x["question"] not in seen), train_size))
    if len(train) < train_size:
        raise ValueError(f"reasoning-gym dataset {name!r} with {kwargs}: only {len(train)} training tasks whose "
                         f"question is not among the {eval_size} held-out ones; lower train_size or eval_size")
    return train, held, train_ds


def hold_out(name: str, tasks: list[Task], eval_size: int) -> tuple[list[Task], list[Task]]:
    """(all but the last `eval_size` tasks, the last `eval_size`); ValueError when none remain."""
    if len(tasks) <= eval_size:
        raise ValueError(f"{name}: {len(tasks)} rows, need more than eval_size={eval_size}")
    cut = len(tasks) - eval_size
    return tasks[:cut], tasks[cut:]


def _read_jsonl_tasks(path: Path) -> list[Task]:
    tasks = []
    for path, i, row in _jsonl_rows(path, "task file"):
        if not isinstance(row, dict) or "question" not in row or "answer" not in row:
            raise ValueError(f"{path} line {i}: needs 'question' and 'answer' fields")
        tasks.append(Task(str(row.get("id", f"{path.stem}/{i}")), str(row["question"]), str(row["answer"]), row))
    return tasks


def _jsonl_rows(path: str | Path, what: str):
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} not found: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({what}; byte {e.start})") from None
    except IsADirectoryError:
        raise ValueError(f"{path}: is a directory, not a {what}") from None
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                yield path, n, json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} line {n}: not valid JSON ({e.msg})") from None


class OfflineSampler:
    """Sampling strategy for offline data (SFT chats, DPO pairs, MIX expert data): draws
    groups in a seeded shuffled order, cycling through epochs. Each drawn experience is a
    copy marked info["offline"] (offline data has no behaviour log-probs and is never
    filtered). `drawn`: groups drawn so far (drawing as many from a new sampler of the same
    data and seed continues in the same order: a resume). Raises ValueError for no data."""

    def __init__(self, groups: list[list[Experience]], seed: int):
        if not groups:
            raise ValueError("offline data is empty")
        self.groups, self.rng, self.order = groups, random.Random(seed), []
        self.drawn = 0

    def draw(self, n: int) -> list[list[Experience]]:
        """The next n groups."""
        out = []
        self.drawn += n
        for _ in range(n):
            if not self.order:
                self.order = self.rng.sample(range(len(self.groups)), len(self.groups))
            out.append([dataclasses.replace(e, info={**e.info, "offline": True}, explorer="offline")
                        for e in self.groups[self.order.pop()]])
        return out


def chat_ids(tokenizer, messages: list[dict], generation_prompt: bool) -> list[int]:
    """Token ids of `messages` under the tokenizer's chat template, ending with the assistant's
    turn prompt when `generation_prompt`."""
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt,
                                              tokenize=True, return_dict=False))


def _is_messages(msgs) -> bool:
    return isinstance(msgs, list) and all(isinstance(m, dict) and {"role", "content"} <= set(m) for m in msgs)


def load_chat_jsonl(path: str | Path, tokenizer) -> list[list[Experience]]:
    """SFT / expert data: one {"messages": [{"role", "content"}, ...]} per line -> one group
    of one Experience per conversation, tokenised with the chat template, action_mask 1
    exactly on what the model generates in each assistant turn: template(messages[:i+1])
    minus template(messages[:i], generation prompt), up to and including the end-of-turn
    token (the tokenizer's eos; the template's newline after it is not generated), and the
    sequence ending there: the tokens an engine would have sampled and recorded. Reward 1.0,
    behaviour_logprobs 0 (no behaviour policy), info["offline"]. Raises FileNotFoundError,
    or ValueError naming the file and line (bad JSON, no assistant turn, or turns that are
    not token prefixes of each other)."""
    out = []
    for path, n, row in _jsonl_rows(path, "chat data"):
        msgs = row.get("messages") if isinstance(row, dict) else None
        if not _is_messages(msgs):
            raise ValueError(f'{path} line {n}: needs {{"messages": [{{"role": ..., "content": ...}}, ...]}}')
        tokens, mask = [], []
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            prompt, full = chat_ids(tokenizer, msgs[:i], True), chat_ids(tokenizer, msgs[: i + 1], False)
            if prompt[: len(tokens)] != tokens or full[: len(prompt)] != prompt:
                raise ValueError(f"{path} line {n}: chat template output is not a token prefix across turns")
            turn = full[len(prompt):]
            end = turn.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in turn else len(turn)
            mask += [0] * (len(prompt) - len(tokens)) + [1] * end + [0] * (len(turn) - end)
            tokens = full
        if 1 not in mask:
            raise ValueError(f"{path} line {n}: no assistant message")
        p, last = mask.index(1), len(mask) - mask[::-1].index(1)
        tokens, mask = tokens[:last], mask[:last]
        out.append([Experience(tokens, p, [0.0] * (len(tokens) - p), mask[p:], 1.0, f"{path.stem}/{n}",
                               f"{path.stem}/{n}", 0, {"offline": True})])
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
        if not (isinstance(row["chosen"], str) and isinstance(row["rejected"], str)):
            raise ValueError(f"{path} line {n}: chosen and rejected must be strings (the assistant replies)")
        prompt = chat_ids(tokenizer, msgs, True)
        group = []
        for key, reward in (("chosen", 1.0), ("rejected", 0.0)):
            full = chat_ids(tokenizer, msgs + [{"role": "assistant", "content": row[key]}], False)
            if full[: len(prompt)] != prompt or len(full) == len(prompt):
                raise ValueError(f"{path} line {n}: chat template output is not a token prefix of the {key} reply")
            r = len(full) - len(prompt)
            group.append(Experience(full, len(prompt), [0.0] * r, [1] * r, reward, f"{path.stem}/{n}",
                                    f"{path.stem}/{n}", 0, {"offline": True, "preference": key}))
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


_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def extract_answer(completion: str, reference: str) -> str | None:
    """The answer part of a completion: the last <answer>...</answer> block if there is
    one (reasoning-gym's convention), else the last number when the reference answer is a
    number, else the last non-empty line. None when there is nothing to score."""
    tagged = _ANSWER_TAG.findall(completion)
    if tagged:
        return tagged[-1].strip()
    if last_number(reference) == reference.strip().replace(",", "").removesuffix(".0"):
        return last_number(completion)
    lines = [x.strip() for x in completion.strip().splitlines() if x.strip()]
    return lines[-1] if lines else None


def readable(info: dict) -> bool | None:
    """Whether a single-turn reply (an Experience's info, as `MathWorkflow` records it) is
    in a form a reward can read: it ended within the token budget (finish_reason "stop")
    and `extract_answer` finds an answer in it. None for a sample without a recorded reply
    (multi-turn, agents). The format rate of evaluations (eval/format_rate)."""
    if "response" not in info:
        return None
    return info.get("finish_reason") == "stop" and extract_answer(info["response"], info.get("answer", "")) is not None


def reasoning_gym_reward(task: Task, completion: str, dataset: Any) -> float:
    """Reward in [0, 1]: the dataset's own `score_answer` on the completion's answer
    (`extract_answer`); for JSONL tasks (`dataset` None) exact match of that answer."""
    answer = extract_answer(completion, task.answer)
    if dataset is None:
        return float(answer is not None and answer == extract_answer(task.answer, task.answer))
    return float(dataset.score_answer(answer, task.entry))


def load_reward_fn(path: str, kwargs: dict | None = None) -> Callable[[Task, str, Any], float]:
    """`"reasoning_gym"`, `"judge"` (an LLM judge, see `judge_reward`), `"math_verify"`
    (`math_verify_reward`), `"human"` (`human_reward`) or an import path
    `"module.function"` with the signature fn(task, completion, dataset, **kwargs) -> float
    (or None: lagged reward). `kwargs` (cfg.reward_kwargs) are bound here. Raises ValueError
    (one line) for a bad path or keyword."""
    from functools import partial

    from losses import resolve

    fn = resolve(path, REWARD_FNS, "reward_fn", kwargs)
    return partial(fn, **kwargs) if kwargs else fn


def human_reward(task: Task, completion: str, dataset: Any) -> None:
    """No reward yet: every rollout waits in the buffer (reward NULL) for a human label,
    from Label Studio (the annotation setting, extras.label_studio.Annotator) or from
    `python buffer.py RUN_DIR set-reward`."""
    return None


# name -> function, or the import path of an optional one (extras/)
REWARD_FNS = {"reasoning_gym": reasoning_gym_reward, "human": human_reward, "judge": "extras.judge.judge_reward",
              "math_verify": "extras.math_verify_reward.math_verify_reward"}


# ----------------------------------------------------------------------------- workflows

async def in_thread(fn, *args):
    """Run a blocking call (an environment step, a judge) in a daemon thread and await it,
    so a hanging call can be abandoned by a timeout without blocking the event loop or the
    interpreter's exit."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def target():
        try:
            result, error = fn(*args), None
        except BaseException as e:  # delivered to the awaiting coroutine
            result, error = None, e
        try:
            loop.call_soon_threadsafe(_settle, fut, result, error)
        except RuntimeError:  # the event loop is gone: nobody waits for this call any more
            pass

    threading.Thread(target=target, daemon=True).start()
    return await fut


def _settle(fut, result, error) -> None:
    if not fut.done():
        fut.set_exception(error) if error is not None else fut.set_result(result)


class Workflow:
    """Base class: turn one task into a group of Experiences. Adapt nanorft to a new
    scenario by subclassing it (single-turn) or `MultiTurnWorkflow` and naming the class
    with `--workflow module.Class` (or adding it to WORKFLOWS).

    Subclasses implement `async run(task, engine, n) -> list[Experience]`; they call
    `await engine.generate(prompt_ids, n, sampling)` (see engines.Engine), which batches
    the requests of all workflows in flight. A reward of None means "not known yet"
    (lagged reward): the buffer stores it as NULL and never serves the group until
    `Buffer.set_rewards` fills it. The explorer applies timeouts and retries around `run`.
    Attributes: tokenizer, reward_fn, dataset, system_prompt, sampling, run_dir.
    """

    def __init__(self, tokenizer, reward_fn, dataset, system_prompt: str, sampling, run_dir: str = ""):
        self.tokenizer, self.reward_fn, self.dataset = tokenizer, reward_fn, dataset
        self.system_prompt, self.sampling, self.run_dir = system_prompt, sampling, run_dir

    async def score(self, task: Task, completion: str) -> tuple[float | None, str | None]:
        """(reward, error). The reward function runs in a thread (`in_thread`), so one that
        blocks is abandoned at the explorer's workflow timeout instead of hanging the run.
        One that raises, or returns anything but a finite real number or None (NaN, a
        string, ...), scores 0 and returns the error text (counted as a reward error); None
        leaves the reward to be filled in later (lagged reward)."""
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
        return chat_ids(self.tokenizer, self.system() + [{"role": "user", "content": task.question}], True)

    async def run(self, task: Task, engine, n: int) -> list[Experience]:
        prompt = self.prompt_ids(task)
        outs = await engine.generate(prompt, n, self.sampling)
        group_id = uuid.uuid4().hex
        group = []
        texts = [self.tokenizer.decode(out.tokens, skip_special_tokens=True) for out in outs]
        scores = await asyncio.gather(*(self.score(task, text) for text in texts))
        for out, text, (reward, error) in zip(outs, texts, scores):
            info = {"finish_reason": out.finish_reason, "question": task.question, "response": text,
                    "answer": task.answer, "versions": list(out.versions)}
            if error:
                info["reward_error"] = error
            group.append(Experience(
                tokens=prompt + out.tokens, prompt_length=len(prompt), behaviour_logprobs=out.behaviour_logprobs,
                action_mask=[1] * len(out.tokens), reward=reward, group_id=group_id,
                task_id=task.task_id, model_version=out.versions[0], info=info))
        return group


class MultiTurnWorkflow(Workflow):
    """Base of multi-turn workflows: the policy and an environment take turns.

    Subclasses implement `make_env()`, returning an environment with
    `reset(task) -> str` (the first user message) and `step(reply) -> (message, reward)`:
    the environment's next message, or None when the episode is over, and the reward
    (None while the episode goes on). Environments are reset and reused across episodes;
    one whose call raised is dropped. Environment calls run in a thread (`in_thread`), so
    a hanging one can be abandoned by the explorer's timeout.

    Token streams (prime-rl's merging rule): each turn's prompt is the chat template of the
    conversation so far. While it extends the previous prompt + completion as an exact
    token prefix, the turn is appended to the same sample (the environment's tokens with
    action_mask 0 and behaviour log-prob 0, the sampled tokens with action_mask 1 and their
    behaviour log-probs); where it does not (the template re-renders or drops history) a
    new sample starts (see `context`). The tokens of every sample are exactly those the engine saw and
    sampled. All samples of a trajectory carry its final reward, info["trajectory_id"],
    info["turns"] and info["samples"] (samples in the trajectory).
    """

    max_turns = 6

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._idle_envs: list = []

    def make_env(self):
        raise NotImplementedError

    def context(self, messages: list[dict]) -> list[dict]:
        """The messages the policy sees this turn; override to compact the context or drop
        past reasoning (the token prefix then breaks and a new sample starts)."""
        return messages

    async def run(self, task: Task, engine, n: int) -> list[Experience]:
        group_id = uuid.uuid4().hex
        trajs = await asyncio.gather(*(self.episode(task, engine, group_id, f"{group_id}/{i}") for i in range(n)))
        return [e for t in trajs for e in t]

    async def episode(self, task: Task, engine, group_id: str, trajectory_id: str) -> list[Experience]:
        """One conversation -> its samples (see the class docstring)."""
        env = self._idle_envs.pop() if self._idle_envs else self.make_env()
        msgs = self.system() + [{"role": "user", "content": await in_thread(env.reset, task)}]
        samples: list[dict] = []
        reward, turns, transcript = None, 0, []
        while reward is None and turns < self.max_turns:
            turns += 1
            prompt = chat_ids(self.tokenizer, self.context(msgs), True)
            cur = samples[-1] if samples else None
            if cur is not None and prompt[: len(cur["tokens"])] == cur["tokens"]:
                extra = prompt[len(cur["tokens"]):]  # environment tokens: not trained on
                cur["tokens"] += extra
                cur["mask"] += [0] * len(extra)
                cur["behaviour_logprobs"] += [0.0] * len(extra)
            else:
                cur = {"tokens": list(prompt), "prompt_length": len(prompt), "mask": [], "behaviour_logprobs": [],
                       "versions": []}
                samples.append(cur)
            out = (await engine.generate(cur["tokens"], 1, self.sampling))[0]
            cur["tokens"] += out.tokens
            cur["mask"] += [1] * len(out.tokens)
            cur["behaviour_logprobs"] += out.behaviour_logprobs
            cur["versions"] += list(out.versions)
            text = self.tokenizer.decode(out.tokens, skip_special_tokens=True)
            msgs.append({"role": "assistant", "content": text})
            message, reward = await in_thread(env.step, text)
            transcript.append(text.strip())
            if message is None:
                break
            msgs.append({"role": "user", "content": message})
            transcript.append(message)
        self._idle_envs.append(env)
        reward = 0.0 if reward is None else float(reward)
        return [Experience(s["tokens"], s["prompt_length"], s["behaviour_logprobs"], s["mask"], reward, group_id,
                           task.task_id, min(s["versions"]),
                           {"trajectory_id": trajectory_id, "turns": turns, "samples": len(samples),
                            "versions": [min(s["versions"]), max(s["versions"])],
                            "finish_reason": out.finish_reason, "answer": task.answer,
                            "response": " | ".join(transcript)})
                for s in samples]


# name -> class, or the import path of an optional one (extras/)
WORKFLOWS: dict[str, type[Workflow] | str] = {"math": MathWorkflow, "guess_number": "extras.guess_number.GuessNumberWorkflow",
                                              "reflect": "extras.reflect.ReflectWorkflow"}
# prefix -> import path of a factory(text after the prefix) -> Workflow subclass (optional parts in extras/)
WORKFLOW_PREFIXES = {"agent": "extras.agent.agent_workflow", "verifiers": "extras.verifiers_env.verifiers_workflow"}


def load_workflow(name: str) -> type[Workflow]:
    """A registered workflow class, one given as `module.Class`, or one made by a prefix
    (`agent:module.function`, `verifiers:NAME`: WORKFLOW_PREFIXES); ValueError (one line)
    otherwise."""
    from losses import resolve

    prefix, colon, rest = name.partition(":")
    if colon and prefix in WORKFLOW_PREFIXES:
        cls = resolve(WORKFLOW_PREFIXES[prefix], {}, "workflow")(rest)
    else:
        cls = resolve(name, WORKFLOWS, "workflow")
    if not (isinstance(cls, type) and issubclass(cls, Workflow)):
        raise ValueError(f"workflow {name!r} is not a subclass of workflows.Workflow")
    return cls


def prepare_tasks(cfg) -> tuple[list[Task], list[Task], Any]:
    """The run's tasks (load_tasks: train, held-out, verifier dataset), built once per
    launch, after checking cfg's reward function and workflow names. Raises ValueError
    (one line) for a task that gives no training tasks, mode bench without held-out tasks,
    or an unknown reward function or workflow."""
    tasks = train, held_out, _ = load_tasks(cfg.task, cfg.task_kwargs, cfg.train_size, cfg.eval_size, cfg.seed)
    if not train:
        raise ValueError(f"task {cfg.task!r} produced no training tasks")
    if cfg.mode == "bench" and not held_out:
        raise ValueError(f"mode bench needs held-out tasks: task {cfg.task!r} with eval_size {cfg.eval_size} has none")
    load_reward_fn(cfg.reward_fn, cfg.reward_kwargs)
    load_workflow(cfg.workflow)
    return tasks


def check_offline_data(cfg, tok) -> None:
    """Raise ValueError (one line) for --expert-data or --train-data files that hold no
    rows under the chat template of `tok` (the model's tokenizer; FileNotFoundError: a
    missing file)."""
    if cfg.expert_fraction and not load_chat_jsonl(cfg.expert_data, tok):
        raise ValueError(f"expert_data {cfg.expert_data}: no conversations")
    if cfg.train_data and not load_offline_jsonl(cfg.train_data, tok):
        raise ValueError(f"train_data {cfg.train_data}: no rows")
