"""`--task guess_number --workflow guess_number` (configs/guess.toml): find a secret number by
higher/lower."""

from extras.multiturn import MultiTurnWorkflow
from workflows import Task, last_number


def guess_number_tasks(
    kwargs: dict, train_size: int, eval_size: int, seed: int
) -> tuple[list[Task], list[Task]]:
    """(train, held-out) tasks with secrets drawn uniformly from [low, high] (kwargs, default
    1..16)."""
    import random

    low, high = int(kwargs.get("low", 1)), int(kwargs.get("high", 16))
    if high <= low:
        raise ValueError(f"guess_number: need low < high, got {low}, {high}")
    question = (
        f"I am thinking of a whole number from {low} to {high}. Guess it: reply with one number. "
        "I will tell you if my number is higher or lower."
    )

    def draw(n: int, s: int, split: str) -> list[Task]:
        rng = random.Random(s)
        return [
            Task(f"guess_number/{split}/{i}", question, str(rng.randint(low, high)))
            for i in range(n)
        ]

    return draw(train_size, seed, "train"), draw(eval_size, seed + 1_000_003, "eval")


class GuessNumberEnv:
    """Each reply's last number guesses the task's answer: reward 1 when found, else higher /
    lower."""

    def reset(self, task: Task) -> str:
        self.secret = int(task.answer)
        return task.question

    def step(self, reply: str) -> tuple[str | None, float | None]:
        guess = last_number(reply)
        if guess is None or not guess.lstrip("-").isdigit():
            return "Reply with a single whole number.", None
        if int(guess) == self.secret:
            return None, 1.0
        return ("Higher." if int(guess) < self.secret else "Lower."), None


class GuessNumberWorkflow(MultiTurnWorkflow):
    """Find the secret number in at most max_turns guesses (`--task guess_number`)."""

    def make_env(self):
        return GuessNumberEnv()
