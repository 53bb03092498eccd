"""`--reward-fn math_verify`: answers compared by math-verify (numbers, fractions, LaTeX)."""

import logging
from typing import Any

from math_verify import parse, verify  # (this file is imported only for --reward-fn math_verify)

from workflows import Task


def math_verify_reward(task: Task, completion: str, dataset: Any) -> float:
    """1.0 when math-verify finds the completion's answer equal to the reference (a bare one as
    "\\boxed{reference}", verl/utils/reward_score/math_verify.py @ 1309a22), else 0.0. ValueError
    for a reference without an answer."""
    ref = task.answer.strip()
    gold = parse(
        ref if "$" in ref or "\\boxed" in ref else f"\\boxed{{{ref}}}", parsing_timeout=None
    )
    if not gold:
        raise ValueError(f"math_verify: no answer found in the reference {task.answer!r}")
    return float(verify(gold, parse(completion, parsing_timeout=None), timeout_seconds=None))


for _name in (
    "math_verify.parser",
    "math_verify.grader",
):  # timeouts are off: signals need the main thread
    logging.getLogger(_name).addFilter(
        lambda r: not r.getMessage().startswith("Timeout is disabled")
    )
