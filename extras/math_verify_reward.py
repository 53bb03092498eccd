"""`--reward-fn math_verify`: answers compared by math-verify (numbers, fractions, LaTeX);
registered in workflows.REWARD_FNS by import path, imported only when asked for.
"""
from __future__ import annotations

import logging
from typing import Any

from math_verify import parse, verify  # (this file is imported only for --reward-fn math_verify)

from workflows import Task


def math_verify_reward(task: Task, completion: str, dataset: Any) -> float:
    """Reward 1.0 when the `math-verify` library finds the completion's answer
    mathematically equal to the reference, else 0.0 (GSM8K / MATH style: numbers,
    fractions, LaTeX, \\boxed{...}, symbolic equality). A bare reference (no "$", no
    \\boxed) is parsed as "\\boxed{reference}", as verl does
    (verl/utils/reward_score/math_verify.py, compute_score, commit 1309a22); one with LaTeX delimiters as
    it is (a MATH solution: its \\boxed answer). The completion is parsed with
    math-verify's default extraction (LaTeX, then plain expressions), as in math-verify's
    README and TRL's trl/rewards/accuracy_rewards.py. math-verify's own signal timeouts
    are off (they work only in the main thread; rewards run in a thread bounded by the
    workflow timeout). Raises ValueError when the reference has no parsable answer
    (counted as a reward error)."""
    ref = task.answer.strip()
    gold = parse(ref if "$" in ref or "\\boxed" in ref else f"\\boxed{{{ref}}}", parsing_timeout=None)
    if not gold:
        raise ValueError(f"math_verify: no answer found in the reference {task.answer!r}")
    return float(verify(gold, parse(completion, parsing_timeout=None), timeout_seconds=None))


class _NoTimeoutNote(logging.Filter):
    """Drops math-verify's note that its timeouts are off (they are, on purpose)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_NoTimeoutNote())
