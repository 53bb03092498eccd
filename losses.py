"""Pure tensor functions of RFT: advantages, policy losses, KL, entropy, filters.

No model, no process group, no I/O: every function takes tensors (or token lists) and
returns tensors, so each can be checked against a slow reference on small inputs. Shapes:
B = sequences in a (micro-)batch, T = response tokens (right-padded).

Every estimator and loss names its source twice in its docstring: the paper (section) and
the reference implementation it was checked against (repository, file, commit), and
tests/test_fidelity.py pins it to numbers produced by that reference's code.

Contracts (also for plug-ins given by import path, `module.function`, with kwargs from the
config; see README "Custom losses"):

  ADVANTAGES[name](rewards [B], group_index [B], trajectory_index [B], **kw) -> advantages [B]
      group_index: rollouts of one task share it (0..G-1); trajectory_index: the samples
      of one multi-turn trajectory share it (= arange(B) for single-turn). An estimator
      with a `token_counts` parameter also gets the trained tokens of each sequence [B]
      (REINFORCE++ whitens over tokens).
  POLICY_LOSSES[name](LossInputs, **kw) -> dict of per-token tensors [B, T]:
      "loss" (required) and any extra per-token metric (reported as loss/<key>, token-mean).
      Attributes set by `register`: `agg` (default aggregation), `needs_groups` (whole
      groups must share a micro-batch), `needs_ref` (LossInputs.ref_logprobs is filled),
      `split_expert` (rollout and expert sequences are normalised separately: aggregate
      the loss with the per-sequence totals of `part_totals`, MIX).
  FILTERS[name](tokens, behaviour_logprobs, advantage, **kw) -> bool (keep this sequence);
      a filter with an `action_mask` parameter also gets the response's action_mask [R]
      (behaviour_logprobs are placeholders where it is 0: environment tokens).

The trainer turns per-token losses into one scalar with `aggregate` (token-mean,
sequence-mean-token-sum or sequence-mean-token-mean over the whole global batch, or over
each sequence's part of it when the totals are per-sequence). Sequence- and group-level
losses (GSPO's ratio, OPMD, DPO) spread each sequence's loss evenly over its tokens, so
"seq-mean-token-sum" gives the mean over sequences and "token-mean" the sum over
sequences divided by the batch's tokens.
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

    logprobs:           [B, T] log-probs of the response tokens under the current policy (grad).
    behaviour_logprobs: [B, T] log-probs under the behaviour policy, recorded by the explorer
                        when it sampled the tokens (no grad).
    advantages:         [B, T] the sequence advantage broadcast over its tokens.
    mask:               [B, T] 1.0 on trained tokens (action_mask and not padding), else 0.0.
    rewards:            [B] scalar reward of each sequence.
    group_index:        [B] int, sequences of one group share it (whole groups are present
                        when the loss has `needs_groups`).
    ref_logprobs:       [B, T] log-probs under the frozen reference model, or None.
    expert:             [B] bool, True for expert (SFT) data mixed into the batch, or None.
    """

    logprobs: torch.Tensor
    behaviour_logprobs: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    rewards: torch.Tensor
    group_index: torch.Tensor
    ref_logprobs: torch.Tensor | None = None
    expert: torch.Tensor | None = None


# name -> function; the less common ones (extras/) by import path, imported when a run names them
ADVANTAGES: dict[str, Callable | str] = {"opmd": "extras.opmd.opmd_advantages"}
POLICY_LOSSES: dict[str, Callable | str] = {"topr": "extras.topr.topr_loss", "opmd_kimi": "extras.opmd.opmd_kimi_loss",
                                            "opmd_pairwise": "extras.opmd.opmd_pairwise_loss",
                                            "opmd_simple": "extras.opmd.opmd_simple_loss"}
FILTERS: dict[str, Callable] = {}
AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
KL_ESTIMATORS = ("k1", "k2", "k3", "low_var")


def register(registry: dict, name: str, agg: str = "token-mean", needs_groups: bool = False,
             needs_ref: bool = False, split_expert: bool = False):
    """Decorator: add a function to a registry under `name` with its loss attributes."""
    def wrap(fn):
        fn.agg, fn.needs_groups, fn.needs_ref, fn.split_expert = agg, needs_groups, needs_ref, split_expert
        registry[name] = fn
        return fn
    return wrap


def resolve(name: str, registry: dict, what: str, kwargs: dict | None = None) -> Callable:
    """The function registered as `name`, or imported from the path `module.function`; a
    registry entry may itself be such a path (an optional part in extras/, imported only
    when asked for).

    Checks that `kwargs` are accepted by it. Raises ValueError with one line naming the
    problem (unknown name, import failure, bad keyword)."""
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


# ----------------------------------------------------------------------------- helpers

def left_pad(seqs: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token lists left-padded with `pad` to the longest: input_ids, attention_mask and
    position_ids, each [B, P] long (positions count real tokens only, pads get 0): the
    model input of the explorer's prompts and of the trainer's prompt region."""
    B, P = len(seqs), max(map(len, seqs))
    ids = torch.full((B, P), pad, dtype=torch.long)
    attn = torch.zeros((B, P), dtype=torch.long)
    for b, s in enumerate(seqs):
        if s:
            ids[b, P - len(s):] = torch.tensor(s)
            attn[b, P - len(s):] = 1
    return ids, attn, position_ids(attn)


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position of each token among the real tokens of its row: [B, T] -> [B, T] (pads 0)."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


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
    its masked token-sum equals the value."""
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


# ----------------------------------------------------------------------------- advantages

@register(ADVANTAGES, "grpo")
def grpo_advantages(rewards, group_index, trajectory_index=None, eps: float = 1e-6):
    """GRPO outcome advantages: (r - mean_group) / (std_group + eps), unbiased std; a group
    of one keeps r / (1 + eps). [B] -> [B].
    Source: DeepSeekMath, arXiv:2402.03300, sec. 4.1.2. Reference: volcengine/verl
    verl/trainer/ppo/core_algos.py compute_grpo_outcome_advantage @ b178a3c."""
    mean, std, _ = group_stats(rewards, group_index)
    return (rewards - mean) / (std + eps)


@register(ADVANTAGES, "dr_grpo")
def dr_grpo_advantages(rewards, group_index, trajectory_index=None):
    """Dr. GRPO: r - mean_group, no std division (prime-rl's default); a group of one keeps
    r (prime-rl gives it 0). [B] -> [B].
    Source: Liu et al., "Understanding R1-Zero-Like Training", arXiv:2503.20783, sec. 3.2.
    Reference: volcengine/verl verl/trainer/ppo/core_algos.py compute_grpo_outcome_advantage
    (norm_adv_by_std_in_grpo=False) @ b178a3c; PrimeIntellect-ai/prime-rl
    src/prime_rl/orchestrator/algo/grpo.py @ 559b447."""
    return rewards - group_stats(rewards, group_index)[0]


@register(ADVANTAGES, "rloo")
def rloo_advantages(rewards, group_index, trajectory_index=None):
    """RLOO: r_i - mean of the other members of its group = K/(K-1) (r_i - mean_group); a
    group of one keeps r. [B] -> [B]. Source: Ahmadian et al., arXiv:2402.14740, eq. 10.
    Reference: volcengine/verl verl/trainer/ppo/core_algos.py compute_rloo_outcome_advantage @ b178a3c."""
    mean, _, count = group_stats(rewards, group_index)
    return torch.where(count > 1, (rewards - mean) * count / (count - 1).clamp(min=1), rewards)  # [B]


@register(ADVANTAGES, "reinforce_pp")
def reinforce_pp_advantages(rewards, group_index, trajectory_index=None, group_baseline: bool = True,
                            token_counts: torch.Tensor | None = None, eps: float = 1e-8):
    """REINFORCE++: subtract the group mean (the "-baseline" variant, optional; a group of
    one keeps r), then whiten over the batch's tokens: (x - mean) / sqrt(var + eps) with the
    token-weighted mean and unbiased variance (each sequence weighs its `token_counts`
    [B]; equal weights when None). [B] -> [B].
    Source: Hu, "REINFORCE++", arXiv:2501.03262, sec. 3. Reference: volcengine/verl
    verl/trainer/ppo/core_algos.py compute_reinforce_plus_plus_baseline_outcome_advantage and
    compute_reinforce_plus_plus_outcome_advantage (gamma 1), verl/utils/torch_functional.py
    masked_whiten @ b178a3c."""
    adv = rewards - group_stats(rewards, group_index)[0] if group_baseline else rewards     # [B]
    w = torch.ones_like(adv) if token_counts is None else token_counts.to(adv.dtype)       # [B]
    n = w.sum()                                                                            # []
    mean = (w * adv).sum() / n.clamp(min=1)                                                # []
    var = (w * (adv - mean) ** 2).sum() / (n - 1).clamp(min=1)                             # []
    return (adv - mean) * torch.rsqrt(var + eps)                                           # [B]


@register(ADVANTAGES, "grpo_stepwise")
def stepwise_grpo_advantages(rewards, group_index, trajectory_index, eps: float = 1e-6):
    """Step-wise GRPO for multi-turn: each trajectory (one or more samples with the same
    trajectory_index, reward = its final reward, taken from its last sample) counts once
    in its group's mean/std, and every sample of the trajectory gets that advantage; a
    group of one trajectory keeps r / (1 + eps). [B] -> [B].
    Source: Trinity-RFT step-wise GRPO (arXiv:2505.17826, sec. 2.2). Reference:
    modelscope/Trinity-RFT trinity/algorithm/advantage_fn/multi_step_grpo_advantage.py @ 369bf62."""
    T = int(trajectory_index.max()) + 1
    last = torch.zeros(T, dtype=torch.long, device=rewards.device).scatter_reduce(
        0, trajectory_index, torch.arange(len(rewards), device=rewards.device), "amax", include_self=False)  # [T]
    adv = grpo_advantages(rewards[last], group_index[last], eps=eps)                      # [T]
    return adv[trajectory_index]                                                          # [B]


# ----------------------------------------------------------------------------- regularisers

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


# ----------------------------------------------------------------------------- policy losses

def _ratio(inp: LossInputs) -> torch.Tensor:
    """Importance ratio exp(logprobs - behaviour_logprobs) [B, T], the log-ratio clamped to
    [-20, 20] as verl does."""
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
    ratio = _ratio(inp)                                                  # [B, T]
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


@register(POLICY_LOSSES, "dppo_kl")
def dppo_kl_loss(inp: LossInputs, dppo_mask_low: float = 0.2, dppo_mask_high: float = 0.2, adv_tau: float = 1.0,
                 kl_tau: float = 1e-3):
    """prime-rl's default loss, DPPO-Binary-TV + KL: -ratio adv_tau A on the tokens inside
    the trust region, plus kl_tau (log ratio)^2 on every token. The trust region is the
    difference of probabilities d = exp(logprobs) - exp(behaviour_logprobs), checked on the side
    the update pushes: a token with A > 0 is masked when d > dppo_mask_high, any other
    when d < -dppo_mask_low. Returns {"loss", "masked" (1.0 on masked tokens)}: [B, T].
    Source: Qi et al., "Rethinking the Trust Region in LLM RL" (DPPO), arXiv:2602.04879
    (Binary-TV approximation); the squared log-ratio term: Kimi K2.5, arXiv:2602.02276.
    Reference: PrimeIntellect-ai/prime-rl src/prime_rl/trainer/rl/loss.py default_loss_fn and
    packages/prime-rl-configs/src/prime_rl/configs/trainer.py DefaultLossConfig @ 559b447."""
    log_ratio = inp.logprobs - inp.behaviour_logprobs                                     # [B, T]
    diff = torch.exp(inp.logprobs) - torch.exp(inp.behaviour_logprobs)                    # [B, T]
    masked = torch.where(inp.advantages > 0, diff > dppo_mask_high, diff < -dppo_mask_low)  # [B, T]
    pg = torch.where(masked, 0.0, adv_tau * inp.advantages * torch.exp(log_ratio))        # [B, T]
    return {"loss": -pg + kl_tau * log_ratio ** 2, "masked": masked.float()}


@register(POLICY_LOSSES, "reinforce_tis", agg="seq-mean-token-sum")
def reinforce_tis_loss(inp: LossInputs, tis_cap: float = 1.02):
    """REINFORCE with truncated, detached importance weights: -min(ratio, tis_cap).detach() A logprobs,
    summed over each sequence's tokens and averaged over sequences (PipelineRL's 1 / batch
    size token weights); PipelineRL's cap is 1 + epsilon_high, 1.02 in its shipped config.
    Returns {"loss", "truncated"}: [B, T]. Source: PipelineRL (Piché et al., arXiv:2509.19128,
    sec. 3), truncated IS as in IMPALA (arXiv:1802.01561). Reference: ServiceNow/PipelineRL
    pipelinerl/finetune/rl/__init__.py rl_step (policy_loss "reinforce") and
    conf/finetune/base.yaml @ 58d3934."""
    ratio = _ratio(inp).detach()                                         # [B, T]
    w = ratio.clamp(max=tis_cap)                                         # [B, T]
    return {"loss": -w * inp.advantages * inp.logprobs, "truncated": (ratio > tis_cap).float()}


@register(POLICY_LOSSES, "cispo")
def cispo_loss(inp: LossInputs, clip_low: float = 1.0, clip_high: float = 0.2):
    """CISPO: -sg(clip(ratio, 1 - clip_low, 1 + clip_high)) A logprobs: the IS weight is
    clipped and detached, every token keeps a gradient (defaults: verl's clip_ratio_high 0.2;
    clip_low 1 leaves the ratio unbounded below). Returns {"loss", "clipped"}: [B, T].
    Source: MiniMax-M1, arXiv:2506.13585, sec. 3.1 eq. 4-5. Reference: volcengine/verl
    verl/trainer/ppo/core_algos.py compute_policy_loss_cispo @ b178a3c."""
    ratio = _ratio(inp).detach()                                         # [B, T]
    w = ratio.clamp(1 - clip_low, 1 + clip_high)                         # [B, T]
    return {"loss": -w * inp.advantages * inp.logprobs, "clipped": (w != ratio).float()}


@register(POLICY_LOSSES, "gspo", agg="seq-mean-token-mean")
def gspo_loss(inp: LossInputs, clip_low: float = 3e-4, clip_high: float = 4e-4):
    """GSPO: sequence-level ratio s = exp(mean_t(logprobs - behaviour_logprobs)), used per token
    as sg(s) exp(logprobs - sg(logprobs)) (log clamped to <= 10) inside the PPO clip.
    Returns {"loss", "clipped"}: [B, T].
    Source: Zheng et al., arXiv:2507.18071, eq. 5-7 (GSPO-token). Reference: volcengine/verl
    verl/trainer/ppo/core_algos.py compute_policy_loss_gspo @ b178a3c."""
    seq_log_ratio = seq_sum(inp.logprobs - inp.behaviour_logprobs, inp.mask) / inp.mask.sum(-1).clamp(min=1)  # [B]
    log_s = seq_log_ratio.detach()[:, None] + inp.logprobs - inp.logprobs.detach()         # [B, T]
    s = torch.exp(log_s.clamp(max=10.0))                                                   # [B, T]
    A = inp.advantages
    clipped = torch.clamp(s, 1 - clip_low, 1 + clip_high) * A                              # [B, T]
    return {"loss": -torch.minimum(s * A, clipped), "clipped": (clipped < s * A).float()}


@register(POLICY_LOSSES, "sft")
def sft_loss(inp: LossInputs):
    """Supervised fine-tuning: negative log-likelihood -logprobs of every trained token.
    Returns {"loss"}: [B, T]. Reference: modelscope/Trinity-RFT
    trinity/algorithm/policy_loss_fn/sft_loss.py (use_token_level_loss) @ 51d229f."""
    return {"loss": -inp.logprobs}


@register(POLICY_LOSSES, "dpo", agg="seq-mean-token-sum", needs_groups=True, needs_ref=True)
def dpo_loss(inp: LossInputs, beta: float = 0.1):
    """DPO on each group's best (chosen) and worst (rejected) sequence by reward:
    -log sigmoid(beta ((log pi - log pi_ref)(chosen) - (log pi - log pi_ref)(rejected))),
    sequence log-probs summed over tokens; a group without a reward gap has no pair. Both
    sequences of a pair carry the pair loss, every other sequence 0, so seq-mean-token-sum
    is the mean over pairs when every group is a pair (K / 2 times smaller for groups of
    K > 2). Returns {"loss", "pair_correct" (1.0 on the tokens of pairs whose implicit
    reward margin is > 0)}: [B, T].
    Source: Rafailov et al., arXiv:2305.18290, eq. 7. Reference: huggingface/trl
    trl/trainer/dpo_trainer.py (loss_type "sigmoid") @ f2cd577."""
    if inp.ref_logprobs is None:
        raise ValueError("dpo needs ref_logprobs (a reference model)")
    logit = beta * seq_sum(inp.logprobs - inp.ref_logprobs, inp.mask)                # [B]
    # 0 where no pair, but in the graph: a micro-batch without a pair still runs backward (FSDP2's reduce-scatter)
    per_seq = logit * 0                                                               # [B]
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


@register(POLICY_LOSSES, "mix", split_expert=True)
def mix_loss(inp: LossInputs, mu: float = 0.1, clip_low: float = 0.2, clip_high: float = 0.2,
             dual_clip: float | None = 3.0):
    """MIX: (1 - mu) L_GRPO + mu L_SFT, with L_GRPO the PPO-clip loss (dual clip) of the
    rollouts and L_SFT the NLL of the expert sequences (inp.expert), each normalised over
    its own part of the batch: the loss is `split_expert`, so the trainer aggregates it with
    the per-sequence totals of `part_totals`. Per token: (1 - mu) ppo on rollouts, mu (-logprobs)
    on expert tokens. Returns {"loss", "clipped", "expert" (1.0 on expert tokens)}: [B, T].
    Trinity-RFT's code approximates the per-part means per micro-batch (token means scaled by
    each micro-batch's share of the part's sequences); here they are exact over the batch.
    Source: Trinity-RFT's MIX algorithm, docs/sphinx_doc/source/tutorial/example_mix_algo.md
    (the J_Mix objective) @ 05ad975. Reference: modelscope/Trinity-RFT
    trinity/algorithm/policy_loss_fn/mix_policy_loss.py @ c10d414 (defaults: mu 0.1,
    clip_range 0.2, clip_ratio_c 3, token-level SFT)."""
    expert = (inp.expert if inp.expert is not None else
              torch.zeros(len(inp.mask), dtype=torch.bool, device=inp.mask.device))[:, None]   # [B, 1]
    ppo = ppo_clip_loss(inp, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip)
    loss = torch.where(expert, mu * -inp.logprobs, (1 - mu) * ppo["loss"])              # [B, T]
    return {"loss": loss, "clipped": ppo["clipped"] * ~expert, "expert": expert.float().expand_as(loss)}


# ----------------------------------------------------------------------------- filters

@register(FILTERS, "zero_advantage")
def zero_advantage_filter(tokens: list[int], behaviour_logprobs: list[float], advantage: float,
                          eps: float = 1e-8) -> bool:
    """Keep sequences whose advantage is not (numerically) zero: they carry no policy gradient."""
    return abs(advantage) > eps


@register(FILTERS, "gibberish")
def gibberish_filter(tokens: list[int], behaviour_logprobs: list[float], advantage: float,
                     action_mask: list[int] | None = None, min_mean_logprob: float = -6.0) -> bool:
    """Keep sequences whose mean behaviour log-prob per policy token (action_mask 1; every
    token when no mask is given) is at least `min_mean_logprob` (nats): very unlikely token
    streams are usually gibberish."""
    own = [lp for lp, m in zip(behaviour_logprobs, action_mask or [1] * len(behaviour_logprobs)) if m]
    return not own or sum(own) / len(own) >= min_mean_logprob


@register(FILTERS, "repetition")
def repetition_filter(tokens: list[int], behaviour_logprobs: list[float], advantage: float, ngram: int = 4,
                      max_repeat_frac: float = 0.5) -> bool:
    """Keep responses (the last len(behaviour_logprobs) tokens) in which at most
    `max_repeat_frac` of the `ngram`-grams are repeats of an earlier n-gram."""
    resp = tokens[len(tokens) - len(behaviour_logprobs):]
    grams = [tuple(resp[i:i + ngram]) for i in range(len(resp) - ngram + 1)]
    return not grams or (len(grams) - len(set(grams))) / len(grams) <= max_repeat_frac
