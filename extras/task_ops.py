"""The task operators of `--task-pipeline` (pipelines.TASK_OPS): dedup, length_filter and difficulty
estimates."""

from extras.judge import RATINGS, expected_rating
from extras.pipelines import TaskContext
from workflows import Task


def dedup(tasks: list[Task], ctx: TaskContext) -> list[Task]:
    """The first of tasks with equal questions, lower-cased (Data-Juicer's
    document_deduplicator)."""
    seen, out = set(), []
    for t in tasks:
        key = " ".join(t.question.lower().split())
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out


def length_filter(
    tasks: list[Task], ctx: TaskContext, min_tokens: int = 0, max_tokens: int = 0
) -> list[Task]:
    """Tasks whose question has min_tokens..max_tokens policy tokens (max_tokens 0: no bound)."""

    def ok(t):
        n = len(ctx.tokenizer.encode(t.question, add_special_tokens=False))
        return n >= min_tokens and (not max_tokens or n <= max_tokens)

    return [t for t in tasks if ok(t)]


def metadata_difficulty(
    tasks: list[Task], ctx: TaskContext, keys: tuple[str, ...] = ("num_digits", "num_terms")
) -> list[Task]:
    """difficulty = the sum of the task's numeric metadata fields `keys`; ValueError for a task
    without."""
    for t in tasks:
        meta = t.entry.get("metadata", t.entry)
        if missing := [k for k in keys if not isinstance(meta.get(k), (int, float))]:
            raise ValueError(f"metadata_difficulty: task {t.task_id} has no numeric {missing}")
        t.difficulty = float(sum(meta[k] for k in keys))
    ctx.metrics["pipeline/metadata_difficulty/mean"] = sum(t.difficulty for t in tasks) / len(tasks)
    return tasks


def pass_rate_difficulty(tasks: list[Task], ctx: TaskContext, k: int = 4) -> list[Task]:
    """difficulty = 1 - the policy's pass rate over k rollouts (Trinity-RFT report 2.3.2);
    skipped: 1."""
    for t, g in zip(tasks, ctx.rollouts(tasks, k)):
        rewards = [e.reward for e in g or [] if e.reward is not None]
        t.difficulty = 1.0 - (sum(rewards) / len(rewards) if rewards else 0.0)
    ctx.metrics["pipeline/pass_rate_difficulty/pass_rate"] = 1 - sum(
        t.difficulty for t in tasks
    ) / len(tasks)
    return tasks


def model_difficulty(
    tasks: list[Task], ctx: TaskContext, model: str = "", url: str = "", timeout_s: float = 60.0
) -> list[Task]:
    """difficulty = an auxiliary model's rating of the question, 1 (easy) to 5 (hard)
    (extras.judge)."""
    from extras.judge import ask_judge

    for t in tasks:
        msgs = [
            {
                "role": "user",
                "content": f"Rate how hard this problem is, from 1 (easy) to 5 (hard). "
                f"Reply with one digit.\nProblem: {t.question}",
            }
        ]
        t.difficulty = expected_rating(ask_judge(msgs, RATINGS, model, url, timeout_s))
    ctx.metrics["pipeline/model_difficulty/mean"] = sum(t.difficulty for t in tasks) / len(tasks)
    return tasks
