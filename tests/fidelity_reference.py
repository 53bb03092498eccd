"""The golden numbers of tests/test_fidelity.py, recomputed from the reference implementations.

Every function below re-implements one reference function line by line, as its source does
(same operations, same order, same epsilons and clamps), and cites in its docstring the
repository, file, function and commit it follows. Only what cannot run here is replaced:
framework plumbing (DataProto, Experience objects, configs, packing, the model's forward) is
reduced to the tensors the function reads, and every tensor is float64 (the references use
float32 or the model's dtype; the goldens are float64: compute() sets torch's default dtype to
float64 while it runs and restores it after). Nothing here imports the project's
losses.py: this is the independent side of the comparison.

The fixed inputs of tests/test_fidelity.py live here, at module level, and the test imports
them, so both sides use one copy. `compute()` returns {constant name: value} with the names
test_fidelity.py uses (`compute(DISTILL_PARTS)`: tests/test_distill.py's;
`compute(CORRECTION_PARTS)`: tests/test_corrections.py's); running this file prints them all:

    .venv/bin/python tests/fidelity_reference.py

Sources read (each at the commit test_fidelity.py names, except where noted):
  PrimeIntellect-ai/prime-rl @ 559b447: src/prime_rl/trainer/rl/loss.py, src/prime_rl/trainer/rl/train.py,
      packages/prime-rl-configs/src/prime_rl/configs/trainer.py
  volcengine/verl @ b178a3c: verl/trainer/ppo/core_algos.py, verl/utils/torch_functional.py
  modelscope/Trinity-RFT: policy_loss_fn/mix_policy_loss.py @ c10d414, ppo_policy_loss.py @ 5a4234e,
      sft_loss.py @ 51d229f, opmd_policy_loss.py @ 70c21ac, advantage_fn/opmd_advantage.py @ 547adf1,
      advantage_fn/multi_step_grpo_advantage.py @ 369bf62; trinity/algorithm/utils.py (masked_mean,
      aggregate_loss) could not be read at 5a4234e: read in the fork pan-x-c/Trinity-RFT @ edb802e
  yaochaorui/Trinity-RFT @ 50aba82: trinity/trainer/verl/core_algos.py
  ServiceNow/PipelineRL @ 58d3934: pipelinerl/finetune/rl/__init__.py, pipelinerl/finetune/rl/utils.py,
      conf/finetune/base.yaml
  huggingface/trl @ f2cd577: trl/trainer/dpo_trainer.py, trl/trainer/dpo_config.py
  thinking-machines-lab/tinker-cookbook @ 9dfcc3a: tinker_cookbook/distillation/train_on_policy.py,
      tinker_cookbook/rl/data_processing.py (tests/test_distill.py); Tinker's "importance_sampling" loss runs on
      the Tinker service: as its documentation writes it (tinker-docs.thinkingmachines.ai/losses)
  Le Roux et al., arXiv:2503.14286, sec. 3 (TOPR has no reference code)
  rollout corrections (tests/test_corrections.py): volcengine/verl @ b178a3c:
      verl/trainer/ppo/rollout_corr_helper.py, verl/trainer/config/algorithm.py, docs/algo/rollout_corr.md;
      OpenRLHF/OpenRLHF @ 3c3be62: openrlhf/models/loss.py, openrlhf/cli/train_ppo_ray.py (IcePop,
      arXiv:2510.18855)

Dependencies: torch and numpy only.
"""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F

F64 = torch.float64

# ----------------------------------------------------------------------------- fixed inputs

# B = 4 sequences, T = 4 tokens: LP the current policy's log-probs, BEHAVIOUR the behaviour
# policy's; sequence 1 has a token with ratio e^1.5 and A < 0 (dual clip), sequence 3 a
# sequence-level ratio e^-0.4 with A < 0 (TOPR's taper)
LP = [
    [-1.0, -0.1, -2.0, -0.3],
    [-0.7, -1.2, -0.1, -0.5],
    [-0.2, -0.9, -1.5, -0.6],
    [-1.0, -0.8, -0.4, -2.2],
]
BEHAVIOUR = [
    [-1.3, -0.6, -1.0, -0.3],
    [-0.2, -1.2, -0.6, -2.0],
    [-0.25, -1.9, -1.4, -0.1],
    [-0.9, -0.5, -0.6, -2.0],
]
ADV = [1.5, -0.8, 0.6, -0.4]
MASK = [[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1]]
R4, G4 = [1.0, 0.0, 0.5, 0.2], [0, 0, 1, 1]  # rewards and groups of the four sequences

# advantages: 10 sequences in groups of 3, 4, 2 and 1, with their trained-token counts
R10 = [1.0, 0.0, 0.5, 0.0, 1.0, 1.0, 0.2, 0.7, 0.9, 0.4]
G10 = [0, 0, 0, 1, 1, 1, 1, 2, 2, 3]
COUNTS10 = [3, 4, 2, 4, 1, 5, 2, 3, 4, 2]

# step-wise GRPO: 7 samples; task 0 = runs 0, 1, 2 of 3, 1 and 2 steps (final rewards 1, 0, 0.5),
# task 1 = run 3 of one step (reward 0.3)
STEP_R = [0.0, 0.0, 1.0, 0.0, 0.0, 0.5, 0.3]
STEP_G = [0, 0, 0, 0, 0, 0, 1]
STEP_T = [0, 0, 0, 1, 2, 2, 3]

# KL estimators: log p (the sampled policy) and log q (the reference), log-ratios up to +-30
KL_LOGP = [[0.0, -1.0, -2.0, 0.0, -0.3, 0.0]]
KL_LOGQ = [[30.0, -4.0, -0.5, -30.0, -0.2, 2.5]]

# PPO on log-ratios -25, 0, 22 with A = -1 (verl clamps the log-ratio to [-20, 20])
PPO_EXTREME_LP = [[0.0, -0.5, -1.0]]
PPO_EXTREME_BEHAVIOUR = [[-25.0, -0.5, 22.0]]

# GSPO on a sequence whose mean log-ratio is 15 (> 10), A = 1, clip 0.1 / 1e9
GSPO_EXTREME_LP = [[0.0, -0.5]]
GSPO_EXTREME_BEHAVIOUR = [[-30.0, -0.5]]

MIX_EXPERT = [False, True, False, True]  # MIX: sequences 1 and 3 are expert (SFT) data
DPO_REWARDS = [1.0, 0.0, 0.0, 1.0]  # DPO: pairs (chosen 0, rejected 1), (chosen 3, rejected 2)

# on-policy distillation: the teacher's log-probs of the sampled tokens (the behaviour policy's: BEHAVIOUR);
# a prompt of DISTILL_PROMPT tokens before each response, MASK's trailing 0s the shorter responses' padding
TEACHER = [
    [-0.9, -0.4, -1.6, -0.7],
    [-0.5, -1.5, -0.9, -1.0],
    [-0.6, -1.2, -0.3, -0.8],
    [-1.1, -0.2, -0.8, -2.5],
]
TEACHER_PROMPT = [-2.0, -0.7]  # the teacher's log-probs of the prompt's tokens after the first
DISTILL_PROMPT = 3

ENTROPY_LOGITS = [
    [[1.0, -0.5, 2.0, 0.3], [0.0, 0.0, 0.0, 0.0]],
    [[-3.0, 1.0, 0.5, 0.5], [4.0, -2.0, 1.0, 0.0]],
]

# rollout corrections (tests/test_corrections.py): B = 6 sequences, T = 5 tokens, CORR_OLD the
# trainer's log-probs at the behaviour version (pi_old), CORR_BEHAVIOUR the engine's; log-ratios
# old - behaviour on the trained tokens: sequence 0 near 0 (+-6e-4: inside the geometric band),
# 1 ratios 1.35, 2.46, 0.45, 6.05, 1.11 (sum 2.3: above every band), 2 ratios 0.67, 0.61, 0.82
# (sum -1.1: below the sequence band), 3 ratios 0.82 to 1.35 (sum 0.3: inside it), 4 no trained
# token, 5 log-ratios 25, -30, 0.1 (past verl's +-20 safety bound: the sequence weight uses the sum
# of the unclamped log-ratios, the sequence mask the sum of the clamped ones); the untrained
# positions hold placeholders far from their partners (log-ratios -3, 8.5, 24)
CORR_OLD = [
    [-0.4996, -1.2006, -0.0498, -3.0, -3.0],
    [-0.7, -1.1, -1.3, -0.7, -0.2],
    [-1.0, -1.4, -1.2, -0.5, -0.5],
    [-0.3, -0.4, -1.2, -0.7, -0.6],
    [-1.0, -1.0, -1.0, -1.0, -1.0],
    [-1.0, -30.1, -1.1, -3.0, -3.0],
]
CORR_BEHAVIOUR = [
    [-0.5, -1.2, -0.05, 0.0, 0.0],
    [-1.0, -2.0, -0.5, -2.5, -0.3],
    [-0.6, -0.9, -1.0, -9.0, -9.0],
    [-0.5, -0.3, -1.5, -0.8, -0.4],
    [-25.0, -25.0, -25.0, -25.0, -25.0],
    [-26.0, -0.1, -1.2, 0.0, 0.0],
]
CORR_MASK = [
    [1, 1, 1, 0, 0],
    [1, 1, 1, 1, 1],
    [1, 1, 1, 0, 0],
    [1, 1, 1, 1, 1],
    [0, 0, 0, 0, 0],
    [1, 1, 1, 0, 0],
]
# (kind, low, high): the bounds on rho = pi_old / pi_behaviour of each golden; None: the source's
# default; the second case of each kind an asymmetric band that keeps or drops other tokens
CORR_CASES = (
    ("tis-token", None, None),
    ("tis-token", None, 1.2),
    ("tis-seq", None, None),
    ("tis-seq", None, 12.0),
    ("mis-token", None, None),
    ("mis-token", 0.6, 3.0),
    ("mis-seq", None, None),
    ("mis-seq", 0.3, 1.2),
    ("geo-mask", None, None),
    ("geo-mask", 0.9, 1.1),
    ("icepop", None, None),
    ("icepop", 0.65, 2.0),
)


def _t(x, dtype=F64) -> torch.Tensor:
    return torch.tensor(x, dtype=dtype)


def _lp() -> torch.Tensor:
    """A fresh float64 leaf of LP that records its gradient."""
    return _t(LP).requires_grad_(True)


def _adv_matrix(adv) -> torch.Tensor:
    """A per-sequence advantage [B] broadcast over the T tokens (as the trainers store it)."""
    return _t(adv)[:, None].expand(len(adv), len(LP[0])).clone()


def _outcome_rewards(rewards, lengths, width) -> torch.Tensor:
    """verl's token_level_rewards: each sequence's reward on its last response token. [B, width]"""
    out = torch.zeros(len(rewards), width, dtype=F64)
    for i, (r, n) in enumerate(zip(rewards, lengths)):
        out[i, int(n) - 1] = r
    return out


def _response_mask(lengths, width) -> torch.Tensor:
    return (torch.arange(width)[None, :] < _t(lengths)[:, None]).to(F64)


# ----------------------------------------------------------------------------- verl


def verl_masked_sum(values, mask, axis=None):
    """volcengine/verl verl/utils/torch_functional.py masked_sum @ b178a3c."""
    # If NaNs exist out of mask, replace NaNs in values with a value that won't affect the sum
    valid_values = torch.where(mask.bool(), values, 0.0)
    return (valid_values * mask).sum(axis=axis)


def verl_masked_mean(values, mask, axis=None):
    """volcengine/verl verl/utils/torch_functional.py masked_mean @ b178a3c."""
    s = verl_masked_sum(values, mask, axis)
    return s / (mask.sum(axis=axis) + 1e-8)


def verl_masked_var(values, mask, unbiased=True):
    """volcengine/verl verl/utils/torch_functional.py masked_var @ b178a3c."""
    mean = verl_masked_mean(values, mask)
    centered_values = values - mean
    variance = verl_masked_mean(centered_values**2, mask)
    if unbiased:
        mask_sum = mask.sum()
        if mask_sum == 0:
            raise ValueError("At least one element in the mask has to be 1.")
        if mask_sum == 1:
            raise ValueError("The sum of the mask is one, which can cause a division by zero.")
        bessel_correction = mask_sum / (mask_sum - 1)
        variance = variance * bessel_correction
    return variance


def verl_masked_whiten(values, mask, shift_mean=True):
    """volcengine/verl verl/utils/torch_functional.py masked_whiten @ b178a3c."""
    mean, var = verl_masked_mean(values, mask), verl_masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened += mean
    return whitened


def verl_entropy_from_logits(logits: torch.Tensor):
    """volcengine/verl verl/utils/torch_functional.py entropy_from_logits @ b178a3c."""
    pd = torch.nn.functional.softmax(logits, dim=-1)
    entropy = torch.logsumexp(logits, dim=-1) - torch.sum(pd * logits, dim=-1)
    return entropy


def verl_agg_loss(
    loss_mat,
    loss_mask,
    loss_agg_mode,
    dp_size=1,
    batch_num_tokens=None,
    global_batch_size=None,
    loss_scale_factor=None,
):
    """volcengine/verl verl/trainer/ppo/core_algos.py agg_loss @ b178a3c. The policy losses call
    it with **config.global_batch_info, {} by default (ActorConfig, verl/workers/config/actor.py):
    one rank whose micro-batch is the global batch."""
    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None:
            batch_num_tokens = loss_mask.sum()
        loss = verl_masked_sum(loss_mat, loss_mask) / batch_num_tokens * dp_size
    elif loss_agg_mode == "seq-mean-token-sum":
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)  # token-sum
        seq_mask = (torch.sum(loss_mask, dim=-1) > 0).float()  # exclude fully masked sequences
        if global_batch_size is None:
            global_batch_size = seq_mask.sum()
        loss = verl_masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size  # seq-mean
    elif loss_agg_mode == "seq-mean-token-mean":
        seq_mask = torch.sum(loss_mask, dim=-1)  # per-sequence token count
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1) / (seq_mask + 1e-8)  # token-mean
        seq_mask = (seq_mask > 0).float()  # exclude fully masked sequences
        if global_batch_size is None:
            global_batch_size = seq_mask.sum()
        loss = verl_masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size  # seq-mean
    elif loss_agg_mode == "seq-mean-token-sum-norm":
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
        if loss_scale_factor is None:
            loss_scale_factor = loss_mask.shape[-1]
        loss = torch.sum(seq_losses) / loss_scale_factor
    else:
        raise ValueError(f"Invalid loss_agg_mode: {loss_agg_mode}")
    return loss


def verl_kl_penalty_forward(logprob, ref_logprob, kl_penalty):
    """volcengine/verl verl/trainer/ppo/core_algos.py kl_penalty_forward @ b178a3c."""
    if kl_penalty in ("kl", "k1"):
        return logprob - ref_logprob
    if kl_penalty == "abs":
        return (logprob - ref_logprob).abs()
    if kl_penalty in ("mse", "k2"):
        return 0.5 * (logprob - ref_logprob).square()
    # J. Schulman. Approximating kl divergence, 2020.
    if kl_penalty in ("low_var_kl", "k3"):
        kl = ref_logprob - logprob
        # For numerical stability
        kl = torch.clamp(kl, min=-20, max=20)
        ratio = torch.exp(kl)
        kld = (ratio - kl - 1).contiguous()
        return torch.clamp(kld, min=-10, max=10)
    raise NotImplementedError


def verl_compute_policy_loss_vanilla(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    loss_agg_mode="token-mean",
    clip_ratio=0.2,
    clip_ratio_low=0.2,
    clip_ratio_high=0.28,
    clip_ratio_c=3.0,
):
    """volcengine/verl verl/trainer/ppo/core_algos.py compute_policy_loss_vanilla @ b178a3c
    (config.clip_ratio / clip_ratio_low / clip_ratio_high / clip_ratio_c as arguments; no
    rollout importance weights; the logging-only metrics left out). Returns (pg_loss, pg_losses [B, T])."""
    clip_ratio_low = clip_ratio_low if clip_ratio_low is not None else clip_ratio
    clip_ratio_high = clip_ratio_high if clip_ratio_high is not None else clip_ratio
    cliprange = clip_ratio
    cliprange_low = clip_ratio_low
    cliprange_high = clip_ratio_high
    assert clip_ratio_c > 1.0
    negative_approx_kl = log_prob - old_log_prob
    # Clamp negative_approx_kl for stability
    negative_approx_kl = torch.clamp(negative_approx_kl, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    if cliprange_low is None:
        cliprange_low = cliprange
    if cliprange_high is None:
        cliprange_high = cliprange
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - cliprange_low, 1 + cliprange_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    pg_loss = verl_agg_loss(
        loss_mat=pg_losses, loss_mask=response_mask, loss_agg_mode=loss_agg_mode
    )
    return pg_loss, pg_losses


def verl_compute_policy_loss_gspo(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    loss_agg_mode="seq-mean-token-mean",
    clip_ratio_low=3e-4,
    clip_ratio_high=4e-4,
):
    """volcengine/verl verl/trainer/ppo/core_algos.py compute_policy_loss_gspo @ b178a3c."""
    negative_approx_kl = log_prob - old_log_prob
    # compute sequence-level importance ratio
    seq_lengths = torch.sum(response_mask, dim=-1).clamp(min=1)
    negative_approx_kl_seq = torch.sum(negative_approx_kl * response_mask, dim=-1) / seq_lengths
    # Combined ratio at token level: s_i,t(theta) = sg[s_i(theta)] * pi(y_i,t) / sg[pi(y_i,t)]
    log_seq_importance_ratio = (
        log_prob - log_prob.detach() + negative_approx_kl_seq.detach().unsqueeze(-1)
    )
    log_seq_importance_ratio = torch.clamp(
        log_seq_importance_ratio, max=10.0
    )  # clamp for numerical stability
    seq_importance_ratio = torch.exp(log_seq_importance_ratio)
    pg_losses1 = -advantages * seq_importance_ratio
    pg_losses2 = -advantages * torch.clamp(
        seq_importance_ratio, 1 - clip_ratio_low, 1 + clip_ratio_high
    )
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    # for GSPO, we need to aggregate the loss at the sequence level (seq-mean-token-mean)
    pg_loss = verl_agg_loss(
        loss_mat=pg_losses, loss_mask=response_mask, loss_agg_mode="seq-mean-token-mean"
    )
    return pg_loss


def verl_compute_policy_loss_cispo(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    loss_agg_mode="token-mean",
    clip_ratio_low=1.0,
    clip_ratio_high=0.28,
):
    """volcengine/verl verl/trainer/ppo/core_algos.py compute_policy_loss_cispo @ b178a3c."""
    negative_approx_kl = log_prob - old_log_prob
    negative_approx_kl = torch.clamp(negative_approx_kl, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    clipped_ratio = torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    clipped_ratio_sg = clipped_ratio.detach()
    pg_losses = -clipped_ratio_sg * advantages * log_prob
    pg_loss = verl_agg_loss(
        loss_mat=pg_losses, loss_mask=response_mask, loss_agg_mode=loss_agg_mode
    )
    return pg_loss


def verl_compute_grpo_outcome_advantage(
    token_level_rewards, response_mask, index, epsilon=1e-6, norm_adv_by_std_in_grpo=True
):
    """volcengine/verl verl/trainer/ppo/core_algos.py compute_grpo_outcome_advantage @ b178a3c."""
    scores = token_level_rewards.sum(dim=-1)
    id2score = defaultdict(list)
    id2mean = {}
    id2std = {}
    with torch.no_grad():
        bsz = scores.shape[0]
        for i in range(bsz):
            id2score[index[i]].append(scores[i])
        for idx in id2score:
            if len(id2score[idx]) == 1:
                id2mean[idx] = torch.tensor(0.0)
                id2std[idx] = torch.tensor(1.0)
            elif len(id2score[idx]) > 1:
                scores_tensor = torch.stack(id2score[idx])
                id2mean[idx] = torch.mean(scores_tensor)
                id2std[idx] = torch.std(scores_tensor)
            else:
                raise ValueError(f"no score in prompt index: {idx}")
        for i in range(bsz):
            if norm_adv_by_std_in_grpo:
                scores[i] = (scores[i] - id2mean[index[i]]) / (id2std[index[i]] + epsilon)
            else:
                scores[i] = scores[i] - id2mean[index[i]]
        scores = scores.unsqueeze(-1) * response_mask
    return scores, scores


def verl_compute_rloo_outcome_advantage(token_level_rewards, response_mask, index, epsilon=1e-6):
    """volcengine/verl verl/trainer/ppo/core_algos.py compute_rloo_outcome_advantage @ b178a3c."""
    scores = token_level_rewards.sum(dim=-1)
    id2score = defaultdict(list)
    id2mean = {}
    with torch.no_grad():
        bsz = scores.shape[0]
        for i in range(bsz):
            id2score[index[i]].append(scores[i])
        for idx in id2score:
            if len(id2score[idx]) == 1:
                id2mean[idx] = torch.tensor(0.0)
            elif len(id2score[idx]) > 1:
                id2mean[idx] = torch.mean(torch.stack(id2score[idx]))
            else:
                raise ValueError(f"no score in prompt index: {idx}")
        for i in range(bsz):
            response_num = len(id2score[index[i]])
            if response_num > 1:
                scores[i] = scores[i] * response_num / (response_num - 1) - id2mean[
                    index[i]
                ] * response_num / (response_num - 1)
        scores = scores.unsqueeze(-1) * response_mask
    return scores, scores


def verl_compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards, response_mask, index, epsilon=1e-6
):
    """volcengine/verl verl/trainer/ppo/core_algos.py
    compute_reinforce_plus_plus_baseline_outcome_advantage @ b178a3c."""
    response_length = token_level_rewards.shape[-1]
    scores = token_level_rewards.sum(dim=-1)
    id2score = defaultdict(list)
    id2mean = {}
    with torch.no_grad():
        bsz = scores.shape[0]
        for i in range(bsz):
            id2score[index[i]].append(scores[i])
        for idx in id2score:
            if len(id2score[idx]) == 1:
                id2mean[idx] = torch.tensor(0.0)
            elif len(id2score[idx]) > 1:
                id2mean[idx] = torch.mean(torch.stack(id2score[idx]))
            else:
                raise ValueError(f"no score in prompt index: {idx}")
        for i in range(bsz):
            scores[i] = scores[i] - id2mean[index[i]]
        scores = scores.unsqueeze(-1).tile([1, response_length]) * response_mask
        scores = verl_masked_whiten(scores, response_mask) * response_mask
    return scores, scores


def verl_compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards, response_mask, gamma=1.0
):
    """volcengine/verl verl/trainer/ppo/core_algos.py compute_reinforce_plus_plus_outcome_advantage
    @ b178a3c (config.gamma as an argument)."""
    with torch.no_grad():
        returns = torch.zeros_like(token_level_rewards)
        running_return = 0
        for t in reversed(range(token_level_rewards.shape[1])):
            running_return = token_level_rewards[:, t] + gamma * running_return
            returns[:, t] = running_return
            # Reset after EOS
            running_return = running_return * response_mask[:, t]
        advantages = verl_masked_whiten(returns, response_mask)
        advantages = advantages * response_mask
    return advantages, returns


# ----------------------------------------------------------------------------- prime-rl


def primerl_compute_importance_ratio_and_mismatch_kl(trainer_logprobs, inference_logprobs):
    """PrimeIntellect-ai/prime-rl src/prime_rl/trainer/rl/loss.py
    compute_importance_ratio_and_mismatch_kl @ 559b447."""
    log_importance_ratio = trainer_logprobs - inference_logprobs
    importance_ratio = torch.exp(log_importance_ratio)
    mismatch_kl = importance_ratio - log_importance_ratio - 1
    return log_importance_ratio, importance_ratio, mismatch_kl


def primerl_default_loss_fn(inputs, loss_config):
    """PrimeIntellect-ai/prime-rl src/prime_rl/trainer/rl/loss.py default_loss_fn @ 559b447
    (DPPO-Binary-TV + Kimi-K2.5 KL; per sample, summed). Returns (loss, is_masked); the
    metrics are left out."""
    trainer_logprobs = inputs.trainer_logprobs
    inference_logprobs = inputs.inference_logprobs
    advantages = inputs.advantages
    loss_mask = inputs.loss_mask

    log_importance_ratio, importance_ratio, mismatch_kl = (
        primerl_compute_importance_ratio_and_mismatch_kl(trainer_logprobs, inference_logprobs)
    )

    probs_diff = torch.exp(trainer_logprobs) - torch.exp(inference_logprobs)
    dppo_invalid_mask_high = probs_diff > loss_config.dppo_mask_high
    dppo_invalid_mask_low = probs_diff < -loss_config.dppo_mask_low
    positive_advantages = advantages > 0
    dppo_invalid_mask = torch.where(
        positive_advantages, dppo_invalid_mask_high, dppo_invalid_mask_low
    )

    is_masked = dppo_invalid_mask
    keep_mask = loss_mask & ~is_masked

    advantages = loss_config.adv_tau * advantages
    pg_loss = keep_mask * advantages * importance_ratio
    kl_loss = loss_mask * log_importance_ratio**2
    per_token_loss = -pg_loss + loss_config.kl_tau * kl_loss
    if inputs.loss_weights is not None:
        per_token_loss = per_token_loss * inputs.loss_weights
    loss = per_token_loss.sum()
    return loss, is_masked


def primerl_compute_loss(
    trainer_logprobs, inference_logprobs, advantages, loss_mask, loss_config, rl_scale
):
    """PrimeIntellect-ai/prime-rl src/prime_rl/trainer/rl/loss.py compute_loss @ 559b447 with
    only the rl component (no rl/ce/ref_kl weight streams): the per-sample losses summed and
    divided by rl_scale, the global count of loss tokens."""
    rl_loss = trainer_logprobs[0].sum() * 0.0
    ce_loss = 0.0
    ref_kl_loss = 0.0
    masked = []
    for t_logp, i_logp, adv, mask in zip(
        trainer_logprobs, inference_logprobs, advantages, loss_mask
    ):
        inputs = SimpleNamespace(
            trainer_logprobs=t_logp,
            inference_logprobs=i_logp,
            ref_logprobs=None,
            advantages=adv,
            loss_mask=mask,
            loss_weights=None,
        )
        loss, is_masked = primerl_default_loss_fn(inputs, loss_config)
        rl_loss = rl_loss + loss
        masked.append(is_masked)
    ce_scale = ref_kl_scale = (
        1  # train.py @ 559b447: max(global count, 1) of the empty ce / ref_kl components
    )
    scaled_loss = rl_loss / rl_scale + ce_loss / ce_scale + ref_kl_loss / ref_kl_scale
    return scaled_loss, masked


# DefaultLossConfig defaults, packages/prime-rl-configs/src/prime_rl/configs/trainer.py @ 559b447
PRIMERL_DEFAULT_LOSS_CONFIG = SimpleNamespace(
    dppo_mask_low=0.2, dppo_mask_high=0.2, adv_tau=1.0, kl_tau=1e-3
)


def dppo():
    lp = _lp()
    mask = _t(MASK, torch.bool)
    adv = _adv_matrix(ADV)
    loss, masked = primerl_compute_loss(
        list(lp),
        list(_t(BEHAVIOUR)),
        list(adv),
        list(mask),
        PRIMERL_DEFAULT_LOSS_CONFIG,
        rl_scale=int(mask.sum()),
    )
    loss.backward()
    return {
        "DPPO_LOSS": loss.item(),
        "DPPO_GRAD": lp.grad.tolist(),
        "DPPO_MASKED": (torch.stack(masked) & mask).long().tolist(),
    }


# ----------------------------------------------------------------------------- TOPR (paper)


def topr_objective(logprobs, behaviour_logprobs, rewards, mask):
    """Le Roux et al., "Tapered Off-Policy REINFORCE", arXiv:2503.14286, sec. 3 (no reference
    code): the loss whose gradient is the TOPR estimator on trajectories sampled from mu,
        grad J = mean_tau [ 1{R >= 0} R grad log pi(tau) + 1{R < 0} [pi(tau) / mu(tau)]_0^1 R grad log pi(tau) ],
    i.e. mean over trajectories of -w R log pi(tau), w = sg(clip(pi / mu, 0, 1)) for R < 0, 1 otherwise,
    log pi(tau) = sum_t logprobs, pi(tau) / mu(tau) = exp(sum_t (logprobs - behaviour_logprobs)).
    Written out per trajectory. Returns (loss, weights [B])."""
    losses, weights = [], []
    for b in range(len(rewards)):
        m = mask[b].bool()
        log_pi = logprobs[b][m].sum()
        log_mu = behaviour_logprobs[b][m].sum()
        R = rewards[b]
        if R >= 0:
            w = torch.tensor(1.0, dtype=F64)
        else:
            w = torch.clamp(torch.exp(log_pi - log_mu), 0.0, 1.0).detach()
        losses.append(-w * R * log_pi)
        weights.append(w)
    return torch.stack(losses).mean(), torch.stack(weights)


def topr():
    lp = _lp()
    loss, w = topr_objective(lp, _t(BEHAVIOUR), ADV, _t(MASK))
    loss.backward()
    return {"TOPR_WEIGHTS": w.tolist(), "TOPR_LOSS": loss.item(), "TOPR_GRAD": lp.grad.tolist()}


# ----------------------------------------------------------------------------- Trinity-RFT


def trinity_masked_sum(values, mask, axis=None):
    """trinity/algorithm/utils.py masked_sum (read in the fork pan-x-c/Trinity-RFT @ edb802e:
    modelscope/Trinity-RFT's own history is not readable here at 5a4234e)."""
    return (values * mask).sum(axis=axis)


def trinity_masked_mean(values, mask, axis=None):
    """trinity/algorithm/utils.py masked_mean (pan-x-c/Trinity-RFT @ edb802e; the same line in
    modelscope/Trinity-RFT @ e5624fd and b458e2c)."""
    return (values * mask).sum(axis=axis) / (mask.sum(axis=axis) + 1e-8)


def trinity_aggregate_loss(values, mask, loss_agg_mode="token-mean", normalizer=None):
    """trinity/algorithm/utils.py aggregate_loss (pan-x-c/Trinity-RFT @ edb802e; named masked_loss
    in modelscope/Trinity-RFT @ e5624fd)."""
    if loss_agg_mode == "token-mean":
        return trinity_masked_mean(values, mask)
    elif loss_agg_mode == "seq-mean-token-sum":
        seq_losses = trinity_masked_sum(values, mask, axis=-1)  # [batch]
        return seq_losses.mean()
    elif loss_agg_mode == "seq-mean-token-mean":
        seq_losses = trinity_masked_mean(values, mask, axis=-1)  # [batch]
        return seq_losses.mean()
    elif loss_agg_mode == "seq-mean-token-sum-norm":
        total_token_sum = trinity_masked_sum(values, mask)  # scalar
        norm = normalizer if normalizer is not None else mask.shape[-1]
        return total_token_sum / (norm + 1e-8)
    raise ValueError(f"Invalid loss_agg_mode: {loss_agg_mode}")


class TrinityPPOPolicyLossFn:
    """modelscope/Trinity-RFT trinity/algorithm/policy_loss_fn/ppo_policy_loss.py PPOPolicyLossFn
    @ 5a4234e (enable_sequence_masking False, its default; metrics left out)."""

    def __init__(
        self,
        clip_range=None,
        clip_range_low=None,
        clip_range_high=None,
        clip_ratio_c=3.0,
        loss_agg_mode="token-mean",
    ):
        self.clip_range_low = clip_range if clip_range_low is None else clip_range_low
        self.clip_range_high = clip_range if clip_range_high is None else clip_range_high
        self.clip_ratio_c = clip_ratio_c
        assert clip_ratio_c > 1.0, "clip_ratio_c must be greater than 1.0."
        self.loss_agg_mode = loss_agg_mode

    def __call__(self, logprob, old_logprob, action_mask, advantages, **kwargs):
        negative_approx_kl = logprob - old_logprob
        # Clamp negative_approx_kl for stability
        negative_approx_kl = torch.clamp(negative_approx_kl, min=-20.0, max=20.0)
        ratio = torch.exp(negative_approx_kl)
        pg_losses1 = -advantages * ratio
        pg_losses2 = -advantages * torch.clamp(
            ratio, 1.0 - self.clip_range_low, 1.0 + self.clip_range_high
        )
        clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
        pg_losses3 = -advantages * self.clip_ratio_c
        clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
        pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
        pg_loss = trinity_aggregate_loss(pg_losses, action_mask, loss_agg_mode=self.loss_agg_mode)
        return pg_loss, {}


class TrinitySFTLossFn:
    """modelscope/Trinity-RFT trinity/algorithm/policy_loss_fn/sft_loss.py SFTLossFn @ 51d229f."""

    def __init__(self, use_token_level_loss=True):
        self.use_token_level_loss = use_token_level_loss

    def __call__(self, logprob, action_mask, **kwargs):
        if self.use_token_level_loss:
            sft_loss = trinity_masked_mean(-logprob, action_mask)
        else:
            sft_loss = trinity_masked_mean(-logprob, action_mask, axis=1).mean()
        return sft_loss, {}


class TrinityMIXPolicyLossFn:
    """modelscope/Trinity-RFT trinity/algorithm/policy_loss_fn/mix_policy_loss.py MIXPolicyLossFn
    @ c10d414 (use_dynamic_bsz False; the sizes are given so that gradient_accumulation is 1)."""

    def __init__(
        self,
        mu=0.1,
        clip_range=None,
        clip_range_low=None,
        clip_range_high=None,
        use_dynamic_bsz=None,
        repeat_times=None,
        ppo_mini_batch_size=None,
        ppo_micro_batch_size_per_gpu=None,
        ngpus_trainer=None,
        read_batch_size_usual=None,
        read_batch_size_expert=None,
        use_token_level_loss_in_sft=True,
    ):
        self.mu = mu
        self.use_dynamic_bsz = use_dynamic_bsz
        self.experience_per_gpu = ppo_mini_batch_size * repeat_times // ngpus_trainer
        self.gradient_accumulation = (
            ppo_mini_batch_size * repeat_times // ppo_micro_batch_size_per_gpu
        )
        self.read_batch_size_usual = read_batch_size_usual
        self.read_batch_size_expert = read_batch_size_expert
        self.grpo_loss_fn = TrinityPPOPolicyLossFn(
            clip_range=clip_range, clip_range_low=clip_range_low, clip_range_high=clip_range_high
        )
        self.sft_loss_fn = TrinitySFTLossFn(use_token_level_loss=use_token_level_loss_in_sft)

    def __call__(self, logprob, old_logprob, action_mask, advantages, **kwargs):
        is_expert_mask = kwargs.get("is_expert_mask", None)
        if is_expert_mask is None:
            raise ValueError("is_expert_mask is required in MIX")
        assert len(is_expert_mask) == logprob.shape[0]

        n_usual_exp = torch.sum(~is_expert_mask).item()
        n_expert_exp = torch.sum(is_expert_mask).item()

        if self.use_dynamic_bsz:
            per_micro_batch_weight_usual = self.experience_per_gpu / (
                logprob.shape[0] * self.read_batch_size_usual
            )
            per_micro_batch_weight_expert = self.experience_per_gpu / (
                logprob.shape[0] * self.read_batch_size_expert
            )
        else:
            per_micro_batch_weight_usual = self.gradient_accumulation / self.read_batch_size_usual
            per_micro_batch_weight_expert = self.gradient_accumulation / self.read_batch_size_expert

        if n_usual_exp > 0:
            grpo_loss, _ = self.grpo_loss_fn(
                logprob[~is_expert_mask],
                old_logprob[~is_expert_mask],
                action_mask[~is_expert_mask],
                advantages[~is_expert_mask],
                **kwargs,
            )
            grpo_loss = grpo_loss * n_usual_exp * per_micro_batch_weight_usual
        else:
            grpo_loss = torch.tensor(0.0, device=logprob.device)

        # SFT Loss (expert)
        if n_expert_exp > 0:
            sft_loss, _ = self.sft_loss_fn(logprob[is_expert_mask], action_mask[is_expert_mask])
            sft_loss = sft_loss * n_expert_exp * per_micro_batch_weight_expert
        else:
            sft_loss = torch.tensor(0.0, device=logprob.device)

        loss = (1 - self.mu) * grpo_loss + self.mu * sft_loss
        return loss, {}


def mix():
    expert = _t(MIX_EXPERT, torch.bool)
    n_usual, n_expert = int((~expert).sum()), int(expert.sum())
    # one micro-batch holding the whole batch: ppo_mini_batch_size * repeat_times // micro = 1
    fn = TrinityMIXPolicyLossFn(
        mu=0.25,
        clip_range=0.2,
        use_dynamic_bsz=False,
        repeat_times=len(LP),
        ppo_mini_batch_size=1,
        ppo_micro_batch_size_per_gpu=len(LP),
        ngpus_trainer=1,
        read_batch_size_usual=n_usual,
        read_batch_size_expert=n_expert,
    )
    lp = _lp()
    loss, _ = fn(lp, _t(BEHAVIOUR), _t(MASK), _adv_matrix(ADV), is_expert_mask=expert)
    loss.backward()
    return {"MIX_LOSS": loss.item(), "MIX_GRAD": lp.grad.tolist()}


def trinity_opmd_group_advantage(rewards, groups, opmd_baseline="mean", tau=1.0):
    """modelscope/Trinity-RFT trinity/algorithm/advantage_fn/opmd_advantage.py
    OPMDGroupAdvantage.calculate_group_advantage @ 547adf1, applied to each task group
    (group_experiences = group_by(exps, "task")); one advantage per experience (its
    action_mask is all ones). float64 instead of the source's float32."""
    by_group = defaultdict(list)
    for i, g in enumerate(groups):
        by_group[g].append(i)
    adv = [None] * len(rewards)
    for members in by_group.values():
        with torch.no_grad():
            group_rewards = torch.tensor([rewards[i] for i in members], dtype=F64)
            if len(members) == 1:
                group_baseline = torch.tensor(0.0)
            else:
                if opmd_baseline == "mean":
                    group_baseline = torch.mean(group_rewards)
                else:
                    group_baseline = tau * (
                        torch.logsumexp(group_rewards / tau, dim=-1)
                        - torch.log(torch.tensor(len(members), dtype=F64))
                    )
            for i in members:
                adv[i] = float(rewards[i] - group_baseline)
    return adv


def trinity_opmd_policy_loss(logprob, old_log_probs, response_mask, advantages, tau=1.0):
    """modelscope/Trinity-RFT trinity/algorithm/policy_loss_fn/opmd_policy_loss.py
    OPMDPolicyLossFn.__call__ @ 70c21ac."""
    pg_losses = -advantages * logprob
    opmd_loss = trinity_masked_mean(pg_losses, response_mask)
    opmd_loss = opmd_loss / (1.0 + tau)  # for regularization (w.r.t. current pi_theta)
    return opmd_loss


def opmd_simple():
    adv = trinity_opmd_group_advantage(R4, G4)
    lp = _lp()
    loss = trinity_opmd_policy_loss(lp, _t(BEHAVIOUR), _t(MASK), _adv_matrix(adv), tau=0.5)
    loss.backward()
    return {"SIMPLE_LOSS": loss.item(), "SIMPLE_GRAD": lp.grad.tolist()}


def yaochaorui_compute_policy_loss_opmd_v0(old_log_prob, log_prob, advantages, eos_mask, tau):
    """Trinity-RFT trinity/trainer/verl/core_algos.py compute_policy_loss_opmd, the commented-out
    "version 0: kimi-opmd" block, read in the fork yaochaorui/Trinity-RFT @ 50aba82
    (verl_F.masked_sum is (values * mask).sum())."""
    log_prob_diff = log_prob - old_log_prob
    # the original quadratic loss in OPMD can be reformulated as follows
    pg_losses = -advantages * log_prob
    pg_loss = verl_masked_sum(pg_losses, eos_mask)
    reg_losses = (log_prob_diff * eos_mask).sum(dim=-1).square()
    reg_loss = reg_losses.sum()
    opmd_loss = (pg_loss + 0.5 * tau * reg_loss) / eos_mask.sum()
    opmd_loss = opmd_loss / max(1.0, tau)  # for stability when tau is large
    return opmd_loss


def kimi():
    out = {}
    for tau in (0.7, 2.0):
        adv = trinity_opmd_group_advantage(R4, G4, opmd_baseline="logavgexp", tau=tau)
        lp = _lp()
        loss = yaochaorui_compute_policy_loss_opmd_v0(
            _t(BEHAVIOUR), lp, _adv_matrix(adv), _t(MASK), tau
        )
        loss.backward()
        out[tau] = (adv, loss.item(), lp.grad.tolist())
    return {"KIMI": out}


def yaochaorui_compute_policy_loss_pairwise_opmd(
    old_log_prob, log_prob, token_level_scores, eos_mask, index, tau
):
    """Trinity-RFT trinity/trainer/verl/core_algos.py compute_policy_loss_pairwise_opmd, read in
    the fork yaochaorui/Trinity-RFT @ 50aba82 (the logging-only pg_clipfrac / ppo_kl left out)."""
    # loss for pairwise_opmd
    scores = token_level_scores.sum(dim=-1)
    action_level_log_prob = (log_prob * eos_mask).sum(dim=-1)
    diffs = scores - tau * (action_level_log_prob - action_level_log_prob.detach())

    if index is None:
        normalizer = eos_mask.sum() * max(1.0, tau)
        opmd_loss = (diffs - diffs.mean()).square().sum() / normalizer
    else:
        opmd_loss = None
        unique_index = list(set(index.tolist()))
        for idx in unique_index:
            subdiff = diffs[index == idx]
            if subdiff.shape[0] == 1:
                continue
            subloss = (subdiff - subdiff.mean()).square().sum()
            if opmd_loss is None:
                opmd_loss = subloss
            else:
                opmd_loss = opmd_loss + subloss
        normalizer = eos_mask.sum() * max(1.0, tau)
        opmd_loss = opmd_loss / normalizer
    return opmd_loss


def pairwise():
    out = {}
    lengths = _t(MASK).sum(-1)
    for tau, groups in ((0.7, (0, 0, 1, 1)), (2.0, (0, 0, 0, 1))):
        lp = _lp()
        scores = _outcome_rewards(R4, lengths, len(LP[0]))
        loss = yaochaorui_compute_policy_loss_pairwise_opmd(
            _t(BEHAVIOUR), lp, scores, _t(MASK), torch.tensor(groups), tau
        )
        loss.backward()
        out[(tau, groups)] = (loss.item(), lp.grad.tolist())
    return {"PAIRWISE": out}


def trinity_group_by(exps, id_type):
    """trinity/common/experience.py group_by: experiences grouped by one part of their id, in order."""
    grouped = defaultdict(list)
    for exp in exps:
        grouped[getattr(exp.eid, id_type)].append(exp)
    return grouped


class TrinityStepWiseGRPOAdvantageFn:
    """modelscope/Trinity-RFT trinity/algorithm/advantage_fn/multi_step_grpo_advantage.py
    StepWiseGRPOAdvantageFn @ 369bf62 (defaults: epsilon 1e-6, enable_step_norm False,
    std_cal_level "group", std_threshold None; metrics left out; float64)."""

    def __init__(
        self, epsilon=1e-6, enable_step_norm=False, std_cal_level="group", std_threshold=None
    ):
        self.epsilon = epsilon
        self.enable_step_norm = enable_step_norm
        self.std_cal_level = std_cal_level
        self.std_threshold = std_threshold

    def calculate_last_step_advantage(self, exps, precomputed_std=None):
        with torch.no_grad():
            if len(exps) == 1:
                group_reward_mean = torch.tensor(0.0)
                group_reward_std = torch.tensor(1.0)
            else:
                rewards = torch.tensor([exp.reward for exp in exps.values()], dtype=F64)
                group_reward_mean = torch.mean(rewards)
                group_reward_std = torch.std(rewards)
            std_threshold_skipped = 0
            if self.std_threshold is not None:
                if len(exps) == 1 or group_reward_std <= self.std_threshold:
                    std_threshold_skipped = 1
            scores = {}
            for rid, exp in exps.items():
                if self.std_cal_level == "batch" and precomputed_std is not None:
                    score = (exp.reward - group_reward_mean) / (precomputed_std + self.epsilon)
                else:
                    score = (exp.reward - group_reward_mean) / (group_reward_std + self.epsilon)
                scores[rid] = score.item()
        return scores, {"std_threshold_skipped": std_threshold_skipped}

    def broadcast_advantages(self, run_exps, scores):
        for run_id, exps in run_exps.items():
            score = scores[run_id]
            traj_length = len(exps)
            for exp in exps:
                exp.advantages = exp.action_mask * score
                if self.enable_step_norm:
                    exp.advantages /= traj_length
                exp.returns = exp.advantages.clone()
        return run_exps

    def process(self, exps):
        if len(exps) == 0:
            return []
        task_exps = trinity_group_by(exps, "task")
        precomputed_std = None  # std_cal_level "group"
        result_exps = []
        for task_exp in task_exps.values():
            run_exps = trinity_group_by(task_exp, "run")
            last_step_exps = {run_id: step_exps[-1] for run_id, step_exps in run_exps.items()}
            scores, metrics = self.calculate_last_step_advantage(
                last_step_exps, precomputed_std=precomputed_std
            )
            if metrics.get("std_threshold_skipped", 0) == 1:
                continue
            run_exps = self.broadcast_advantages(run_exps, scores)
            for exps_ in run_exps.values():
                result_exps.extend(exps_)
        return result_exps


def stepwise():
    exps = [
        SimpleNamespace(
            eid=SimpleNamespace(task=g, run=r), reward=x, action_mask=torch.ones(1, dtype=F64)
        )
        for x, g, r in zip(STEP_R, STEP_G, STEP_T)
    ]
    TrinityStepWiseGRPOAdvantageFn().process(exps)
    return {"STEPWISE_ADV": [float(e.advantages[0]) for e in exps]}


# ----------------------------------------------------------------------------- PipelineRL


def pipelinerl_mask_sum(values, mask, axis=None):
    """ServiceNow/PipelineRL pipelinerl/finetune/rl/utils.py mask_sum @ 58d3934."""
    if axis is not None:
        return (values * mask).nan_to_num(0).sum(axis=axis)
    return (values * mask).nan_to_num(0).sum()


def pipelinerl_sum_sum(values, masks, segments):
    """ServiceNow/PipelineRL pipelinerl/finetune/rl/utils.py sum_sum @ 58d3934."""
    is_sentinel_batch = values.shape[-1] == 1  # sentinel batch
    if segments and not is_sentinel_batch:
        assert values.shape[0] == 1, "seq packed samples must have dimension 0 of 1"
        masked_sums = torch.stack(
            [
                pipelinerl_mask_sum(values[0, start:end], masks[0, start:end])
                for start, end in segments
            ]
        )
        return masked_sums.sum()
    return pipelinerl_mask_sum(values, masks)


def pipelinerl_linear_decay_coef(current_step, max_step, initial_coef, final_coef):
    """ServiceNow/PipelineRL pipelinerl/finetune/rl/__init__.py linear_decay_coef @ 58d3934."""
    return initial_coef + (final_coef - initial_coef) * current_step / max_step


def pipelinerl_rl_step_reinforce(new_logprobs, batch, config, current_step=0, max_step=1):
    """ServiceNow/PipelineRL pipelinerl/finetune/rl/__init__.py rl_step @ 58d3934, policy_loss
    "reinforce", unpacked batch (segments None), no value head, no entropy term (entropy_bonus
    0 -> use_entropy_loss False). new_logprobs [B, L-1] stand for the model's
    log-probs of input_ids[:, 1:]; the batch tensors are aligned with input_ids [B, L] and
    shifted by one as in the source. Returns (final_loss, clamp indicators [B, L-1])."""
    masks = batch.labels != -100
    masks_shifted = masks[:, 1:]
    segments = None

    ref_logprobs = batch.ref_logprobs[:, 1:]
    old_logprobs = batch.old_logprobs[:, 1:]
    group_tokens = batch.group_tokens[:, 1:]
    overflow = batch.overflow[:, 1:]

    if config.group_normalization:
        assert (group_tokens > 0).all(), (
            "group_tokens must be greater than zero for group normalization"
        )
        tokens_weights = torch.ones_like(group_tokens) / group_tokens
    else:
        tokens_weights = torch.ones_like(group_tokens) / config.batch_size

    if config.overlong_filtering:
        tokens_weights = tokens_weights * (1 - overflow)

    log_ratio_new_old = new_logprobs - old_logprobs
    ratio_new_old = torch.exp(log_ratio_new_old)
    log_ratio_ref_new = ref_logprobs - new_logprobs

    advantages = batch.advantages[:, 1:]
    log_p_weights = advantages.detach() if config.use_advantages else batch.rewards[:, 1:]
    if config.relu_log_p_weights:
        log_p_weights = torch.clamp(log_p_weights, min=0)

    log_ratio_ref_new_clamp = torch.clamp(
        log_ratio_ref_new,
        min=-config.clamp_log_ratio_ref_new_value,
        max=config.clamp_log_ratio_ref_new_value,
    )
    approx_kl = (
        torch.exp(log_ratio_ref_new_clamp) - log_ratio_ref_new_clamp - 1
    )  # Schulman KL approx
    kl_coef = pipelinerl_linear_decay_coef(
        current_step, max_step, config.kl_coef, config.final_kl_coef
    )

    # case "reinforce"
    clamp_log_ratio_new_old_indicators = ratio_new_old > 1 + config.epsilon_high
    ratio_new_old = torch.clamp(ratio_new_old, 0, 1 + config.epsilon_high)
    policy_loss = new_logprobs * log_p_weights * ratio_new_old.detach()

    loss = policy_loss - kl_coef * approx_kl
    assert loss.shape == tokens_weights.shape
    loss = loss * tokens_weights  # 1 x (BxL) x 1
    policy_loss_total = -pipelinerl_sum_sum(loss, masks_shifted, segments)
    return policy_loss_total, clamp_log_ratio_new_old_indicators


# conf/finetune/base.yaml rl: @ 58d3934 (policy_loss reinforce, kl_coef 0, epsilon 2e-2, use_advantages,
# no relu, clamp 5, no overlong filtering); batch_size = the 4 sequences of the batch
PIPELINERL_CONFIG = SimpleNamespace(
    epsilon_low=2e-2,
    epsilon_high=2e-2,
    kl_coef=0.0,
    final_kl_coef=0.0,
    use_advantages=True,
    relu_log_p_weights=False,
    clamp_log_ratio_ref_new_value=5,
    overlong_filtering=False,
    group_normalization=False,
    batch_size=4,
)


def tis():
    B, T = len(LP), len(LP[0])

    def aligned(x):  # prepend the (prompt) position the batch tensors carry before the response
        return torch.cat([torch.zeros(B, 1, dtype=F64), _t(x)], dim=1)

    labels = torch.cat(
        [torch.full((B, 1), -100), torch.where(_t(MASK, torch.bool), 1, -100)], dim=1
    )
    batch = SimpleNamespace(
        labels=labels,
        old_logprobs=aligned(BEHAVIOUR),
        ref_logprobs=aligned(BEHAVIOUR),
        advantages=aligned(_adv_matrix(ADV).tolist()),
        rewards=aligned([[0.0] * T] * B),
        group_tokens=aligned([[1.0] * T] * B),
        overflow=aligned([[0.0] * T] * B),
    )
    lp = _lp()
    loss, truncated = pipelinerl_rl_step_reinforce(lp, batch, PIPELINERL_CONFIG)
    loss.backward()
    return {
        "TIS_LOSS": loss.item(),
        "TIS_GRAD": lp.grad.tolist(),
        "TIS_TRUNCATED": truncated.long().tolist(),
    }


# ----------------------------------------------------------------------------- verl: losses, estimators


def kl_estimators():
    logp, logq = _t(KL_LOGP), _t(KL_LOGQ)
    names = {"k1": "k1", "k2": "k2", "k3": "k3", "low_var": "low_var_kl"}
    return {
        "KL_REF": {k: verl_kl_penalty_forward(logp, logq, v).tolist() for k, v in names.items()}
    }


def ppo():
    lp = _lp()
    loss, tokens = verl_compute_policy_loss_vanilla(
        _t(BEHAVIOUR),
        lp,
        _adv_matrix(ADV),
        _t(MASK),
        "token-mean",
        clip_ratio=0.2,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=3.0,
    )
    loss.backward()
    _, extreme = verl_compute_policy_loss_vanilla(
        _t(PPO_EXTREME_BEHAVIOUR),
        _t(PPO_EXTREME_LP),
        -torch.ones(1, 3, dtype=F64),
        torch.ones(1, 3, dtype=F64),
    )
    return {
        "PPO_TOKENS": tokens.tolist(),
        "PPO_LOSS": loss.item(),
        "PPO_GRAD": lp.grad.tolist(),
        "PPO_EXTREME": (PPO_EXTREME_LP, PPO_EXTREME_BEHAVIOUR, extreme.tolist()),
    }


def gspo():
    out = {}
    for clip in ((0.1, 0.2), (3e-4, 4e-4)):
        lp = _lp()
        loss = verl_compute_policy_loss_gspo(
            _t(BEHAVIOUR),
            lp,
            _adv_matrix(ADV),
            _t(MASK),
            clip_ratio_low=clip[0],
            clip_ratio_high=clip[1],
        )
        loss.backward()
        out[clip] = (loss.item(), lp.grad.tolist())
    lp = _t(GSPO_EXTREME_LP).requires_grad_(True)
    extreme = verl_compute_policy_loss_gspo(
        _t(GSPO_EXTREME_BEHAVIOUR),
        lp,
        torch.ones(1, 2, dtype=F64),
        torch.ones(1, 2, dtype=F64),
        clip_ratio_low=0.1,
        clip_ratio_high=1e9,
    )
    return {"GSPO": out, "GSPO_EXTREME_LOSS": extreme.item()}


def cispo():
    lp = _lp()
    loss = verl_compute_policy_loss_cispo(
        _t(BEHAVIOUR), lp, _adv_matrix(ADV), _t(MASK), clip_ratio_low=1.0, clip_ratio_high=0.28
    )
    loss.backward()
    return {"CISPO_LOSS": loss.item(), "CISPO_GRAD": lp.grad.tolist()}


def advantages():
    width = max(COUNTS10)
    index = np.array(G10)  # verl's index: the uid array of the batch (non_tensor_batch["uid"])
    rewards = _outcome_rewards(R10, COUNTS10, width)
    mask = _response_mask(COUNTS10, width)

    def first(x):  # each sequence's (broadcast) advantage: its first token's
        return x[:, 0].tolist()

    out = {
        "GRPO_ADV": first(verl_compute_grpo_outcome_advantage(rewards.clone(), mask, index)[0]),
        "DR_GRPO_ADV": first(
            verl_compute_grpo_outcome_advantage(
                rewards.clone(), mask, index, norm_adv_by_std_in_grpo=False
            )[0]
        ),
        "RLOO_ADV": first(verl_compute_rloo_outcome_advantage(rewards.clone(), mask, index)[0]),
        "RPP_BASELINE_ADV": first(
            verl_compute_reinforce_plus_plus_baseline_outcome_advantage(
                rewards.clone(), mask, index
            )[0]
        ),
        "RPP_ADV": first(
            verl_compute_reinforce_plus_plus_outcome_advantage(rewards.clone(), mask, gamma=1.0)[0]
        ),
        "OPMD_ADV_MEAN": trinity_opmd_group_advantage(R10, G10),
        "OPMD_ADV_LOGAVGEXP": trinity_opmd_group_advantage(
            R10, G10, opmd_baseline="logavgexp", tau=0.5
        ),
    }
    five = [5] * len(R10)
    out["RPP_BASELINE_ADV_5_TOKENS"] = first(
        verl_compute_reinforce_plus_plus_baseline_outcome_advantage(
            _outcome_rewards(R10, five, 5), _response_mask(five, 5), index
        )[0]
    )
    return out


def entropy():
    return {"ENTROPY": verl_entropy_from_logits(_t(ENTROPY_LOGITS)).tolist()}


# ----------------------------------------------------------------------------- TRL DPO


def trl_dpo_compute_loss(
    per_token_logps,
    ref_per_token_logps,
    shift_completion_mask,
    beta=0.1,
    loss_types=("sigmoid",),
    loss_weights=None,
    f_divergence_type="reverse_kl",
):
    """huggingface/trl trl/trainer/dpo_trainer.py DPOTrainer._compute_loss @ f2cd577, from the
    per-token log-probs on: the batch is [chosen..., rejected...]; ld_alpha None, reference
    log-probs computed (not precomputed), f_divergence_type "reverse_kl", loss_type ["sigmoid"],
    loss_weights None -> [1.0], use_weighting False, no aux loss; metrics left out. The model's
    forward (selective_log_softmax of the shifted logits) is replaced by the given log-probs."""
    loss_weights = loss_weights or [1.0] * len(loss_types)
    per_token_logps = per_token_logps.clone()
    per_token_logps[shift_completion_mask == 0] = 0.0  # mask out non-completion tokens
    logps = per_token_logps.sum(dim=1)  # sum over sequence length
    chosen_logps, rejected_logps = logps.chunk(2, dim=0)  # batch is [chosen, rejected]

    with torch.no_grad():
        ref_per_token_logps = ref_per_token_logps.clone()
        ref_per_token_logps[shift_completion_mask == 0] = 0.0  # mask out non-completion tokens
        ref_logps = ref_per_token_logps.sum(dim=1)  # sum over sequence length
        ref_chosen_logps, ref_rejected_logps = ref_logps.chunk(
            2, dim=0
        )  # batch is [chosen, rejected]

    # Get the log ratios for the chosen and rejected responses
    chosen_logratios = chosen_logps - ref_chosen_logps
    rejected_logratios = rejected_logps - ref_rejected_logps

    if f_divergence_type == "reverse_kl":  # standard DPO
        chosen_scores = chosen_logratios
        rejected_scores = rejected_logratios
    else:
        raise NotImplementedError(f_divergence_type)

    delta_score = chosen_scores - rejected_scores

    loss = 0.0
    for loss_type, loss_weight in zip(loss_types, loss_weights, strict=True):
        if loss_type == "sigmoid":
            per_sequence_loss = -F.logsigmoid(beta * delta_score)
        else:
            raise NotImplementedError(loss_type)
        loss += per_sequence_loss.mean() * loss_weight
    return loss


def dpo():
    """Pairs by reward (DPO_REWARDS): (chosen 0, rejected 1) and (chosen 3, rejected 2); reference
    log-probs = BEHAVIOUR; beta 0.2. TRL's collator stacks the chosen then the rejected completions."""
    lp = _lp()
    rows = torch.tensor([0, 3, 1, 2])  # [chosen 0, chosen 3, rejected 1, rejected 2]
    loss = trl_dpo_compute_loss(lp[rows], _t(BEHAVIOUR)[rows], _t(MASK)[rows], beta=0.2)
    loss.backward()
    return {"DPO_LOSS": loss.item(), "DPO_GRAD": lp.grad.tolist()}


# ----------------------------------------------------------------------------- tinker-cookbook: on-policy distillation


def tinker_compute_advantages(rewards_P):
    """thinking-machines-lab/tinker-cookbook tinker_cookbook/rl/data_processing.py compute_advantages
    @ 9dfcc3a, each group's total rewards given as a list (traj_group.get_total_rewards())."""
    advantages_P = []
    for rewards in rewards_P:
        rewards_G = torch.tensor(rewards)
        # Center advantages within the group
        advantages_G = rewards_G - rewards_G.mean()
        advantages_P.append(advantages_G)
    return advantages_P


def tinker_datum(prompt_len, action_logprobs, traj_advantage):
    """The loss_fn_inputs of tinker-cookbook's trajectory_to_data (tinker_cookbook/rl/data_processing.py
    @ 9dfcc3a) for a trajectory of one transition (an observation of `prompt_len` tokens, one action) and
    no parse error: sampled log-probs, advantages and mask over the full sequence, then [1:] (the targets)."""
    sampled_logprobs = [0.0] * prompt_len + action_logprobs
    advantages = [0] * prompt_len + [traj_advantage] * len(action_logprobs)
    mask = [0.0] * prompt_len + [1.0] * len(action_logprobs)
    return {
        "logprobs": torch.tensor(sampled_logprobs[1:]),
        "advantages": torch.tensor(advantages[1:]),
        "mask": torch.tensor(mask[1:]),
    }


def tinker_incorporate_kl_penalty(data_D, teacher_logprobs_D, kl_penalty_coef, kl_discount_factor):
    """thinking-machines-lab/tinker-cookbook tinker_cookbook/distillation/train_on_policy.py
    incorporate_kl_penalty @ 9dfcc3a: each datum its loss_fn_inputs (dict of tensors); the teacher's
    compute_logprobs_async replaced by its result teacher_logprobs_D (the full sequence's, None first);
    one dataset; kl_discount_factor 0 (discounted_future_sum_vectorized is not reached). Updates the
    datums' advantages; returns the metrics."""
    # The reverse KL is computed as KL[p||q] = log p - log q, where
    #   - p: sampled_logprobs
    #   - q: teacher_logprobs
    sampled_logprobs_D = [datum["logprobs"] for datum in data_D]
    float_masks = [datum["mask"].float() for datum in data_D]
    reverse_kl = [
        (sampled_logprobs - torch.tensor(teacher_logprobs[1:])) * mask
        for teacher_logprobs, sampled_logprobs, mask in zip(
            teacher_logprobs_D, sampled_logprobs_D, float_masks
        )
    ]
    for i, datum in enumerate(data_D):
        # The advantage is the negative reverse KL. We can optionally apply a discount factor.
        kl_advantages = -kl_penalty_coef * float_masks[i] * reverse_kl[i]
        assert kl_discount_factor == 0
        datum["advantages"] = datum["advantages"] + kl_advantages
    # Compute average reverse KL over the batch for logging purposes
    avg_logp_diff = sum([diff.sum() for diff in reverse_kl]) / sum(
        [mask.sum() for mask in float_masks]
    )
    return {"teacher_kl": float(avg_logp_diff)}


def tinker_importance_sampling_loss(target_logprobs, sampling_logprobs, advantages):
    """Tinker's "importance_sampling" loss of one datum as its documentation writes it
    (tinker-docs.thinkingmachines.ai/losses, Importance sampling); forward_backward sums it over the datums."""
    # Compute probability ratio
    prob_ratio = torch.exp(target_logprobs - sampling_logprobs)
    # Compute importance-weighted loss
    loss = -(prob_ratio * advantages).sum()
    return loss


def distill():
    """tinker-cookbook's on-policy distillation step on the fixed batch: sequence i a prompt of DISTILL_PROMPT
    tokens and a response of sum(MASK[i]) tokens sampled with BEHAVIOUR, scored by TEACHER; groups G4 with
    rewards R4 (else all rewards 0: no task advantage); the current policy's log-probs LP."""
    out = {}
    for coef, task in ((0.5, "rewards"), (1.0, "none")):
        lengths = [int(sum(m)) for m in MASK]
        groups = [
            [r if task == "rewards" else 0.0 for r, g in zip(R4, G4) if g == k]
            for k in sorted(set(G4))
        ]
        advantages = [a for adv in tinker_compute_advantages(groups) for a in adv.tolist()]
        data_D = [
            tinker_datum(DISTILL_PROMPT, BEHAVIOUR[i][:n], advantages[i])
            for i, n in enumerate(lengths)
        ]
        teacher_logprobs_D = [
            [None] + TEACHER_PROMPT + TEACHER[i][:n] for i, n in enumerate(lengths)
        ]
        metrics = tinker_incorporate_kl_penalty(data_D, teacher_logprobs_D, coef, 0.0)
        lp = _lp()
        loss = sum(
            tinker_importance_sampling_loss(
                torch.cat([torch.zeros(DISTILL_PROMPT - 1), lp[i, :n]]),
                datum["logprobs"],
                datum["advantages"],
            )
            for i, (n, datum) in enumerate(zip(lengths, data_D))
        )
        loss.backward()
        adv = [
            datum["advantages"][DISTILL_PROMPT - 1 :].tolist() + [0.0] * (len(MASK[0]) - n)
            for n, datum in zip(lengths, data_D)
        ]
        out[(coef, task)] = (adv, metrics["teacher_kl"], loss.item(), lp.grad.tolist())
    return {"DISTILL": out}


# ----------------------------------------------------------------------------- rollout corrections

# verl/trainer/ppo/rollout_corr_helper.py @ b178a3c
VERL_SAFETY_BOUND = 20.0
VERL_SUPPORTED_ROLLOUT_RS_OPTIONS = {
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
}
VERL_TOKEN_LEVEL_ROLLOUT_RS_OPTIONS = {"token_k1", "token_k2", "token_k3"}


def verl_parse_rollout_rs_thresholds(options, threshold_spec):
    """volcengine/verl verl/trainer/ppo/rollout_corr_helper.py _parse_rollout_rs_thresholds
    @ b178a3c."""
    if threshold_spec is None:
        raise ValueError("rollout_rs_threshold must be provided for rejection sampling.")

    if isinstance(threshold_spec, int | float):
        raw_specs = [str(threshold_spec)]
    elif isinstance(threshold_spec, str):
        raw_specs = [part.strip() for part in threshold_spec.split(",") if part.strip()]
    else:
        raise TypeError(
            "rollout_rs_threshold must be a string or numeric value specifying per-option thresholds."
        )

    if not raw_specs:
        raise ValueError("rollout_rs_threshold must contain at least one threshold value.")

    if len(raw_specs) not in (1, len(options)):
        raise ValueError(
            f"rollout_rs_threshold expects either one threshold shared by all options or exactly "
            f"{len(options)} thresholds to match the provided rollout_rs options."
        )

    if len(raw_specs) == 1 and len(options) > 1:
        raw_specs = raw_specs * len(options)

    thresholds = {}
    for option, spec in zip(options, raw_specs, strict=False):
        if option.endswith("k1"):
            if "_" in spec:
                lower_str, upper_str = spec.split("_", 1)
            else:
                upper_str = spec
                lower_str = str(1.0 / float(upper_str))
            try:
                lower = float(lower_str)
                upper = float(upper_str)
            except ValueError as exc:
                raise ValueError(
                    f"Invalid numeric threshold '{spec}' for option '{option}'."
                ) from exc
            if lower <= 0 or upper <= 0:
                raise ValueError(f"Thresholds for option '{option}' must be positive, got {spec}.")
            thresholds[option] = {
                "lower": lower,
                "upper": upper,
            }
        else:
            if "_" in spec:
                raise ValueError(
                    f"rollout_rs_threshold for option '{option}' must provide a single upper bound "
                    f"without '_'. Received '{spec}'."
                )
            try:
                upper = float(spec)
            except ValueError as exc:
                raise ValueError(
                    f"Invalid numeric threshold '{spec}' for option '{option}'."
                ) from exc
            if upper <= 0:
                raise ValueError(f"Threshold for option '{option}' must be positive, got {spec}.")
            thresholds[option] = {
                "lower": None,
                "upper": upper,
            }
    return thresholds


def verl_compute_rollout_rejection_mask(
    log_ratio, response_mask, rollout_rs="token_k1", rollout_rs_threshold=None
):
    """volcengine/verl verl/trainer/ppo/rollout_corr_helper.py compute_rollout_rejection_mask
    @ b178a3c (the metrics, compute_rs_metrics and the masked fractions, left out). Returns the
    modified response mask."""
    if rollout_rs is None or not isinstance(rollout_rs, str):
        raise ValueError(
            "rollout_rs must be a non-empty string (comma separated for multiple options)."
        )
    if rollout_rs_threshold is None:
        raise ValueError("rollout_rs_threshold must be provided for rejection sampling.")

    if log_ratio.shape[0] == 0:
        return response_mask

    # rollout_rs supports chained criteria via comma separation (e.g. "token_k1,seq_mean_k3").
    #            Every listed option must pass; combined_mask aggregates them via logical AND.
    option_modes = [opt.strip() for opt in rollout_rs.split(",") if opt.strip()]
    if not option_modes:
        raise ValueError("rollout_rs must contain at least one valid option.")

    normalized_options = []
    seen = set()
    for opt in option_modes:
        if opt not in VERL_SUPPORTED_ROLLOUT_RS_OPTIONS:
            raise ValueError(
                f"Invalid rollout_rs option: {opt}. Must be one of {sorted(VERL_SUPPORTED_ROLLOUT_RS_OPTIONS)}."
            )
        if opt not in seen:
            normalized_options.append(opt)
            seen.add(opt)

    threshold_specs = verl_parse_rollout_rs_thresholds(normalized_options, rollout_rs_threshold)

    log_ratio_safe = torch.clamp(log_ratio, min=-VERL_SAFETY_BOUND, max=VERL_SAFETY_BOUND)
    token_k1 = -log_ratio_safe
    token_k2 = 0.5 * log_ratio_safe**2
    token_k3 = torch.exp(log_ratio_safe) - 1.0 - log_ratio_safe

    response_mask_bool = response_mask.bool()
    # combined_mask accumulates per-option passes; any failure flips tokens to 0.
    combined_mask = torch.ones_like(response_mask, dtype=log_ratio.dtype)

    def _sequence_sum(values):
        return verl_masked_sum(values, response_mask, axis=-1)

    def _sequence_mean(values):
        return verl_masked_mean(values, response_mask, axis=-1)

    def _sequence_max(values):
        mask_bool = response_mask.bool()
        neg_inf = torch.tensor(float("-inf"), device=values.device, dtype=values.dtype)
        masked_values = values.masked_fill(~mask_bool, neg_inf)
        max_values = masked_values.max(dim=-1).values
        return torch.where(max_values == neg_inf, torch.zeros_like(max_values), max_values)

    for option_name in normalized_options:
        thresholds_info = threshold_specs[option_name]
        is_k1_option = option_name.endswith("k1")
        upper_value = thresholds_info["upper"]
        lower_value = thresholds_info["lower"]
        lower_log = None
        upper_log = None

        if is_k1_option:
            if lower_value is None or upper_value is None:
                raise ValueError(
                    f"rollout_rs_threshold for option '{option_name}' must specify both lower and upper bounds."
                )
            lower_log = math.log(lower_value)
            upper_log = math.log(upper_value)
        else:
            if upper_value is None:
                raise ValueError(
                    f"rollout_rs_threshold for option '{option_name}' must specify an upper bound."
                )

        if option_name == "token_k1":
            if lower_log is None:
                raise ValueError(
                    "Threshold specification for token_k1 must include lower and upper bounds."
                )
            per_token_stat = token_k1
            token_keep_bool = (per_token_stat >= lower_log) & (per_token_stat <= upper_log)
        elif option_name == "token_k2":
            per_token_stat = token_k2
            token_keep_bool = per_token_stat <= upper_value
        elif option_name == "token_k3":
            per_token_stat = token_k3
            token_keep_bool = per_token_stat <= upper_value
        elif option_name.startswith("seq_sum"):
            if option_name.endswith("k1"):
                if lower_log is None:
                    raise ValueError(
                        f"Threshold specification for option '{option_name}' must include lower and upper bounds."
                    )
                seq_stat = _sequence_sum(token_k1)
                seq_keep_bool_direct = (seq_stat >= lower_log) & (seq_stat <= upper_log)
            elif option_name.endswith("k2"):
                seq_stat = _sequence_sum(token_k2)
                seq_keep_bool_direct = seq_stat <= upper_value
            elif option_name.endswith("k3"):
                seq_stat = _sequence_sum(token_k3)
                seq_keep_bool_direct = seq_stat <= upper_value
            else:
                raise ValueError(f"Unsupported rollout_rs option: {option_name}.")
            token_keep_bool = seq_keep_bool_direct.unsqueeze(-1).expand_as(response_mask_bool)
        elif option_name.startswith("seq_mean"):
            if option_name.endswith("k1"):
                if lower_log is None:
                    raise ValueError(
                        f"Threshold specification for option '{option_name}' must include lower and upper bounds."
                    )
                seq_stat = _sequence_mean(token_k1)
                seq_keep_bool_direct = (seq_stat >= lower_log) & (seq_stat <= upper_log)
            elif option_name.endswith("k2"):
                seq_stat = _sequence_mean(token_k2)
                seq_keep_bool_direct = seq_stat <= upper_value
            elif option_name.endswith("k3"):
                seq_stat = _sequence_mean(token_k3)
                seq_keep_bool_direct = seq_stat <= upper_value
            else:
                raise ValueError(f"Unsupported rollout_rs option: {option_name}.")
            token_keep_bool = seq_keep_bool_direct.unsqueeze(-1).expand_as(response_mask_bool)
        elif option_name.startswith("seq_max"):
            if option_name.endswith("k2"):
                seq_stat = _sequence_max(token_k2)
                seq_keep_bool_direct = seq_stat <= upper_value
            elif option_name.endswith("k3"):
                seq_stat = _sequence_max(token_k3)
                seq_keep_bool_direct = seq_stat <= upper_value
            else:
                raise ValueError(f"Unsupported rollout_rs option: {option_name}.")
            token_keep_bool = seq_keep_bool_direct.unsqueeze(-1).expand_as(response_mask_bool)
        else:
            raise ValueError(f"Unsupported rollout_rs option: {option_name}.")

        token_keep_mask = token_keep_bool.to(dtype=log_ratio.dtype)
        combined_mask = combined_mask * token_keep_mask

    final_mask = combined_mask
    modified_response_mask = (response_mask * final_mask).to(dtype=response_mask.dtype)
    return modified_response_mask


def verl_compute_rollout_correction_weights(
    log_ratio,
    response_mask,
    rollout_is="token",
    rollout_is_threshold=2.0,
    rollout_is_batch_normalize=False,
):
    """volcengine/verl verl/trainer/ppo/rollout_corr_helper.py compute_rollout_correction_weights
    @ b178a3c (the metrics, compute_is_metrics, left out; one process: the torch.distributed
    branches of the batch normalisation are not reached)."""
    # Validate input parameters
    valid_is_levels = {"token", "sequence"}
    if rollout_is not in valid_is_levels:
        raise ValueError(f"Invalid rollout_is: {rollout_is}. Must be one of {valid_is_levels}.")
    if rollout_is_threshold <= 0:
        raise ValueError(f"rollout_is_threshold must be positive, got {rollout_is_threshold}.")

    # Compute IS weights from log ratio (handles different aggregation levels)
    if rollout_is == "token":
        # Per-token IS weight: exp(log(π_train/π_rollout)) with safety clamp
        log_ratio_safe = torch.clamp(log_ratio, min=-VERL_SAFETY_BOUND, max=VERL_SAFETY_BOUND)
        rollout_is_weights = torch.exp(log_ratio_safe)

    elif rollout_is == "sequence":
        # Sequence-level IS weight: product of token ratios (exp(sum(log ratios)))
        log_ratio_sum = verl_masked_sum(log_ratio, response_mask, axis=-1).unsqueeze(
            -1
        )  # Shape: (batch_size, 1)

        log_ratio_sum_safe = torch.clamp(
            log_ratio_sum, min=-VERL_SAFETY_BOUND, max=VERL_SAFETY_BOUND
        )
        rollout_is_weights = torch.exp(log_ratio_sum_safe).expand_as(
            log_ratio
        )  # Broadcast to sequence length

    else:
        raise ValueError(f"Unsupported rollout_is: {rollout_is}")

    # Zero out weights for padding tokens using response mask
    rollout_is_weights = rollout_is_weights * response_mask

    # Truncate extreme weights (TIS: Truncated Importance Sampling)
    rollout_is_weights = rollout_is_weights.clamp(max=rollout_is_threshold)

    # Detach weights to prevent gradient flow (mathematically required by IS theory)
    rollout_is_weights = rollout_is_weights.detach()

    # Apply batch normalization if requested
    if rollout_is_batch_normalize:
        # Compute mean based on aggregation level
        if rollout_is == "token":
            # Token-level: normalize over all token weights
            weights_mean = verl_masked_mean(rollout_is_weights, response_mask)
        elif rollout_is == "sequence":
            # Sequence-level: normalize over sequence weights (one weight per sequence)
            seq_weights = verl_masked_mean(
                rollout_is_weights, response_mask, axis=-1
            )  # (batch_size,)
            seq_mask = (response_mask.sum(dim=-1) > 0).to(dtype=rollout_is_weights.dtype)
            weights_mean = (seq_weights * seq_mask).sum() / seq_mask.sum().clamp_min(1e-8)
        else:
            raise ValueError(f"Unsupported rollout_is: {rollout_is}")

        # Normalize to mean=1.0 (avoid division by zero)
        if weights_mean > 1e-8:
            rollout_is_weights = rollout_is_weights / weights_mean

    return rollout_is_weights


def verl_compute_rollout_correction_and_rejection_mask(
    old_log_prob,
    rollout_log_prob,
    response_mask,
    rollout_is=None,
    rollout_is_threshold=2.0,
    rollout_is_batch_normalize=False,
    rollout_rs=None,
    rollout_rs_threshold=None,
):
    """volcengine/verl verl/trainer/ppo/rollout_corr_helper.py
    compute_rollout_correction_and_rejection_mask @ b178a3c (the metrics, compute_offpolicy_metrics
    included, left out; the weights as a tensor, not a DataProto). Returns (rollout_is_weights or
    None, modified_response_mask)."""
    # Validate input masks
    if not response_mask.any():
        raise ValueError("response_mask must contain at least one valid token (1).")
    if old_log_prob.shape != rollout_log_prob.shape:
        raise ValueError(
            f"old_log_prob shape {old_log_prob.shape} does not match rollout_log_prob shape {rollout_log_prob.shape}."
        )
    if old_log_prob.shape != response_mask.shape:
        raise ValueError(
            f"log_prob shape {old_log_prob.shape} does not match response_mask shape {response_mask.shape}."
        )

    # Step 1: Compute log ratio (log(π_train / π_rollout))
    log_ratio = old_log_prob - rollout_log_prob

    # Step 2: Compute IS weights (if enabled)
    rollout_is_weights = None
    if rollout_is is not None and rollout_is_threshold is not None:
        rollout_is_weights = verl_compute_rollout_correction_weights(
            log_ratio=log_ratio,
            response_mask=response_mask,
            rollout_is=rollout_is,
            rollout_is_threshold=rollout_is_threshold,
            rollout_is_batch_normalize=rollout_is_batch_normalize,
        )

    # Step 3: Compute rejection mask (if enabled)
    modified_response_mask = response_mask.clone()
    if rollout_rs is not None:
        if rollout_rs_threshold is None:
            raise ValueError(
                "rollout_rs_threshold must be explicitly provided when rollout_rs is enabled. "
                "Set rollout_rs_threshold to the desired threshold value."
            )
        modified_response_mask = verl_compute_rollout_rejection_mask(
            log_ratio=log_ratio,
            response_mask=response_mask,
            rollout_rs=rollout_rs,
            rollout_rs_threshold=rollout_rs_threshold,
        )

    return rollout_is_weights, modified_response_mask


# RolloutCorrectionConfig's presets, verl/trainer/config/algorithm.py @ b178a3c, with their default
# arguments: decoupled_token_is (Token-TIS), decoupled_seq_is (Seq-TIS), decoupled_seq_is_rs
# (Seq-MIS), decoupled_geo_rs (Geo-RS); token-level MIS has no preset: docs/algo/rollout_corr.md
# @ b178a3c, "Token IS + Token RS (token_is_rs)"
VERL_PRESETS = {
    "tis-token": dict(rollout_is="token", rollout_is_threshold=2.0, rollout_rs=None),
    "tis-seq": dict(rollout_is="sequence", rollout_is_threshold=2.0, rollout_rs=None),
    "mis-token": dict(
        rollout_is="token",
        rollout_is_threshold=2.0,
        rollout_rs="token_k1",
        rollout_rs_threshold=2.0,
    ),
    "mis-seq": dict(
        rollout_is="sequence",
        rollout_is_threshold=2.0,
        rollout_rs="seq_sum_k1",
        rollout_rs_threshold="0.5_2.0",
    ),
    "geo-mask": dict(rollout_is=None, rollout_rs="seq_mean_k1", rollout_rs_threshold="0.999_1.001"),
}


def openrlhf_icepop(old_log_probs, rollout_log_probs, loss, vllm_is_truncated_threshold):
    """OpenRLHF/OpenRLHF openrlhf/models/loss.py PolicyLoss.forward @ 3c3be62, its vLLM IS
    correction with vllm_is_correction_type "icepop" (IcePop, Ring-1T arXiv:2510.18855): the
    token-level loss `loss` [B, T] times the coefficient M(rho) = rho inside [low, high], else 0.
    Returns (the corrected loss, the band mask)."""
    low_threshold, high_threshold = vllm_is_truncated_threshold
    rollout_log_ratio = old_log_probs - rollout_log_probs
    # ICEPOP: token-level filtering (set coefficients outside the interval to 0)
    vllm_is = torch.exp(rollout_log_ratio).detach()
    mask = (vllm_is >= low_threshold) & (vllm_is <= high_threshold)
    vllm_is = vllm_is * mask
    loss = vllm_is * loss
    return loss, mask


# openrlhf/cli/train_ppo_ray.py @ 3c3be62: --algo.advantage.is_correction_threshold's default
OPENRLHF_IS_CORRECTION_THRESHOLD = [0.5, 5.0]


def rollout_corrections():
    """Each case of CORR_CASES on CORR_OLD / CORR_BEHAVIOUR / CORR_MASK: (weights, kept) [B, T] on
    the trained tokens (0 elsewhere). verl's: its rollout_is_weights (1 where rollout_is is None)
    and modified response mask, a preset's arguments with the case's bounds: the IS cap is high;
    a k1 option's "lower_upper" bounds exp(-log rho) (token_k1 = -log_ratio_safe), so the band
    (low, high) on rho is given as f"{1 / high}_{1 / low}"; OpenRLHF's icepop: the coefficient on a
    loss of ones, and its band mask on the trained tokens."""
    old, behaviour, mask = _t(CORR_OLD), _t(CORR_BEHAVIOUR), _t(CORR_MASK)
    out = {}
    for kind, low, high in CORR_CASES:
        if kind == "icepop":
            bounds = OPENRLHF_IS_CORRECTION_THRESHOLD if high is None else [low, high]
            weights, band = openrlhf_icepop(old, behaviour, torch.ones_like(old), bounds)
            out[(kind, low, high)] = ((weights * mask).tolist(), (band * mask).tolist())
            continue
        kwargs = dict(VERL_PRESETS[kind])
        if high is not None and kwargs["rollout_is"] is not None:
            kwargs["rollout_is_threshold"] = high
        if high is not None and kwargs["rollout_rs"] is not None:
            kwargs["rollout_rs_threshold"] = f"{1 / high}_{1 / low}"
        weights, kept = verl_compute_rollout_correction_and_rejection_mask(
            old, behaviour, mask, **kwargs
        )
        weights = mask if weights is None else weights
        out[(kind, low, high)] = ((weights * mask).tolist(), kept.tolist())
    return {"CORRECTIONS_REF": out}


# ----------------------------------------------------------------------------- all of them

FIDELITY_PARTS = (
    dppo,
    topr,
    kl_estimators,
    mix,
    kimi,
    ppo,
    gspo,
    cispo,
    tis,
    dpo,
    pairwise,
    opmd_simple,
    advantages,
    stepwise,
    entropy,
)  # the goldens of tests/test_fidelity.py
DISTILL_PARTS = (distill,)  # of tests/test_distill.py
CORRECTION_PARTS = (rollout_corrections,)  # of tests/test_corrections.py


def compute(parts=FIDELITY_PARTS) -> dict:
    """{name in the test file of `parts`: value (number, nested list, or a dict / tuple of them)}."""
    out = {}
    previous = torch.get_default_dtype()
    # float64 throughout, also for the references' dtype-less constants (torch.tensor(0.0), torch.tensor(1.0))
    torch.set_default_dtype(torch.float64)
    try:
        for part in parts:
            out.update(part())
    finally:
        torch.set_default_dtype(previous)
    return out


def _fmt(x):
    if isinstance(x, float):
        return f"{x + 0.0:.8g}"  # + 0.0: no "-0"
    if isinstance(x, bool):
        return repr(x)
    if isinstance(x, int):
        return str(x)
    if isinstance(x, list):
        return "[" + ", ".join(_fmt(v) for v in x) + "]"
    if isinstance(x, tuple):
        return "(" + ", ".join(_fmt(v) for v in x) + ("," if len(x) == 1 else "") + ")"
    if isinstance(x, dict):
        return (
            "{"
            + ", ".join(
                f"{_fmt(k) if not isinstance(k, str) else repr(k)}: {_fmt(v)}" for k, v in x.items()
            )
            + "}"
        )
    return repr(x)


if __name__ == "__main__":
    everything = {**compute(), **compute(DISTILL_PARTS), **compute(CORRECTION_PARTS)}
    for name, value in everything.items():
        print(f"{name} = {_fmt(value)}")
