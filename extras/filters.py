"""Sequence filters before training, named by import path in losses.FILTERS (contract: losses.py), and
`apply_filters`, which runs them for trainer.Trainer.apply_filters (--filters; none by default)."""

import torch


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
    """Keep sequences whose mean behaviour log-prob over the action_mask tokens is >= `min_mean_logprob`."""
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
    """Keep responses in which at most `max_repeat_frac` of the `ngram`-grams repeat an earlier one."""
    resp = tokens[len(tokens) - len(behaviour_logprobs) :]
    grams = [tuple(resp[i : i + ngram]) for i in range(len(resp) - ngram + 1)]
    return not grams or (len(grams) - len(set(grams))) / len(grams) <= max_repeat_frac


def apply_filters(
    filters: dict, filter_kwargs: dict[str, dict], batch, adv: torch.Tensor
) -> tuple[torch.Tensor, dict[str, int]]:
    """Which sequences [N] bool all `filters` (name -> function, losses.resolve_algorithm) keep
    with their `filter_kwargs` (--filters), in order, of a trainer.StepBatch of N sequences with
    advantages `adv` [N]; offline ones always. `filter/<name>`: how many it dropped."""
    keep = torch.ones(len(batch.exps), dtype=torch.bool)
    m = {}
    for name, fn in filters.items():
        drop = [
            i
            for i, e in enumerate(batch.exps)
            if keep[i]
            and not batch.offline[i]
            and not fn(
                e.tokens,
                e.behaviour_logprobs,
                float(adv[i]),
                e.action_mask,
                **filter_kwargs[name],
            )
        ]
        keep[drop] = False
        m[f"filter/{name}"] = len(drop)
    return keep, m
