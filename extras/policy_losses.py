"""Policy losses besides PPO clip: DPPO-KL (prime-rl), REINFORCE with truncated IS
(PipelineRL), CISPO, GSPO, SFT, DPO and MIX (Trinity-RFT), named by import path in
losses.POLICY_LOSSES: importing this file registers them with their attributes (contract: losses.py)."""
from __future__ import annotations

import torch

from losses import POLICY_LOSSES, LossInputs, importance_ratio, ppo_clip_loss, register, seq_sum, spread


@register(POLICY_LOSSES, "dppo_kl")
def dppo_kl_loss(inp: LossInputs, dppo_mask_low: float = 0.2, dppo_mask_high: float = 0.2, adv_tau: float = 1.0,
                 kl_tau: float = 1e-3):
    """prime-rl's default loss, DPPO-Binary-TV + KL: -ratio adv_tau A on the tokens inside
    the trust region, plus kl_tau (log ratio)^2 on every token. The trust region bounds
    d = exp(logprobs) - exp(behaviour_logprobs) on the side the update pushes: a token with
    A > 0 is masked when d > dppo_mask_high, any other when d < -dppo_mask_low.
    Returns {"loss", "masked"}: [B, T].
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
    """REINFORCE with truncated, detached importance weights: -min(ratio, tis_cap).detach() A
    logprobs, summed over each sequence and averaged over sequences (PipelineRL's token
    weights); tis_cap is PipelineRL's 1 + epsilon_high of its shipped config.
    Returns {"loss", "truncated"}: [B, T]. Source: PipelineRL (Piché et al., arXiv:2509.19128,
    sec. 3), truncated IS as in IMPALA (arXiv:1802.01561). Reference: ServiceNow/PipelineRL
    pipelinerl/finetune/rl/__init__.py rl_step (policy_loss "reinforce") and
    conf/finetune/base.yaml @ 58d3934."""
    ratio = importance_ratio(inp).detach()                               # [B, T]
    w = ratio.clamp(max=tis_cap)                                         # [B, T]
    return {"loss": -w * inp.advantages * inp.logprobs, "truncated": (ratio > tis_cap).float()}


@register(POLICY_LOSSES, "cispo")
def cispo_loss(inp: LossInputs, clip_low: float = 1.0, clip_high: float = 0.2):
    """CISPO: -sg(clip(ratio, 1 - clip_low, 1 + clip_high)) A logprobs: the IS weight is
    clipped and detached, so every token keeps a gradient (clip_high: verl's 0.2; clip_low 1
    leaves the ratio unbounded below). Returns {"loss", "clipped"}: [B, T].
    Source: MiniMax-M1, arXiv:2506.13585, sec. 3.1 eq. 4-5. Reference: volcengine/verl
    verl/trainer/ppo/core_algos.py compute_policy_loss_cispo @ b178a3c."""
    ratio = importance_ratio(inp).detach()                               # [B, T]
    w = ratio.clamp(1 - clip_low, 1 + clip_high)                         # [B, T]
    return {"loss": -w * inp.advantages * inp.logprobs, "clipped": (w != ratio).float()}


@register(POLICY_LOSSES, "gspo", agg="seq-mean-token-mean")
def gspo_loss(inp: LossInputs, clip_low: float = 3e-4, clip_high: float = 4e-4):
    """GSPO: the sequence-level ratio s = exp(mean_t(logprobs - behaviour_logprobs)), used per
    token as sg(s) exp(logprobs - sg(logprobs)) (log clamped to <= 10) inside the PPO clip.
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
    """Supervised fine-tuning: the negative log-likelihood -logprobs of every trained token.
    Returns {"loss"}: [B, T]. Reference: modelscope/Trinity-RFT
    trinity/algorithm/policy_loss_fn/sft_loss.py (use_token_level_loss) @ 51d229f."""
    return {"loss": -inp.logprobs}


@register(POLICY_LOSSES, "dpo", agg="seq-mean-token-sum", needs_groups=True, needs_ref=True)
def dpo_loss(inp: LossInputs, beta: float = 0.1):
    """DPO on each group's best (chosen) and worst (rejected) sequence by reward:
    -log sigmoid(beta ((log pi - log pi_ref)(chosen) - (log pi - log pi_ref)(rejected))), the
    sequence log-probs summed over tokens; a group without a reward gap has no pair. Both
    sequences of a pair carry the pair's loss, every other one 0: seq-mean-token-sum is the
    mean over pairs when every group is a pair. Returns {"loss", "pair_correct" (1.0 on pairs
    whose implicit reward margin is > 0)}: [B, T]. Raises ValueError without ref_logprobs.
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
    """MIX: (1 - mu) L_GRPO + mu L_SFT: per token (1 - mu) ppo_clip on rollouts and
    mu (-logprobs) on expert tokens (inp.expert), each part normalised over its own part of
    the batch (`split_expert`: the trainer aggregates with `part_totals`, exact over the
    batch where Trinity-RFT's code approximates per micro-batch).
    Returns {"loss", "clipped", "expert" (1.0 on expert tokens)}: [B, T].
    Source: Trinity-RFT's MIX algorithm, docs/sphinx_doc/source/tutorial/example_mix_algo.md
    (the J_Mix objective) @ 05ad975. Reference: modelscope/Trinity-RFT
    trinity/algorithm/policy_loss_fn/mix_policy_loss.py @ c10d414 (defaults: mu 0.1,
    clip_range 0.2, clip_ratio_c 3, token-level SFT)."""
    expert = (inp.expert if inp.expert is not None else
              torch.zeros(len(inp.mask), dtype=torch.bool, device=inp.mask.device))[:, None]   # [B, 1]
    ppo = ppo_clip_loss(inp, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip)
    loss = torch.where(expert, mu * -inp.logprobs, (1 - mu) * ppo["loss"])              # [B, T]
    return {"loss": loss, "clipped": ppo["clipped"] * ~expert, "expert": expert.float().expand_as(loss)}
