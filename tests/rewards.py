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
