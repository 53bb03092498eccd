"""Sequence filters before training (the contract of losses.py; losses.apply_filters runs them),
in `FILTERS`, which the composition root merges into the core's when --filters names one."""


def zero_advantage_filter(
    tokens: list[int],
    behaviour_logprobs: list[float],
    advantage: float,
    action_mask: list[int] | None = None,
    eps: float = 1e-8,
) -> bool:
    """Keep sequences with a non-zero advantage: the others carry no policy gradient."""
    return abs(advantage) > eps


def gibberish_filter(
    tokens: list[int],
    behaviour_logprobs: list[float],
    advantage: float,
    action_mask: list[int] | None = None,
    min_mean_logprob: float = -6.0,
) -> bool:
    """Keep sequences whose mean behaviour log-prob over the action_mask tokens is >=
    `min_mean_logprob`."""
    own = [
        lp for lp, m in zip(behaviour_logprobs, action_mask or [1] * len(behaviour_logprobs)) if m
    ]
    return not own or sum(own) / len(own) >= min_mean_logprob


def repetition_filter(
    tokens: list[int],
    behaviour_logprobs: list[float],
    advantage: float,
    action_mask: list[int] | None = None,
    ngram: int = 4,
    max_repeat_frac: float = 0.5,
) -> bool:
    """Keep responses in which at most `max_repeat_frac` of the `ngram`-grams repeat an earlier
    one."""
    resp = tokens[len(tokens) - len(behaviour_logprobs) :]
    grams = [tuple(resp[i : i + ngram]) for i in range(len(resp) - ngram + 1)]
    return not grams or (len(grams) - len(set(grams))) / len(grams) <= max_repeat_frac


FILTERS = {
    "zero_advantage": zero_advantage_filter,
    "gibberish": gibberish_filter,
    "repetition": repetition_filter,
}
