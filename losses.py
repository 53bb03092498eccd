"""Pure tensor functions of RFT: advantages, policy losses, KL estimates.

No model, no process group, no I/O: every function takes tensors and returns tensors, so
each can be checked against a slow reference on small inputs. Shapes use
B = sequences in a (micro-)batch, T = response tokens (right-padded).

Registries map config names to functions:
  ADVANTAGES[name](rewards [B], group_index [B], **kw) -> advantages [B]
  POLICY_LOSSES[name](LossInputs, **kw) -> dict of per-token tensors [B, T]:
      "loss" (required) and any extra per-token metric (e.g. "clipped").
The trainer aggregates per-token tensors with `masked_sum(x, mask) / total_tokens`
(token-mean over the whole batch, as in DAPO, arXiv:2503.14476, section 3.3).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LossInputs:
    """Inputs of a policy loss, all [B, T] on one device.

    logprobs:     log-probs of the response tokens under the current policy (with grad).
    old_logprobs: behaviour-policy log-probs recorded by the explorer (no grad).
    advantages:   per-token advantages (the sequence advantage broadcast over its tokens).
    mask:         1.0 on trained tokens (action_mask and not padding), else 0.0.
    """

    logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor


def masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of x where mask is 1. x, mask: [B, T] -> scalar."""
    return (x * mask).sum()


def grpo_advantages(rewards: torch.Tensor, group_index: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO outcome advantages: (r - mean_group) / (std_group + eps).

    rewards: [B] float; group_index: [B] int in [0, G). Returns [B]. The std is the
    unbiased sample std of the group (0 for groups of one). Source: DeepSeekMath,
    arXiv:2402.03300, section 4.1.2.
    """
    G = int(group_index.max()) + 1
    onehot = torch.nn.functional.one_hot(group_index, G).to(rewards.dtype)  # [B, G]
    count = onehot.sum(0)                                                  # [G]
    mean = (onehot * rewards[:, None]).sum(0) / count                      # [G]
    dev = rewards - mean[group_index]                                      # [B]
    var = (onehot * dev[:, None] ** 2).sum(0) / (count - 1).clamp(min=1)   # [G]
    return dev / (var.sqrt()[group_index] + eps)                           # [B]


def ppo_clip_loss(inp: LossInputs, clip_low: float = 0.2, clip_high: float = 0.2) -> dict[str, torch.Tensor]:
    """PPO clipped surrogate, per token: -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A).

    ratio = exp(logprobs - old_logprobs) is the importance ratio between the current and
    the behaviour policy. Returns {"loss": [B, T], "clipped": [B, T] (1.0 where the clipped
    term is active)}. Source: PPO, arXiv:1707.06347, eq. 7; asymmetric clip from DAPO
    (arXiv:2503.14476, section 3.1).
    """
    log_ratio = inp.logprobs - inp.old_logprobs                                  # [B, T]
    ratio = torch.exp(log_ratio)                                                 # [B, T]
    unclipped = ratio * inp.advantages                                           # [B, T]
    clipped = torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * inp.advantages   # [B, T]
    return {"loss": -torch.minimum(unclipped, clipped), "clipped": (clipped < unclipped).float()}


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(ref || current) from samples of ref: (r - 1) - log r,
    r = exp(logprobs - ref_logprobs). [B, T] -> [B, T], always >= 0.
    Source: J. Schulman, "Approximating KL divergence" (2020)."""
    log_r = logprobs - ref_logprobs  # [B, T]
    return torch.expm1(log_r) - log_r


ADVANTAGES = {"grpo": grpo_advantages}
POLICY_LOSSES = {"ppo_clip": ppo_clip_loss}
