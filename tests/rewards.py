"""Reward functions for the end-to-end tests (given to run.py by import path)."""


def length_parity(task, completion, dataset):
    """1 for an even-length completion, 0 for odd: gives a random tiny model reward variance.
    Raises on completions whose length is a multiple of 5, to exercise error handling."""
    if len(completion) % 5 == 0:
        raise ValueError("deliberate failure")
    return float(len(completion) % 2 == 0)


def constant(task, completion, dataset):
    """0.5 for every completion: every group has equal rewards, so every advantage is 0."""
    return 0.5


def always_raises(task, completion, dataset):
    """A broken reward function: raises on every completion."""
    raise RuntimeError("broken reward function")


def returns_nan(task, completion, dataset):
    """A broken reward function: NaN (SQLite would store it as NULL, 'not rated yet')."""
    return float("nan")


def blocks(task, completion, dataset):
    """A reward function that never returns (a hung judge endpoint)."""
    import threading

    threading.Event().wait()


def returns_none(task, completion, dataset):
    """A broken reward function: None (not a lagged reward here: the workflow asked for a score)."""
    return None


def returns_string(task, completion, dataset):
    """A broken reward function: a string instead of a number."""
    return "high"


def sometimes_raises(task, completion, dataset):
    """Raises on completions of odd length, else the length parity reward: a flaky reward."""
    if len(completion) % 2:
        raise RuntimeError("flaky reward function")
    return 1.0


def sometimes_nan(task, completion, dataset):
    """NaN on completions of odd length, else 1.0: a flaky reward."""
    return float("nan") if len(completion) % 2 else 1.0
