"""Offline data (info["offline"]): chats for SFT or MIX, pairs for DPO; JSONL task files
(`jsonl_tasks`), `hold_out`; `NoWeights`, the publisher of offline training (--train-data)."""

import dataclasses
import json
import random
from pathlib import Path

from buffer import Experience
from workflows import Task, chat_ids


def hold_out(name: str, tasks: list[Task], eval_size: int) -> tuple[list[Task], list[Task]]:
    """(all but the last `eval_size` tasks, the last `eval_size`); ValueError when none remain."""
    if len(tasks) <= eval_size:
        raise ValueError(f"{name}: {len(tasks)} rows, need more than eval_size={eval_size}")
    return tasks[: len(tasks) - eval_size], tasks[len(tasks) - eval_size :]


def jsonl_rows(path: str | Path, what: str):
    """(path, line number, row) of each line of JSONL `path`; FileNotFoundError; ValueError naming
    the line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} not found: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({what}; byte {e.start})") from None
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                yield path, n, json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} line {n}: not valid JSON ({e.msg})") from None


def jsonl_tasks(name: str, eval_size: int) -> tuple[list[Task], list[Task]]:
    """(train, held-out: the last `eval_size`) tasks of a JSONL file of
    {"question", "answer"[, "id"]} rows."""
    tasks = []
    for path, i, row in jsonl_rows(name, "task file"):
        if not isinstance(row, dict) or "question" not in row or "answer" not in row:
            raise ValueError(f"{path} line {i}: needs 'question' and 'answer' fields")
        tasks.append(
            Task(
                str(row.get("id", f"{path.stem}/{i}")),
                str(row["question"]),
                str(row["answer"]),
                row,
            )
        )
    return hold_out(name, tasks, eval_size)


class OfflineSampler:
    """Groups in a seeded shuffled order, cycled; `drawn`: how many (as many drawn again resume
    it)."""

    def __init__(self, groups: list[list[Experience]], seed: int):
        if not groups:
            raise ValueError("offline data is empty")
        self.groups, self.rng, self.order, self.drawn = groups, random.Random(seed), [], 0

    def draw(self, n: int) -> list[list[Experience]]:
        """The next n groups."""
        out, self.drawn = [], self.drawn + n
        for _ in range(n):
            if not self.order:
                self.order = self.rng.sample(range(len(self.groups)), len(self.groups))
            out.append(
                [
                    dataclasses.replace(e, info={**e.info, "offline": True}, explorer="offline")
                    for e in self.groups[self.order.pop()]
                ]
            )
        return out


def _is_messages(msgs) -> bool:
    return isinstance(msgs, list) and all(
        isinstance(m, dict) and {"role", "content"} <= set(m) for m in msgs
    )


def load_chat_jsonl(path: str | Path, tokenizer) -> list[list[Experience]]:
    """One {"messages": [...]} per line -> a group of one Experience (reward 1.0) trained on its
    assistant turns."""
    out = []
    for path, n, row in jsonl_rows(path, "chat data"):
        msgs = row.get("messages") if isinstance(row, dict) else None
        if not _is_messages(msgs):
            raise ValueError(
                f'{path} line {n}: needs {{"messages": [{{"role": ..., "content": ...}}, ...]}}'
            )
        tokens, mask = [], []
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            prompt, full = (
                chat_ids(tokenizer, msgs[:i], True),
                chat_ids(tokenizer, msgs[: i + 1], False),
            )
            if prompt[: len(tokens)] != tokens or full[: len(prompt)] != prompt:
                raise ValueError(
                    f"{path} line {n}: chat template output is not a token prefix across turns"
                )
            turn = full[len(prompt) :]
            end = (
                turn.index(tokenizer.eos_token_id) + 1
                if tokenizer.eos_token_id in turn
                else len(turn)
            )
            mask += [0] * (len(prompt) - len(tokens)) + [1] * end + [0] * (len(turn) - end)
            tokens = full
        if 1 not in mask:
            raise ValueError(f"{path} line {n}: no assistant message")
        p, last = mask.index(1), len(mask) - mask[::-1].index(1)
        tokens, mask = tokens[:last], mask[:last]
        out.append(
            [
                Experience(
                    tokens,
                    p,
                    [0.0] * (len(tokens) - p),
                    mask[p:],
                    1.0,
                    f"{path.stem}/{n}",
                    f"{path.stem}/{n}",
                    0,
                    {"offline": True},
                )
            ]
        )
    return out


def load_preference_jsonl(path: str | Path, tokenizer) -> list[list[Experience]]:
    """One {"prompt", "chosen", "rejected"} per line -> a group of two (rewards 1, 0); ValueError
    naming the line."""
    out = []
    for path, n, row in jsonl_rows(path, "preference data"):
        if not (isinstance(row, dict) and {"prompt", "chosen", "rejected"} <= set(row)):
            raise ValueError(f"{path} line {n}: needs prompt, chosen and rejected fields")
        msgs = (
            [{"role": "user", "content": row["prompt"]}]
            if isinstance(row["prompt"], str)
            else row["prompt"]
        )
        if not _is_messages(msgs):
            raise ValueError(f"{path} line {n}: prompt must be a string or a list of messages")
        if not (isinstance(row["chosen"], str) and isinstance(row["rejected"], str)):
            raise ValueError(
                f"{path} line {n}: chosen and rejected must be strings (the assistant replies)"
            )
        prompt, group = chat_ids(tokenizer, msgs, True), []
        for key, reward in (("chosen", 1.0), ("rejected", 0.0)):
            full = chat_ids(tokenizer, msgs + [{"role": "assistant", "content": row[key]}], False)
            if full[: len(prompt)] != prompt or len(full) == len(prompt):
                raise ValueError(
                    f"{path} line {n}: chat template output is not a token prefix of the "
                    f"{key} reply"
                )
            r = len(full) - len(prompt)
            group.append(
                Experience(
                    full,
                    len(prompt),
                    [0.0] * r,
                    [1] * r,
                    reward,
                    f"{path.stem}/{n}",
                    f"{path.stem}/{n}",
                    0,
                    {"offline": True, "preference": key},
                )
            )
        out.append(group)
    return out


def load_offline_jsonl(path: str | Path, tokenizer) -> list[list[Experience]]:
    """Chats or preference pairs, told apart by the first row's fields."""
    first = next(jsonl_rows(path, "offline data"), (None, None, {}))[2]
    pairs = isinstance(first, dict) and "chosen" in first
    return (load_preference_jsonl if pairs else load_chat_jsonl)(path, tokenizer)


def sampler(path: str | Path, tokenizer, seed: int, chats_only: bool = False) -> OfflineSampler:
    """An OfflineSampler of the JSONL file `path` (`chats_only`: MIX's expert data)."""
    return OfflineSampler(
        (load_chat_jsonl if chats_only else load_offline_jsonl)(path, tokenizer), seed
    )


class OfflineBatches:
    """The batch source of --train-data (components.reader_and_log): batch_size rows a step from the
    file, in the order `cfg.seed` draws them; at `start`, the rows of earlier steps drawn."""

    def __init__(self, cfg, tokenizer, start: int):
        self.batch_size = cfg.batch_size
        self.rows = sampler(cfg.train_data, tokenizer, cfg.seed)
        self.rows.draw(start * cfg.batch_size)

    def next(self, step: int, version: int, alive) -> tuple[list, dict]:
        return self.rows.draw(self.batch_size), {}


class ExpertMixing:
    """The shaping of a step's groups (loop.BatchReader.shape) with --expert-data mixed in after
    `shape` (None: none): MIX's expert_fraction of the batch's sequences. The rows drawn so far
    are kept in the trainer's resume state."""

    def __init__(self, cfg, trainer, shape):
        self.fraction = cfg.expert_fraction
        self.trainer = trainer
        self.shape = shape
        self.expert = sampler(cfg.expert_data, trainer.tokenizer, cfg.seed, chats_only=True)
        self.expert.draw(trainer.loop_state.get("expert_drawn", 0))

    def __call__(self, groups: list, step: int) -> tuple[list, dict]:
        groups, m = self.shape(groups, step) if self.shape else (groups, {})
        n = sum(map(len, groups))  # MIX: this fraction of the batch's sequences is expert data
        groups += self.expert.draw(max(1, round(self.fraction * n / (1 - self.fraction))))
        # (n varies: the resume state records it)
        self.trainer.loop_state["expert_drawn"] = self.expert.drawn
        return groups, m


def check_offline_data(cfg, tok) -> None:
    """ValueError (one line) for --expert-data or --train-data files without rows."""
    if cfg.expert_fraction and not load_chat_jsonl(cfg.expert_data, tok):
        raise ValueError(f"expert_data {cfg.expert_data}: no conversations")
    if cfg.train_data and not load_offline_jsonl(cfg.train_data, tok):
        raise ValueError(f"train_data {cfg.train_data}: no rows")


class NoWeights:
    """The weight publisher of offline training (--train-data; components.publisher): no explorer
    takes the weights."""

    def publish(self, trainer) -> tuple[None, None]:
        """Nothing published: (no checksum, no full parameters)."""
        return None, None
