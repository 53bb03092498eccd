"""The default algorithm's pure tensor functions (GRPO advantages, PPO clip, KL, the loss
aggregation) and the registries every advantage, policy loss and filter is chosen from.

No model, no process group, no I/O: each function can be checked against a slow reference
(tests/test_fidelity.py pins each one to numbers from the reference code its docstring
names). Shapes: B = sequences of a micro-batch, T = response tokens (right-padded). The
contracts, also of plug-ins given by import path `module.function` (docs/algorithms.md):

  ADVANTAGES[name](rewards [B], group_index [B], trajectory_index [B], **kw) -> [B]
      (with a `token_counts` parameter it also gets each sequence's trained tokens [B])
  POLICY_LOSSES[name](LossInputs, **kw) -> {"loss": [B, T], other per-token metrics: [B, T]}
      with the attributes `register` sets: agg, needs_groups, needs_ref, split_expert
  FILTERS[name](tokens, behaviour_logprobs, advantage, **kw) -> bool (keep the sequence)
      (with an `action_mask` parameter it also gets the response's action_mask)
"""
from __future__ import annotations

import importlib
import inspect
import os
import sys
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class LossInputs:
    """Inputs of a policy loss on one micro-batch, all on one device.

    logprobs:           [B, T] the response tokens' log-probs under the current policy (grad).
    behaviour_logprobs: [B, T] their log-probs under the behaviour policy, recorded when the
                        explorer sampled them (no grad).
    advantages:         [B, T] each sequence's advantage broadcast over its tokens.
    mask:               [B, T] 1.0 on trained tokens (action_mask and not padding), else 0.0.
    rewards:            [B] each sequence's reward.
    group_index:        [B] int, shared by the sequences of a group (whole groups are
                        present when the loss has `needs_groups`).
    ref_logprobs:       [B, T] log-probs under the frozen reference policy, or None.
    expert:             [B] bool, True for expert (SFT) sequences mixed into the batch, or None.
    """

    logprobs: torch.Tensor
    behaviour_logprobs: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    rewards: torch.Tensor
    group_index: torch.Tensor
    ref_logprobs: torch.Tensor | None = None
    expert: torch.Tensor | None = None


# name -> function, or the import path of one in extras/, imported when a run names it
ADVANTAGES: dict[str, Callable | str] = {
    "dr_grpo": "extras.advantages.dr_grpo_advantages", "rloo": "extras.advantages.rloo_advantages",
    "reinforce_pp": "extras.advantages.reinforce_pp_advantages",
    "grpo_stepwise": "extras.advantages.stepwise_grpo_advantages", "opmd": "extras.opmd.opmd_advantages"}
POLICY_LOSSES: dict[str, Callable | str] = {
    "dppo_kl": "extras.policy_losses.dppo_kl_loss", "reinforce_tis": "extras.policy_losses.reinforce_tis_loss",
    "cispo": "extras.policy_losses.cispo_loss", "gspo": "extras.policy_losses.gspo_loss",
    "sft": "extras.policy_losses.sft_loss", "dpo": "extras.policy_losses.dpo_loss",
    "mix": "extras.policy_losses.mix_loss", "topr": "extras.topr.topr_loss",
    "opmd_kimi": "extras.opmd.opmd_kimi_loss", "opmd_pairwise": "extras.opmd.opmd_pairwise_loss",
    "opmd_simple": "extras.opmd.opmd_simple_loss"}
FILTERS: dict[str, Callable | str] = {
    "zero_advantage": "extras.filters.zero_advantage_filter", "gibberish": "extras.filters.gibberish_filter",
    "repetition": "extras.filters.repetition_filter"}
AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
KL_ESTIMATORS = ("k1", "k2", "k3", "low_var")


def register(registry: dict, name: str, agg: str = "token-mean", needs_groups: bool = False,
             needs_ref: bool = False, split_expert: bool = False):
    """Decorator: add a function to a registry under `name` with its loss attributes: `agg`
    (default aggregation), `needs_groups` (whole groups share a micro-batch), `needs_ref`
    (LossInputs.ref_logprobs is filled), `split_expert` (rollout and expert sequences are
    normalised separately: the trainer aggregates with `part_totals`)."""
    def wrap(fn):
        fn.agg, fn.needs_groups, fn.needs_ref, fn.split_expert = agg, needs_groups, needs_ref, split_expert
        registry[name] = fn
        return fn
    return wrap


def resolve(name: str, registry: dict, what: str, kwargs: dict | None = None) -> Callable:
    """The function registered as `name`, or imported from the path `module.function` (a
    registry entry may itself be such a path: a part in extras/, imported when asked for),
    checked to accept `kwargs`. Raises ValueError, one line naming the problem (unknown
    name, import failure, bad keyword)."""
    path = registry.get(name, name)
    if not isinstance(path, str):
        fn = path
    else:
        module, _, attr = path.rpartition(".")
        if not module:
            raise ValueError(f"unknown {what} {name!r}; known: {sorted(registry)} or module.function")
        try:
            fn = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"{what} {name!r} cannot be imported: {e} ({import_dirs()})") from None
        if not callable(fn):
            raise ValueError(f"{what} {name!r} is not callable")
    params = inspect.signature(fn).parameters
    if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
        bad = sorted(set(kwargs or {}) - set(params))
        if bad:
            raise ValueError(f"{what} {name!r} takes no argument(s) {bad}; it takes {sorted(params)}")
    return fn


def import_dirs() -> str:
    """Where an import path (`module.function`) is looked up, in order, for error lines:
    sys.path (nanorft's directory, PYTHONPATH, the installed packages, the working
    directory that run.main appends), the Python installation's entries named once."""
    installed = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    cwd, dirs = os.getcwd(), []
    for p in map(os.path.abspath, (p or "." for p in sys.path)):
        if any(p == x or p.startswith(x + os.sep) for x in installed):
            p = "the installed packages"
        elif p == cwd:
            p += " (the working directory)"
        if p not in dirs:
            dirs.append(p)
    return f"modules are looked up in {', '.join(dirs)}; add a module's directory to PYTHONPATH"


def accepts(fn: Callable, param: str) -> bool:
    """Whether `fn` has a parameter named `param` (optional inputs such as token_counts or action_mask)."""
    return param in inspect.signature(fn).parameters


# ----------------------------------------------------------------------------- aggregation

def masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of x where mask is 1. x, mask: [B, T] -> scalar."""
    return (x * mask).sum()


def group_stats(x: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-member (mean, unbiased std, count) of the group of each element.
    x: [B] float; index: [B] int in [0, G). Returns three [B] tensors. A group of one has
    mean 0 and std 1, so a lone sample keeps its raw reward (verl's convention,
    verl/trainer/ppo/core_algos.py compute_grpo_outcome_advantage @ b178a3c)."""
    G = int(index.max()) + 1
    onehot = torch.nn.functional.one_hot(index, G).to(x.dtype)             # [B, G]
    count = onehot.sum(0)                                                  # [G]
    mean = (onehot * x[:, None]).sum(0) / count                            # [G]
    dev = x - mean[index]                                                  # [B]
    var = (onehot * dev[:, None] ** 2).sum(0) / (count - 1).clamp(min=1)   # [G]
    single = count[index] == 1                                             # [B]
    return (torch.where(single, 0.0, mean[index]), torch.where(single, 1.0, var.sqrt()[index]),  # [B], [B]
            count[index])                                                                        # [B]


def seq_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked sum over tokens: [B, T] -> [B]."""
    return (x * mask).sum(-1)


def spread(per_seq: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Spread a per-sequence value evenly over its trained tokens: [B] -> [B, T], so that
    its masked token-sum equals the value. How sequence-level losses (GSPO's ratio, OPMD,
    DPO) become per-token ones: aggregated seq-mean-token-sum they give the mean over
    sequences, token-mean the sum over sequences / the batch's tokens."""
    return per_seq[:, None] * mask / mask.sum(-1, keepdim=True).clamp(min=1)


def _totals(total, like: torch.Tensor) -> torch.Tensor:
    """A global count (number, 0-d or [B] tensor) as a float tensor >= 1 on like's device."""
    return torch.as_tensor(total, dtype=like.dtype, device=like.device).clamp(min=1)


def aggregate(loss: torch.Tensor, mask: torch.Tensor, mode: str, total_tokens, total_seqs) -> torch.Tensor:
    """This micro-batch's share of the global loss. loss, mask: [B, T]; totals count the
    trained tokens / sequences of the whole global batch (all micro-batches, all ranks),
    so the shares add up to:
      token-mean:          sum of all token losses / total tokens (DAPO, arXiv:2503.14476, sec. 3.3)
      seq-mean-token-sum:  mean over sequences of each sequence's token sum
      seq-mean-token-mean: mean over sequences of each sequence's token mean (GRPO, arXiv:2402.03300)
    The modes are verl's agg_loss (verl/trainer/ppo/core_algos.py @ b178a3c). A total may
    also be a [B] tensor: each sequence's own denominator, the total of its part of the
    batch (`part_totals`), so that the parts are normalised separately (MIX).
    Raises ValueError for an unknown mode."""
    if mode == "token-mean":
        tokens = _totals(total_tokens, loss)                                # [] or [B]
        return (loss * mask / (tokens[:, None] if tokens.dim() else tokens)).sum()
    if mode == "seq-mean-token-sum":
        return (seq_sum(loss, mask) / _totals(total_seqs, loss)).sum()
    if mode == "seq-mean-token-mean":
        return (seq_sum(loss, mask) / mask.sum(-1).clamp(min=1) / _totals(total_seqs, loss)).sum()
    raise ValueError(f"unknown loss aggregation {mode!r}; known: {list(AGGREGATIONS)}")


def part_totals(token_counts: torch.Tensor, expert: torch.Tensor,
                keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Denominators for a `split_expert` loss (MIX): for each sequence of the global batch,
    the trained tokens and the number of kept sequences of its part (expert or rollout).
    token_counts [N] float, expert [N] bool, keep [N] bool (not filtered out) -> ([N], [N]).
    Passed (indexed by micro-batch) as the totals of `aggregate`."""
    kept = keep.to(token_counts.dtype)                                          # [N]
    is_exp = expert.to(token_counts.dtype)                                      # [N]
    tokens = torch.stack([(token_counts * kept * (1 - is_exp)).sum(), (token_counts * kept * is_exp).sum()])  # [2]
    seqs = torch.stack([(kept * (1 - is_exp)).sum(), (kept * is_exp).sum()])    # [2]
    part = expert.long()                                                        # [N]
    return tokens[part], seqs[part]


def length_penalty(rewards: torch.Tensor, lengths: torch.Tensor, coef: float) -> torch.Tensor:
    """Rewards minus `coef` per unit of length (tokens or turns). [B], [B] -> [B]."""
    return rewards - coef * lengths


# ----------------------------------------------------------------------------- GRPO + PPO clip + KL

@register(ADVANTAGES, "grpo")
def grpo_advantages(rewards, group_index, trajectory_index=None, eps: float = 1e-6):
    """GRPO outcome advantages: (r - mean_group) / (std_group + eps), unbiased std; a group
    of one keeps r / (1 + eps). [B] -> [B].
    Source: DeepSeekMath, arXiv:2402.03300, sec. 4.1.2. Reference: volcengine/verl
    verl/trainer/ppo/core_algos.py compute_grpo_outcome_advantage @ b178a3c."""
    mean, std, _ = group_stats(rewards, group_index)
    return (rewards - mean) / (std + eps)


def kl_estimate(logp: torch.Tensor, logq: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(p || q) from tokens sampled from p. [B, T] -> [B, T].

    With log r = logq - logp: k1 = -log r; k2 = (log r)^2 / 2; k3 = (r - 1) - log r with
    log r clamped to [-20, 20] and the result to [-10, 10]; low_var is verl's name for the
    same clamped k3. Source: J. Schulman, "Approximating KL divergence" (2020). Reference:
    volcengine/verl verl/trainer/ppo/core_algos.py kl_penalty_forward @ b178a3c.
    Raises ValueError for an unknown kind."""
    if kind == "k1":
        return logp - logq                                               # [B, T]
    if kind == "k2":
        return 0.5 * (logp - logq) ** 2                                  # [B, T]
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kind!r}; known: {', '.join(KL_ESTIMATORS)}")
    log_r = (logq - logp).clamp(-20, 20)                                 # [B, T]
    return (torch.expm1(log_r) - log_r).clamp(-10, 10)                   # [B, T]


def importance_ratio(inp: LossInputs) -> torch.Tensor:
    """exp(logprobs - behaviour_logprobs) [B, T], the log-ratio clamped to [-20, 20] as verl does."""
    return torch.exp((inp.logprobs - inp.behaviour_logprobs).clamp(-20, 20))  # [B, T]


@register(POLICY_LOSSES, "ppo_clip")
def ppo_clip_loss(inp: LossInputs, clip_low: float = 0.2, clip_high: float = 0.28, dual_clip: float | None = 3.0):
    """PPO clipped surrogate per token: -min(ratio A, clip(ratio, 1 - clip_low, 1 + clip_high) A),
    ratio = exp(logprobs - behaviour_logprobs). Dual clip (`dual_clip` = c > 1, verl's default 3;
    None turns it off): tokens with A < 0 are bounded by -c A. Returns {"loss", "clipped"
    (1.0 where a clipped term is active)}: [B, T].
    Source: PPO arXiv:1707.06347 eq. 7; clip-higher DAPO arXiv:2503.14476 sec. 3.1; dual clip
    Ye et al. arXiv:1912.09729 eq. 5. Reference: volcengine/verl verl/trainer/ppo/core_algos.py
    compute_policy_loss_vanilla @ b178a3c."""
    ratio = importance_ratio(inp)                                                  # [B, T]
    A = inp.advantages
    unclipped = ratio * A                                                # [B, T]
    clipped = torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * A        # [B, T]
    loss = -torch.minimum(unclipped, clipped)                            # [B, T]
    active = clipped < unclipped                                         # [B, T]
    if dual_clip is not None:
        dual = (A < 0) & (loss > -dual_clip * A)                         # [B, T]
        loss = torch.where(dual, -dual_clip * A, loss)
        active = active | dual
    return {"loss": loss, "clipped": active.float()}


