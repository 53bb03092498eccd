"""Pure tensor functions of RFT: advantages, policy losses, KL, entropy, filters.

No model, no process group, no I/O: every function takes tensors (or token lists) and
returns tensors, so each can be checked against a slow reference on small inputs. Shapes:
B = sequences in a (micro-)batch, T = response tokens (right-padded).

Contracts (also for plug-ins given by import path, `module.function`, with kwargs from the
config; see README "Custom losses"):

  ADVANTAGES[name](rewards [B], group_index [B], trajectory_index [B], **kw) -> advantages [B]
      group_index: rollouts of one task share it (0..G-1); trajectory_index: the samples
      of one multi-turn trajectory share it (= arange(B) for single-turn).
  POLICY_LOSSES[name](LossInputs, **kw) -> dict of per-token tensors [B, T]:
      "loss" (required) and any extra per-token metric (reported as loss/<key>, token-mean).
      Attributes set by `register`: `agg` (default aggregation), `needs_groups` (whole
      groups must share a micro-batch), `needs_ref` (LossInputs.ref_logprobs is filled).
  FILTERS[name](tokens, logprobs, advantage, **kw) -> bool (keep this sequence)

The trainer turns per-token losses into one scalar with `aggregate` (token-mean,
sequence-mean-token-sum or sequence-mean-token-mean over the whole global batch).
Sequence- and group-level losses (GSPO's ratio, OPMD, DPO) spread each sequence's loss
evenly over its tokens, so "seq-mean-token-sum" gives the mean over sequences.
"""
from __future__ import annotations

import importlib
import inspect
import math
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class LossInputs:
    """Inputs of a policy loss on one micro-batch, all on one device.

    logprobs:      [B, T] log-probs of the response tokens under the current policy (grad).
    old_logprobs:  [B, T] behaviour-policy log-probs recorded by the explorer (no grad).
    advantages:    [B, T] the sequence advantage broadcast over its tokens.
    mask:          [B, T] 1.0 on trained tokens (action_mask and not padding), else 0.0.
    rewards:       [B] scalar reward of each sequence.
    group_index:   [B] int, sequences of one group share it (whole groups are present
                   when the loss has `needs_groups`).
    ref_logprobs:  [B, T] log-probs under the frozen reference model, or None.
    expert:        [B] bool, True for expert (SFT) data mixed into the batch, or None.
    """

    logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    rewards: torch.Tensor
    group_index: torch.Tensor
    ref_logprobs: torch.Tensor | None = None
    expert: torch.Tensor | None = None


ADVANTAGES: dict[str, Callable] = {}
POLICY_LOSSES: dict[str, Callable] = {}
FILTERS: dict[str, Callable] = {}
AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")


def register(registry: dict, name: str, agg: str = "token-mean", needs_groups: bool = False,
             needs_ref: bool = False):
    """Decorator: add a function to a registry under `name` with its loss attributes."""
    def wrap(fn):
        fn.agg, fn.needs_groups, fn.needs_ref = agg, needs_groups, needs_ref
        registry[name] = fn
        return fn
    return wrap


def resolve(name: str, registry: dict, what: str, kwargs: dict | None = None) -> Callable:
    """The function registered as `name`, or imported from the path `module.function`.

    Checks that `kwargs` are accepted by it. Raises ValueError with one line naming the
    problem (unknown name, import failure, bad keyword)."""
    if name in registry:
        fn = registry[name]
    else:
        module, _, attr = name.rpartition(".")
        if not module:
            raise ValueError(f"unknown {what} {name!r}; known: {sorted(registry)} or module.function")
        try:
            fn = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"{what} {name!r} cannot be imported: {e}") from None
        if not callable(fn):
            raise ValueError(f"{what} {name!r} is not callable")
    params = inspect.signature(fn).parameters
    if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
        bad = sorted(set(kwargs or {}) - set(params))
        if bad:
            raise ValueError(f"{what} {name!r} takes no argument(s) {bad}; it takes {sorted(params)}")
    return fn


# ----------------------------------------------------------------------------- helpers

def masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of x where mask is 1. x, mask: [B, T] -> scalar."""
    return (x * mask).sum()


def group_stats(x: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-member (mean, unbiased std, count) of the group of each element.
    x: [B] float; index: [B] int in [0, G). Returns three [B] tensors (std 0 for groups of one)."""
    G = int(index.max()) + 1
    onehot = torch.nn.functional.one_hot(index, G).to(x.dtype)             # [B, G]
    count = onehot.sum(0)                                                  # [G]
    mean = (onehot * x[:, None]).sum(0) / count                            # [G]
    dev = x - mean[index]                                                  # [B]
    var = (onehot * dev[:, None] ** 2).sum(0) / (count - 1).clamp(min=1)   # [G]
    return mean[index], var.sqrt()[index], count[index]


def seq_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked sum over tokens: [B, T] -> [B]."""
    return (x * mask).sum(-1)


def spread(per_seq: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Spread a per-sequence value evenly over its trained tokens: [B] -> [B, T], so that
    its masked token-sum equals the value."""
    return per_seq[:, None] * mask / mask.sum(-1, keepdim=True).clamp(min=1)


def aggregate(loss: torch.Tensor, mask: torch.Tensor, mode: str, total_tokens: float, total_seqs: float) -> torch.Tensor:
    """This micro-batch's share of the global loss. loss, mask: [B, T]; totals count the
    trained tokens / sequences of the whole global batch (all micro-batches, all ranks),
    so the shares add up to:
      token-mean:          sum of all token losses / total tokens (DAPO, arXiv:2503.14476, sec. 3.3)
      seq-mean-token-sum:  mean over sequences of each sequence's token sum
      seq-mean-token-mean: mean over sequences of each sequence's token mean (GRPO, arXiv:2402.03300)
    Raises ValueError for an unknown mode."""
    if mode == "token-mean":
        return masked_sum(loss, mask) / max(total_tokens, 1)
    if mode == "seq-mean-token-sum":
        return seq_sum(loss, mask).sum() / max(total_seqs, 1)
    if mode == "seq-mean-token-mean":
        return (seq_sum(loss, mask) / mask.sum(-1).clamp(min=1)).sum() / max(total_seqs, 1)
    raise ValueError(f"unknown loss aggregation {mode!r}; known: {list(AGGREGATIONS)}")


def length_penalty(rewards: torch.Tensor, lengths: torch.Tensor, coef: float) -> torch.Tensor:
    """Rewards minus `coef` per unit of length (tokens or turns). [B], [B] -> [B]."""
    return rewards - coef * lengths


# ----------------------------------------------------------------------------- advantages

@register(ADVANTAGES, "grpo")
def grpo_advantages(rewards, group_index, trajectory_index=None, eps: float = 1e-6):
    """GRPO outcome advantages: (r - mean_group) / (std_group + eps). [B] -> [B].
    Unbiased sample std (0 for groups of one). Source: DeepSeekMath, arXiv:2402.03300, sec. 4.1.2."""
    mean, std, _ = group_stats(rewards, group_index)
    return (rewards - mean) / (std + eps)


@register(ADVANTAGES, "dr_grpo")
def dr_grpo_advantages(rewards, group_index, trajectory_index=None):
    """Dr. GRPO: r - mean_group, no std division (prime-rl's default). [B] -> [B].
    Source: Liu et al., "Understanding R1-Zero-Like Training", arXiv:2503.20783, sec. 3.2."""
    mean, _, _ = group_stats(rewards, group_index)
    return rewards - mean


@register(ADVANTAGES, "rloo")
def rloo_advantages(rewards, group_index, trajectory_index=None):
    """RLOO: r_i - mean of the other members of its group = K/(K-1) (r_i - mean_group);
    0 for groups of one. [B] -> [B]. Source: Ahmadian et al., arXiv:2402.14740, eq. 10."""
    mean, _, count = group_stats(rewards, group_index)
    return torch.where(count > 1, (rewards - mean) * count / (count - 1).clamp(min=1), torch.zeros_like(rewards))


@register(ADVANTAGES, "reinforce_pp")
def reinforce_pp_advantages(rewards, group_index, trajectory_index=None, group_baseline: bool = True, eps: float = 1e-6):
    """REINFORCE++ batch normalisation: subtract the group mean (the "-baseline" variant,
    optional), then normalise by the mean and std of the whole batch. [B] -> [B].
    Source: Hu, "REINFORCE++", arXiv:2501.03262, sec. 3."""
    adv = rewards - group_stats(rewards, group_index)[0] if group_baseline else rewards
    return (adv - adv.mean()) / (adv.std() + eps) if len(adv) > 1 else adv - adv.mean()


@register(ADVANTAGES, "opmd")
def opmd_advantages(rewards, group_index, trajectory_index=None, baseline: str = "mean", tau: float = 1.0):
    """OPMD advantages: r - b with the group baseline b = mean(r) ("mean") or
    tau * log(mean(exp(r / tau))) ("logavgexp", the tau log Z of the KL-regularised optimum).
    [B] -> [B]. Source: Trinity-RFT technical report, arXiv:2505.17826, appendix A."""
    if baseline == "mean":
        return rewards - group_stats(rewards, group_index)[0]
    if baseline != "logavgexp":
        raise ValueError(f"opmd baseline must be mean or logavgexp, got {baseline!r}")
    return rewards - logavgexp_baseline(rewards, group_index, tau)


def logavgexp_baseline(rewards: torch.Tensor, group_index: torch.Tensor, tau: float) -> torch.Tensor:
    """tau * log(mean_group(exp(r / tau))) of each member's group. [B] -> [B]."""
    G = int(group_index.max()) + 1
    scaled = rewards / tau                                                               # [B]
    top = torch.full((G,), -math.inf, dtype=rewards.dtype).scatter_reduce(0, group_index, scaled, "amax")  # [G]
    sums = torch.zeros(G, dtype=rewards.dtype).index_add(0, group_index, torch.exp(scaled - top[group_index]))
    count = torch.zeros(G, dtype=rewards.dtype).index_add(0, group_index, torch.ones_like(rewards))
    return (tau * (top + torch.log(sums / count)))[group_index]                           # [B]


@register(ADVANTAGES, "grpo_stepwise")
def stepwise_grpo_advantages(rewards, group_index, trajectory_index, eps: float = 1e-6):
    """Step-wise GRPO for multi-turn: each trajectory (one or more samples with the same
    trajectory_index, reward = its final reward, taken from its last sample) counts once
    in its group's mean/std, and every sample of the trajectory gets that advantage.
    [B] -> [B]. Source: Trinity-RFT step-wise GRPO (arXiv:2505.17826, sec. 2.2)."""
    T = int(trajectory_index.max()) + 1
    last = torch.zeros(T, dtype=torch.long).scatter_reduce(
        0, trajectory_index, torch.arange(len(rewards)), "amax", include_self=False)   # [T]
    adv = grpo_advantages(rewards[last], group_index[last], eps=eps)                      # [T]
    return adv[trajectory_index]                                                          # [B]


# ----------------------------------------------------------------------------- regularisers

def kl_estimate(logp: torch.Tensor, logq: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(p || q) from tokens sampled from p. [B, T] -> [B, T].

    With log r = logq - logp: k1 = -log r; k2 = (log r)^2 / 2; k3 = (r - 1) - log r (>= 0);
    low_var = k3 with log r clamped to [-10, 10] (verl's low_var_kl).
    Source: J. Schulman, "Approximating KL divergence" (2020). Raises ValueError for an unknown kind."""
    log_r = logq - logp                                                  # [B, T]
    if kind == "k1":
        return -log_r
    if kind == "k2":
        return 0.5 * log_r ** 2
    if kind == "low_var":
        log_r = log_r.clamp(-10, 10)
    elif kind != "k3":
        raise ValueError(f"unknown KL estimator {kind!r}; known: k1, k2, k3, low_var")
    return torch.expm1(log_r) - log_r


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of the next-token distribution. logits [B, T, V] -> [B, T]."""
    logz = torch.logsumexp(logits, -1)                                  # [B, T]
    return logz - (torch.softmax(logits, -1) * logits).sum(-1)          # [B, T]


# ----------------------------------------------------------------------------- policy losses

def _ratio(inp: LossInputs) -> tuple[torch.Tensor, torch.Tensor]:
    log_ratio = inp.logprobs - inp.old_logprobs                         # [B, T]
    return log_ratio, torch.exp(log_ratio)


@register(POLICY_LOSSES, "ppo_clip")
def ppo_clip_loss(inp: LossInputs, clip_low: float = 0.2, clip_high: float = 0.28, dual_clip: float | None = None):
    """PPO clipped surrogate per token: -min(ratio A, clip(ratio, 1 - clip_low, 1 + clip_high) A),
    ratio = exp(logprobs - old_logprobs). With `dual_clip` = c > 1, tokens with A < 0 are
    bounded by -c A. Returns {"loss", "clipped" (1.0 where the clipped term is active)}: [B, T].
    Source: PPO arXiv:1707.06347 eq. 7; clip-higher DAPO arXiv:2503.14476 sec. 3.1;
    dual clip Ye et al. arXiv:1912.09729 eq. 5."""
    _, ratio = _ratio(inp)
    A = inp.advantages
    unclipped = ratio * A                                                # [B, T]
    clipped = torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * A        # [B, T]
    loss = -torch.minimum(unclipped, clipped)                            # [B, T]
    active = clipped < unclipped
    if dual_clip is not None:
        dual = (A < 0) & (loss > -dual_clip * A)
        loss = torch.where(dual, -dual_clip * A, loss)
        active = active | dual
    return {"loss": loss, "clipped": active.float()}


@register(POLICY_LOSSES, "dppo_kl")
def dppo_kl_loss(inp: LossInputs, dppo_mask_low: float = 0.125, dppo_mask_high: float = 8.0, kl_tau: float = 1e-3):
    """prime-rl's default loss: -ratio A on tokens whose importance ratio lies inside
    [dppo_mask_low, dppo_mask_high] (masked, not clipped, outside), plus kl_tau (log ratio)^2
    on every token. Returns {"loss", "masked" (1.0 outside the range)}: [B, T].
    Source: prime-rl, src/prime_rl/trainer/rl/loss.py (masked importance sampling)."""
    log_ratio, ratio = _ratio(inp)
    outside = (ratio < dppo_mask_low) | (ratio > dppo_mask_high)        # [B, T]
    loss = torch.where(outside, torch.zeros_like(ratio), -ratio * inp.advantages) + kl_tau * log_ratio ** 2
    return {"loss": loss, "masked": outside.float()}


@register(POLICY_LOSSES, "reinforce_tis")
def reinforce_tis_loss(inp: LossInputs, tis_cap: float = 2.0):
    """REINFORCE with truncated, detached importance weights: -min(ratio, tis_cap).detach() A logprobs.
    Returns {"loss", "truncated"}: [B, T]. Source: PipelineRL (Piché et al., arXiv:2509.19128,
    sec. 3), truncated IS as in IMPALA (arXiv:1802.01561)."""
    _, ratio = _ratio(inp)
    w = ratio.detach().clamp(max=tis_cap)                               # [B, T]
    return {"loss": -w * inp.advantages * inp.logprobs, "truncated": (ratio.detach() > tis_cap).float()}


@register(POLICY_LOSSES, "cispo")
def cispo_loss(inp: LossInputs, clip_low: float = 1.0, clip_high: float = 0.28):
    """CISPO: -sg(clip(ratio, 1 - clip_low, 1 + clip_high)) A logprobs: the IS weight is
    clipped and detached, every token keeps a gradient. Returns {"loss", "clipped"}: [B, T].
    Source: MiniMax-M1, arXiv:2506.13585, eq. 4-5."""
    _, ratio = _ratio(inp)
    w = ratio.detach().clamp(1 - clip_low, 1 + clip_high)                # [B, T]
    return {"loss": -w * inp.advantages * inp.logprobs, "clipped": (w != ratio.detach()).float()}


@register(POLICY_LOSSES, "gspo", agg="seq-mean-token-mean")
def gspo_loss(inp: LossInputs, clip_low: float = 3e-4, clip_high: float = 4e-4):
    """GSPO: sequence-level ratio s = exp(mean_t(logprobs - old_logprobs)), used per token
    as sg(s) exp(logprobs - sg(logprobs)) inside the PPO clip. Returns {"loss", "clipped"}: [B, T].
    Source: Zheng et al., arXiv:2507.18071, eq. 5-7 (GSPO-token)."""
    log_ratio = inp.logprobs - inp.old_logprobs                                            # [B, T]
    seq_log_ratio = seq_sum(log_ratio, inp.mask) / inp.mask.sum(-1).clamp(min=1)           # [B]
    s = torch.exp(seq_log_ratio.detach()[:, None] + inp.logprobs - inp.logprobs.detach())  # [B, T]
    A = inp.advantages
    clipped = torch.clamp(s, 1 - clip_low, 1 + clip_high) * A
    return {"loss": -torch.minimum(s * A, clipped), "clipped": (clipped < s * A).float()}


@register(POLICY_LOSSES, "topr")
def topr_loss(inp: LossInputs):
    """TOPR: sequences with A >= 0 get the plain SFT-like term -A logprobs (no IS weight);
    sequences with A < 0 get -clip(ratio, 0, 1).detach() A logprobs. Returns {"loss",
    "truncated"}: [B, T]. Source: Le Roux et al., "Tapered Off-Policy REINFORCE", arXiv:2503.14286, eq. 9."""
    _, ratio = _ratio(inp)
    neg = inp.advantages < 0
    w = torch.where(neg, ratio.detach().clamp(max=1.0), torch.ones_like(ratio))         # [B, T]
    return {"loss": -w * inp.advantages * inp.logprobs, "truncated": (neg & (ratio.detach() > 1)).float()}


def _seq_log_ratio(inp: LossInputs) -> torch.Tensor:
    return seq_sum(inp.logprobs - inp.old_logprobs, inp.mask)           # [B]


@register(POLICY_LOSSES, "opmd_kimi", agg="seq-mean-token-sum", needs_groups=True)
def opmd_kimi_loss(inp: LossInputs, tau: float = 1.0):
    """Kimi k1.5 online policy mirror descent: per sequence (r - tau log Z - tau log(pi/pi_old))^2,
    tau log Z = tau log mean_group exp(r / tau), log(pi/pi_old) summed over the sequence.
    Returns {"loss"}: [B, T] (the sequence loss spread over its tokens).
    Source: Kimi k1.5, arXiv:2501.12599, sec. 2.3.2, eq. 3."""
    log_z = logavgexp_baseline(inp.rewards, inp.group_index, tau)                     # [B]
    per_seq = (inp.rewards - log_z - tau * _seq_log_ratio(inp)) ** 2                  # [B]
    return {"loss": spread(per_seq, inp.mask)}


@register(POLICY_LOSSES, "opmd_pairwise", agg="seq-mean-token-sum", needs_groups=True)
def opmd_pairwise_loss(inp: LossInputs, tau: float = 1.0):
    """Pairwise OPMD: with a_i = r_i - tau log(pi/pi_old)(y_i), the optimum's consistency
    a_i = tau log Z holds for every i, so tau log Z cancels in pairs: sequence i's loss is
    1/(2K) sum_j in group (a_i - a_j)^2 (the group mean of these is 1/(2K^2) sum_ij).
    Returns {"loss"}: [B, T]. Source: Trinity-RFT report, arXiv:2505.17826, appendix A."""
    a = inp.rewards - tau * _seq_log_ratio(inp)                                         # [B]
    same = (inp.group_index[:, None] == inp.group_index[None, :]).to(a.dtype)         # [B, B]
    k = same.sum(-1)                                                                    # [B]
    per_seq = (same * (a[:, None] - a[None, :]) ** 2).sum(-1) / (2 * k)                 # [B]
    return {"loss": spread(per_seq, inp.mask)}


@register(POLICY_LOSSES, "opmd_simple")
def opmd_simple_loss(inp: LossInputs, tau: float = 1.0):
    """Simple OPMD variant: -A logprobs / (1 + tau) with A from the "opmd" advantage (group
    mean baseline): the mirror-descent step regularised towards the current policy, whose
    gradient is the group-mean-baseline policy gradient scaled by 1 / (1 + tau).
    Returns {"loss"}: [B, T]. Source: Trinity-RFT report, arXiv:2505.17826, appendix A."""
    return {"loss": -inp.advantages * inp.logprobs / (1 + tau)}


@register(POLICY_LOSSES, "sft")
def sft_loss(inp: LossInputs):
    """Supervised fine-tuning: negative log-likelihood -logprobs of every trained token.
    Returns {"loss"}: [B, T]."""
    return {"loss": -inp.logprobs}


@register(POLICY_LOSSES, "dpo", agg="seq-mean-token-sum", needs_groups=True, needs_ref=True)
def dpo_loss(inp: LossInputs, beta: float = 0.1):
    """DPO on each group's best (chosen) and worst (rejected) sequence by reward:
    -log sigmoid(beta ((log pi - log pi_ref)(chosen) - (log pi - log pi_ref)(rejected))),
    sequence log-probs summed over tokens; a group without a reward gap has no pair. Both
    sequences of a pair carry the pair loss, every other sequence 0. Returns {"loss",
    "pair_correct" (1.0 on the tokens of pairs whose implicit reward margin is > 0)}: [B, T].
    Source: Rafailov et al., arXiv:2305.18290, eq. 7."""
    if inp.ref_logprobs is None:
        raise ValueError("dpo needs ref_logprobs (a reference model)")
    logit = beta * seq_sum(inp.logprobs - inp.ref_logprobs, inp.mask)                # [B]
    per_seq = torch.zeros_like(logit)                                                 # [B]
    correct = torch.zeros_like(logit)                                                 # [B]
    for g in inp.group_index.unique():
        members = (inp.group_index == g).nonzero().squeeze(-1)
        r = inp.rewards[members]
        if r.max() > r.min():  # first best and first worst member: the pair
            c, w = members[r.argmax()], members[r.argmin()]
            margin = logit[c] - logit[w]
            per_seq[c] = per_seq[w] = -torch.nn.functional.logsigmoid(margin)
            correct[c] = correct[w] = float(margin.detach() > 0)
    return {"loss": spread(per_seq, inp.mask), "pair_correct": correct[:, None].expand_as(inp.mask)}


@register(POLICY_LOSSES, "mix")
def mix_loss(inp: LossInputs, mu: float = 0.1, clip_low: float = 0.2, clip_high: float = 0.28):
    """MIX: (1 - mu) PPO-clip/GRPO on the rollouts + mu SFT on the expert sequences
    (inp.expert). Returns {"loss", "clipped", "expert" (1.0 on expert tokens)}: [B, T].
    Source: Trinity-RFT MIX algorithm (arXiv:2505.17826, sec. 3; examples/mix_math)."""
    expert = (inp.expert if inp.expert is not None else torch.zeros(len(inp.mask), dtype=torch.bool))[:, None]
    ppo = ppo_clip_loss(inp, clip_low=clip_low, clip_high=clip_high)
    loss = torch.where(expert, mu * -inp.logprobs, (1 - mu) * ppo["loss"])
    return {"loss": loss, "clipped": ppo["clipped"] * ~expert, "expert": expert.float().expand_as(loss)}


# ----------------------------------------------------------------------------- filters

@register(FILTERS, "zero_advantage")
def zero_advantage_filter(tokens: list[int], logprobs: list[float], advantage: float, eps: float = 1e-8) -> bool:
    """Keep sequences whose advantage is not (numerically) zero: they carry no policy gradient."""
    return abs(advantage) > eps


@register(FILTERS, "gibberish")
def gibberish_filter(tokens: list[int], logprobs: list[float], advantage: float, min_mean_logprob: float = -6.0) -> bool:
    """Keep sequences whose mean behaviour log-prob per token is at least `min_mean_logprob`
    (nats): very unlikely token streams are usually gibberish."""
    return not logprobs or sum(logprobs) / len(logprobs) >= min_mean_logprob


@register(FILTERS, "repetition")
def repetition_filter(tokens: list[int], logprobs: list[float], advantage: float, ngram: int = 4,
                      max_repeat_frac: float = 0.5) -> bool:
    """Keep responses (the last len(logprobs) tokens) in which at most `max_repeat_frac` of
    the `ngram`-grams are repeats of an earlier n-gram."""
    resp = tokens[len(tokens) - len(logprobs):]
    grams = [tuple(resp[i:i + ngram]) for i in range(len(resp) - ngram + 1)]
    return not grams or (len(grams) - len(set(grams))) / len(grams) <= max_repeat_frac
