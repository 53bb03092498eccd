"""Every loss, estimator and advantage of losses.py against numbers produced by its reference.

Each expected value below was computed (in float64) by tests/fidelity_reference.py, a script
that re-implements the named reference function line by line, as its source does, on the fixed
inputs it holds (imported here, so both sides use one copy); the comment above each constant
names the reference file and commit, and so does the docstring of the script's function.
`test_golden_numbers_come_from_the_reference_script` recomputes them all, so a constant cannot
drift from its reference; `python tests/fidelity_reference.py` prints them. Losses are
compared after aggregation over the batch (the reference's own normalisation) together
with the gradient with respect to the log-probs, so detaching and masking are checked too.
"""

import fidelity_reference
import pytest
import torch
from fidelity_reference import (
    ADV,
    BEHAVIOUR,
    COUNTS10,
    DPO_REWARDS,
    ENTROPY_LOGITS,
    G4,
    G10,
    GSPO_EXTREME_BEHAVIOUR,
    GSPO_EXTREME_LP,
    KL_LOGP,
    KL_LOGQ,
    LP,
    MASK,
    MIX_EXPERT,
    PPO_EXTREME_BEHAVIOUR,
    PPO_EXTREME_LP,
    R4,
    R10,
    STEP_G,
    STEP_R,
    STEP_T,
)

import components
import losses as L
from extras import advantages as EA
from extras import filters as EF
from extras import opmd as OPMD
from extras import policy_losses as EP
from packing import token_entropy

# The fixed inputs (LP, BEHAVIOUR, ADV, MASK: B = 4 sequences of T = 4 tokens; R4, G4; R10, G10, COUNTS10;
# the KL, PPO / GSPO extreme, MIX, DPO, step-wise and entropy inputs) are defined, with their
# description, in tests/fidelity_reference.py.


def close(got, want, tol=2e-6):
    """got (tensor or number) equals want (number or nested list) within tol, shapes included."""
    got = torch.as_tensor(got, dtype=torch.float64).detach()
    want = torch.tensor(want, dtype=torch.float64)
    return got.shape == want.shape and torch.allclose(got, want, rtol=tol, atol=tol)


def run(name, adv=None, rewards=R4, groups=G4, ref=None, expert=None, totals=None, **kw):
    """The loss `name` on the fixed batch, aggregated with its own mode over the batch as
    one global batch (or with per-sequence `totals`); returns (loss, d loss / d logprobs, outputs)."""
    lp = torch.tensor(LP, requires_grad=True)
    mask = torch.tensor(MASK, dtype=torch.float)
    adv = torch.tensor(ADV)[:, None].expand(4, 4) if adv is None else adv
    loss = L.resolve_loss(name, registry=components.policy_losses(name))
    out = loss.fn(
        L.LossInputs(
            lp,
            torch.tensor(BEHAVIOUR),
            adv,
            mask,
            torch.tensor(rewards),
            torch.tensor(groups),
            ref,
            expert,
        ),
        **kw,
    )
    tokens, seqs = totals if totals is not None else (mask.sum(), 4)
    loss = L.aggregate(out["loss"], mask, loss.agg, tokens, seqs)
    loss.backward()
    return loss, lp.grad, out


# ----------------------------------------------------------------------------- item 1: DPPO (prime-rl default)

# PrimeIntellect-ai/prime-rl @ 559b447, src/prime_rl/trainer/rl/loss.py default_loss_fn (per sample,
# summed) / compute_loss (divided by the global token count), DefaultLossConfig defaults
# dppo_mask_low = dppo_mask_high = 0.2, adv_tau 1, kl_tau 1e-3
DPPO_LOSS = 0.30588818
DPPO_GRAD = [
    [-0.15570679, 7.6923077e-05, -0.042601474, 0],
    [-7.6923077e-05, 0.061538462, 0.10153669, 0.27602702],
    [-0.048512512, 0.00015384615, 0, 0],
    [0.027825767, 0.022748253, 0.037612393, 0.025160946],
]
DPPO_MASKED = [[0, 1, 0, 0], [1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 0, 0]]


def test_dppo_kl_is_prime_rl_default_loss():
    loss, grad, out = run("dppo_kl")
    assert close(loss, DPPO_LOSS) and close(grad, DPPO_GRAD)
    # sequence 0 (A > 0): token 1 rose by 0.36 > 0.2 -> masked; token 2 fell by 0.23 but A > 0 -> kept
    # sequence 1 (A < 0): token 0 fell by 0.32 -> masked; token 3 rose by 0.47 but A < 0 -> kept
    assert ((out["masked"] * torch.tensor(MASK)).tolist()) == DPPO_MASKED


# ----------------------------------------------------------------------------- item 2: TOPR

# Le Roux et al., arXiv:2503.14286, sec. 3 (no reference code): mean over trajectories of
# -w R log pi(tau), w = 1 for R >= 0 and sg(clip(pi(tau) / mu(tau), 0, 1)) for R < 0, with the
# trajectory ratio exp(sum_t (logprobs - behaviour_logprobs)); written out per trajectory
TOPR_WEIGHTS = [1, 1, 1, 0.67032005]
TOPR_LOSS = 0.53255918
TOPR_GRAD = [
    [-0.375, -0.375, -0.375, 0],
    [0.2, 0.2, 0.2, 0.2],
    [-0.15, -0.15, 0, 0],
    [0.067032005, 0.067032005, 0.067032005, 0.067032005],
]


def test_topr_tapers_negative_trajectories_by_the_sequence_ratio():
    loss, grad, out = run("topr")
    assert close(loss, TOPR_LOSS) and close(grad, TOPR_GRAD)
    # sequence 1: trajectory ratio e^1.5 > 1 is cut to 1 (its token 0 alone has ratio e^-0.5)
    assert out["truncated"][:, 0].tolist() == [0.0, 1.0, 0.0, 0.0]
    assert close(grad[3, 0] / (-ADV[3] / 4), TOPR_WEIGHTS[3])


# ----------------------------------------------------------------------------- item 3: KL estimators

# volcengine/verl @ b178a3c, verl/trainer/ppo/core_algos.py kl_penalty_forward(logprob, ref_logprob, kind):
# k3 and low_var_kl clamp the log-ratio to [-20, 20] and the estimate to [-10, 10]
KL_REF = {
    "k1": [[-30, 3, -1.5, 30, -0.1, -2.5]],
    "k2": [[450, 4.5, 1.125, 450, 0.005, 3.125]],
    "k3": [[10, 2.0497871, 1.9816891, 10, 0.0051709181, 8.682494]],
    "low_var": [[10, 2.0497871, 1.9816891, 10, 0.0051709181, 8.682494]],
}


@pytest.mark.parametrize("kind", KL_REF)
def test_kl_estimators_are_verl_kl_penalty(kind):
    got = L.kl_estimate(torch.tensor(KL_LOGP), torch.tensor(KL_LOGQ), kind)
    assert close(got, KL_REF[kind])


# ----------------------------------------------------------------------------- item 4: MIX

# modelscope/Trinity-RFT @ c10d414, trinity/algorithm/policy_loss_fn/mix_policy_loss.py MIXPolicyLossFn
# (mu 0.25, one micro-batch: gradient_accumulation 1, read_batch_size_usual/expert = the batch's
# counts) with ppo_policy_loss.py @ 5a4234e (clip_range 0.2, clip_ratio_c 3, token-mean) and
# sft_loss.py @ 51d229f (token-level): (1 - mu) token-mean PPO over the rollouts + mu token-mean
# NLL over the expert sequences 1 and 3
MIX_LOSS = -0.60976227
MIX_GRAD = [
    [0, 0, -0.082772874, 0],
    [-0.03125, -0.03125, -0.03125, -0.03125],
    [-0.094614398, 0, 0, 0],
    [-0.03125, -0.03125, -0.03125, -0.03125],
]


def test_mix_normalises_rollout_and_expert_parts_separately():
    expert = torch.tensor(MIX_EXPERT)
    mask = torch.tensor(MASK, dtype=torch.float)
    tokens, seqs = L.part_totals(mask.sum(-1), expert, torch.ones(4, dtype=torch.bool))
    assert tokens.tolist() == [5, 8, 5, 8] and seqs.tolist() == [2, 2, 2, 2]
    assert components.policy_losses()["mix"].split_expert
    loss, grad, _ = run("mix", expert=expert, totals=(tokens, seqs), mu=0.25)
    assert close(loss, MIX_LOSS) and close(grad, MIX_GRAD)


def test_mix_split_totals_add_up_over_micro_batches():
    # the trainer's view: two micro-batches of the global batch, each aggregated with its
    # rows' part totals; a filtered-out rollout (row 4) counts in neither part
    expert = torch.tensor(MIX_EXPERT + [False])
    counts = torch.tensor(MASK, dtype=torch.float).sum(-1)
    tokens, seqs = L.part_totals(
        torch.cat([counts, torch.tensor([3.0])]),
        expert,
        torch.tensor([True, True, True, True, False]),
    )
    lp = torch.tensor(LP, requires_grad=True)
    total = 0
    for rows in ([0, 1], [2, 3]):
        idx = torch.tensor(rows)
        m = torch.tensor(MASK, dtype=torch.float)[idx]
        inp = L.LossInputs(
            lp[idx],
            torch.tensor(BEHAVIOUR)[idx],
            torch.tensor(ADV)[idx][:, None].expand(2, 4),
            m,
            torch.zeros(2),
            torch.arange(2),
            None,
            expert[idx],
        )
        total = total + L.aggregate(
            EP.mix_loss(inp, mu=0.25)["loss"], m, "token-mean", tokens[idx], seqs[idx]
        )
    total.backward()
    assert close(total, MIX_LOSS) and close(lp.grad, MIX_GRAD)


# ----------------------------------------------------------------------------- item 5: Kimi OPMD

# Trinity-RFT trinity/trainer/verl/core_algos.py compute_policy_loss_opmd, "version 0: kimi-opmd"
# (read in the fork yaochaorui/Trinity-RFT @ 50aba82): (masked_sum(-A logprobs) + tau / 2 *
# sum_seq (sum_t (logprobs - behaviour_logprobs))^2) / tokens / max(1, tau), with A from
# modelscope/Trinity-RFT @ 547adf1 advantage_fn/opmd_advantage.py (opmd_baseline "logavgexp",
# the same tau), groups {0, 1} and {2, 3}
KIMI = {
    0.7: (
        [0.33482208, -0.66517792, 0.13405008, -0.16594992],
        0.0027426246,
        [
            [-0.036524776, -0.036524776, -0.036524776, 0],
            [0.13193676, 0.13193676, 0.13193676, 0.13193676],
            [0.046226917, 0.046226917, 0, 0],
            [-0.0087730832, -0.0087730832, -0.0087730832, -0.0087730832],
        ],
    ),
    2.0: (
        [0.43814039, -0.56185961, 0.14438027, -0.15561973],
        0.11462222,
        [
            [-0.032236169, -0.032236169, -0.032236169, 0],
            [0.1369946, 0.1369946, 0.1369946, 0.1369946],
            [0.075216144, 0.075216144, 0, 0],
            [-0.024783856, -0.024783856, -0.024783856, -0.024783856],
        ],
    ),
}


@pytest.mark.parametrize("tau", KIMI)
def test_opmd_kimi_uses_the_advantage_baseline_with_one_tau(tau):
    want_adv, want_loss, want_grad = KIMI[tau]
    adv = OPMD.opmd_advantages(torch.tensor(R4), torch.tensor(G4), baseline="logavgexp", tau=tau)
    assert close(adv, want_adv)
    loss, grad, _ = run("opmd_kimi", adv=adv[:, None].expand(4, 4), tau=tau)
    assert close(loss, want_loss) and close(grad, want_grad)


def test_opmd_kimi_follows_the_given_advantage():
    # the baseline is the advantage's (--advantage-kwargs '{"baseline": ...}'), not recomputed
    r, g = torch.tensor(R4), torch.tensor(G4)
    grads = []
    for baseline in ("mean", "logavgexp"):
        adv = OPMD.opmd_advantages(r, g, baseline=baseline, tau=0.7)
        grads.append(run("opmd_kimi", adv=adv[:, None].expand(4, 4), tau=0.7)[1])
    assert not torch.allclose(grads[0], grads[1])


# ----------------------------------------------------------------------------- the other losses

# volcengine/verl @ b178a3c, verl/trainer/ppo/core_algos.py compute_policy_loss_vanilla
# (clip_ratio_low 0.2, clip_ratio_high 0.28, clip_ratio_c 3) + agg_loss token-mean
PPO_TOKENS = [
    [-1.92, -1.92, -0.55181916, -1.5],
    [0.64, 0.8, 1.318977, 2.4],
    [-0.63076266, -0.768, -0.54290245, -0.3639184],
    [0.36193497, 0.32, 0.4885611, 0.3274923],
]
PPO_LOSS = 0.06664489
PPO_GRAD = [
    [0, 0, -0.042447628, 0],
    [0, 0.061538462, 0.10145977, 0],
    [-0.048520204, 0, 0, 0],
    [0.027841151, 0, 0.037581623, 0.025191715],
]
# the same on log-ratios -25, 0, 22 with A = -1: the log-ratio is clamped to [-20, 20]
PPO_EXTREME = (PPO_EXTREME_LP, PPO_EXTREME_BEHAVIOUR, [[3, 1, 0.8]])


def test_ppo_clip_with_dual_clip_is_verl_vanilla():
    loss, grad, out = run("ppo_clip", clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    assert close(out["loss"], PPO_TOKENS) and close(loss, PPO_LOSS) and close(grad, PPO_GRAD)
    assert L.ppo_clip_loss.__defaults__[2] == 3.0  # dual clip on by default, as verl's clip_ratio_c
    lp, behaviour, want = PPO_EXTREME
    inp = L.LossInputs(
        torch.tensor(lp),
        torch.tensor(behaviour),
        -torch.ones(1, 3),
        torch.ones(1, 3),
        torch.zeros(1),
        torch.zeros(1, dtype=torch.long),
    )
    assert close(L.ppo_clip_loss(inp)["loss"], want)


# verl @ b178a3c, compute_policy_loss_gspo (agg seq-mean-token-mean), clip 0.1 / 0.2 and the defaults 3e-4 / 4e-4
GSPO = {
    (0.1, 0.2): (
        -0.14933309,
        [
            [-0.11693837, -0.11693837, -0.11693837, 0],
            [0.072749571] * 4,
            [0, 0, 0, 0],
            [0.022620935] * 4,
        ],
    ),
    (3e-4, 4e-4): (
        -0.10990684,
        [[-0.11693837, -0.11693837, -0.11693837, 0], [0.072749571] * 4, [0, 0, 0, 0], [0, 0, 0, 0]],
    ),
}
# ... and a sequence whose mean log-ratio is 15 (> 10), A = 1: value -exp(10) (log-ratio clamped to 10), no gradient
GSPO_EXTREME_LOSS = -22026.466


@pytest.mark.parametrize("clip", GSPO)
def test_gspo_is_verl_gspo(clip):
    loss, grad, _ = run("gspo", clip_low=clip[0], clip_high=clip[1])
    assert close(loss, GSPO[clip][0]) and close(grad, GSPO[clip][1])
    lp = torch.tensor(GSPO_EXTREME_LP, requires_grad=True)
    inp = L.LossInputs(
        lp,
        torch.tensor(GSPO_EXTREME_BEHAVIOUR),
        torch.ones(1, 2),
        torch.ones(1, 2),
        torch.zeros(1),
        torch.zeros(1, dtype=torch.long),
    )
    out = L.aggregate(
        EP.gspo_loss(inp, clip_low=0.1, clip_high=1e9)["loss"],
        torch.ones(1, 2),
        components.policy_losses()["gspo"].agg,
        2,
        1,
    )
    out.backward()
    assert close(out, GSPO_EXTREME_LOSS) and lp.grad.abs().max() == 0


# verl @ b178a3c, compute_policy_loss_cispo (clip_ratio_low 1.0, clip_ratio_high 0.28), token-mean
CISPO_LOSS = 0.046463799
CISPO_GRAD = [
    [-0.14769231, -0.14769231, -0.042447628, 0],
    [0.037324964, 0.061538462, 0.078769231, 0.078769231],
    [-0.048520204, -0.059076923, 0, 0],
    [0.027841151, 0.022794407, 0.037581623, 0.025191715],
]


def test_cispo_is_verl_cispo():
    loss, grad, _ = run("cispo", clip_low=1.0, clip_high=0.28)
    assert close(loss, CISPO_LOSS) and close(grad, CISPO_GRAD)


# ServiceNow/PipelineRL @ 58d3934, pipelinerl/finetune/rl/__init__.py rl_step, policy_loss "reinforce",
# with conf/finetune/base.yaml (epsilon_high 0.02 -> cap 1.02, kl_coef 0): tokens weighted 1 / batch
# size, summed: -sum(logprobs A sg(clamp(ratio, 0, 1.02))) / 4
TIS_LOSS = 0.046975323
TIS_GRAD = [
    [-0.3825, -0.3825, -0.13795479, 0],
    [0.12130613, 0.2, 0.204, 0.204],
    [-0.153, -0.153, 0, 0],
    [0.090483742, 0.074081822, 0.102, 0.081873075],
]
TIS_TRUNCATED = [[1, 1, 0, 0], [0, 0, 1, 1], [1, 1, 0, 0], [0, 0, 1, 0]]


def test_reinforce_tis_is_pipelinerl_reinforce():
    loss, grad, out = run("reinforce_tis")
    assert close(loss, TIS_LOSS) and close(grad, TIS_GRAD)
    mask = torch.tensor(MASK)
    assert (out["truncated"] * mask).tolist() == (torch.tensor(TIS_TRUNCATED) * mask).tolist()


# huggingface/trl @ f2cd577, trl/trainer/dpo_trainer.py (loss_type "sigmoid", beta 0.2): pairs
# (chosen 0, rejected 1) and (chosen 3, rejected 2), reference log-probs = BEHAVIOUR, mean over pairs
DPO_LOSS = 0.86307558
DPO_GRAD = [
    [-0.058419052, -0.058419052, -0.058419052, 0],
    [0.058419052] * 4,
    [0.057199613, 0.057199613, 0, 0],
    [-0.057199613] * 4,
]


def test_dpo_is_trl_sigmoid_dpo():
    loss, grad, _ = run("dpo", rewards=DPO_REWARDS, ref=torch.tensor(BEHAVIOUR), beta=0.2)
    assert close(loss, DPO_LOSS) and close(grad, DPO_GRAD)


# Trinity-RFT trinity/trainer/verl/core_algos.py compute_policy_loss_pairwise_opmd (fork
# yaochaorui/Trinity-RFT @ 50aba82; use_uid: per group sum of (d - mean d)^2, groups of one skipped,
# / (tokens * max(1, tau)), d = r - tau (log pi - sg(log pi)))
PAIRWISE = {
    (0.7, (0, 0, 1, 1)): (
        0.041923077,
        [
            [-0.053846154, -0.053846154, -0.053846154, 0],
            [0.053846154] * 4,
            [-0.016153846, -0.016153846, 0, 0],
            [0.016153846] * 4,
        ],
    ),
    (2.0, (0, 0, 0, 1)): (
        0.019230769,
        [
            [-0.076923077, -0.076923077, -0.076923077, 0],
            [0.076923077] * 4,
            [0, 0, 0, 0],
            [0, 0, 0, 0],
        ],
    ),
}


@pytest.mark.parametrize("case", PAIRWISE)
def test_opmd_pairwise_is_trinity_pairwise_opmd(case):
    tau, groups = case
    loss, grad, _ = run("opmd_pairwise", groups=list(groups), tau=tau)
    assert close(loss, PAIRWISE[case][0]) and close(grad, PAIRWISE[case][1])


# modelscope/Trinity-RFT @ 70c21ac, trinity/algorithm/policy_loss_fn/opmd_policy_loss.py (tau 0.5):
# masked_mean(-A logprobs) / (1 + tau), A from opmd_advantage.py @ 547adf1 (mean baseline)
SIMPLE_LOSS = -0.01
SIMPLE_GRAD = [
    [-0.025641026, -0.025641026, -0.025641026, 0],
    [0.025641026] * 4,
    [-0.0076923077, -0.0076923077, 0, 0],
    [0.0076923077] * 4,
]


def test_opmd_simple_is_trinity_opmd():
    adv = OPMD.opmd_advantages(torch.tensor(R4), torch.tensor(G4))
    loss, grad, _ = run("opmd_simple", adv=adv[:, None].expand(4, 4), tau=0.5)
    assert close(loss, SIMPLE_LOSS) and close(grad, SIMPLE_GRAD)


def test_sft_is_token_mean_nll():
    # modelscope/Trinity-RFT @ 51d229f, sft_loss.py (use_token_level_loss): masked_mean(-logprobs)
    loss, grad, _ = run("sft")
    mask = torch.tensor(MASK, dtype=torch.float)
    assert close(loss, float(-(torch.tensor(LP) * mask).sum() / mask.sum()))
    assert close(grad, (-mask / mask.sum()).tolist())


# ----------------------------------------------------------------------------- advantages

# volcengine/verl @ b178a3c, verl/trainer/ppo/core_algos.py: compute_grpo_outcome_advantage (eps 1e-6;
# norm_adv_by_std_in_grpo False for Dr. GRPO), compute_rloo_outcome_advantage,
# compute_reinforce_plus_plus_baseline_outcome_advantage and compute_reinforce_plus_plus_outcome_advantage
# (gamma 1) with masked_whiten (verl/utils/torch_functional.py); groups of one: mean 0, std 1
GRPO_ADV = [
    0.999998,
    -0.999998,
    0,
    -1.045643,
    0.85552611,
    0.85552611,
    -0.6654092,
    -0.70710178,
    0.70710178,
    0.3999996,
]
DR_GRPO_ADV = [0.5, -0.5, 0, -0.55, 0.45, 0.45, -0.35, -0.1, 0.1, 0.4]
RLOO_ADV = [0.75, -0.75, 0, -0.73333333, 0.6, 0.6, -0.46666667, -0.2, 0.2, 0.4]
RPP_BASELINE_ADV = [
    1.2115103,
    -1.2442538,
    -0.016371761,
    -1.367042,
    1.0887221,
    1.0887221,
    -0.8758892,
    -0.26194817,
    0.22920465,
    0.96593389,
]
RPP_BASELINE_ADV_5_TOKENS = [
    1.1781364,
    -1.3830296,
    -0.10244664,
    -1.5110879,
    1.0500781,
    1.0500781,
    -0.99885473,
    -0.35856324,
    0.15366996,
    0.92201975,
]
RPP_ADV = [
    1.0423279,
    -1.3446825,
    -0.15117733,
    -1.3446825,
    1.0423279,
    1.0423279,
    -0.86728046,
    0.32622476,
    0.80362684,
    -0.38987837,
]
# modelscope/Trinity-RFT @ 547adf1, advantage_fn/opmd_advantage.py OPMDGroupAdvantage (tau 0.5 for logavgexp)
OPMD_ADV_MEAN = DR_GRPO_ADV
OPMD_ADV_LOGAVGEXP = [
    0.34550316,
    -0.65449684,
    -0.15449684,
    -0.73133644,
    0.26866356,
    0.26866356,
    -0.53133644,
    -0.10993404,
    0.090065964,
    0.4,
]
# modelscope/Trinity-RFT @ 369bf62, advantage_fn/multi_step_grpo_advantage.py StepWiseGRPOAdvantageFn:
# task 0 = runs of 3, 1 and 2 steps with final rewards 1, 0, 0.5; task 1 = one run of one step, reward 0.3
STEPWISE_ADV = [0.99999797, 0.99999797, 0.99999797, -0.99999797, 0, 0, 0.2999997]


def test_advantages_are_verl_and_trinity_estimators():
    r, g, n = torch.tensor(R10), torch.tensor(G10), torch.tensor(COUNTS10, dtype=torch.float)
    assert close(L.grpo_advantages(r, g), GRPO_ADV)
    assert close(EA.dr_grpo_advantages(r, g), DR_GRPO_ADV)
    assert close(EA.rloo_advantages(r, g), RLOO_ADV)
    assert close(EA.reinforce_pp_advantages(r, g, token_counts=n), RPP_BASELINE_ADV)
    assert close(
        EA.reinforce_pp_advantages(r, g, token_counts=torch.full((10,), 5.0)),
        RPP_BASELINE_ADV_5_TOKENS,
    )
    assert close(EA.reinforce_pp_advantages(r, g, group_baseline=False, token_counts=n), RPP_ADV)
    assert close(OPMD.opmd_advantages(r, g), OPMD_ADV_MEAN)
    assert close(OPMD.opmd_advantages(r, g, baseline="logavgexp", tau=0.5), OPMD_ADV_LOGAVGEXP)
    step = EA.stepwise_grpo_advantages(
        torch.tensor(STEP_R), torch.tensor(STEP_G), torch.tensor(STEP_T)
    )
    assert close(step, STEPWISE_ADV)


# verl @ b178a3c, verl/utils/torch_functional.py entropy_from_logits
ENTROPY = [[1.0314429, 1.3862944], [1.1072708, 0.2900405]]


def test_entropy_is_verl_entropy_from_logits():
    assert close(token_entropy(torch.tensor(ENTROPY_LOGITS)), ENTROPY)


# ----------------------------------------------------------------------------- the goldens' provenance

# golden constants of this file that tests/fidelity_reference.py does not reproduce from the reference
# source as written, with the reason (each one is a known, reported difference, not a silent change)
NOT_FROM_THE_REFERENCE: dict[str, str] = {}


def _same(got, want, path, tol=1e-6):
    """Assert the nested value `got` (reference script) equals `want` (this file) within
    tol (absolute + relative), structure, dict keys and lengths included."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), (
            f"{path}: keys {list(got)} != {list(want)}"
        )
        for k in want:
            _same(got[k], want[k], f"{path}[{k!r}]", tol)
    elif isinstance(want, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(want), f"{path}: length differs"
        for i, (g, w) in enumerate(zip(got, want)):
            _same(g, w, f"{path}[{i}]", tol)
    else:
        assert abs(float(got) - float(want)) <= tol * (1 + abs(float(want))), (
            f"{path}: {got} != {want}"
        )


def test_golden_numbers_come_from_the_reference_script():
    ref = fidelity_reference.compute()
    here = globals()
    golden = {
        name
        for name, value in here.items()
        if name.isupper()
        and name not in vars(fidelity_reference)
        and name != "NOT_FROM_THE_REFERENCE"
        and isinstance(value, (int, float, list, tuple, dict))
    }
    # every golden constant has a reference computation and every reference value a constant
    assert golden == set(ref), (sorted(golden - set(ref)), sorted(set(ref) - golden))
    for name in sorted(golden - set(NOT_FROM_THE_REFERENCE)):
        _same(ref[name], here[name], name)


# ----------------------------------------------------------------------------- the trainer applies them


@pytest.fixture(scope="module")
def make_trainer(tiny_model):
    """Trainer(cfg) factory on the tiny model, one rank, lr 0 (the policy stays the reference)."""
    import torch.distributed as dist

    import components
    import run

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return lambda *flags: components.make_trainer(
        run.parse_config(["--config", "configs/tiny.toml", "--lr", "0", *flags]),
        tiny_model,
        torch.device("cpu"),
    )


def exp(tokens, prompt_length, mask, reward, group, offline=False):
    from buffer import Experience

    return Experience(
        tokens,
        prompt_length,
        [0.0] * len(mask),
        mask,
        reward,
        group,
        group,
        0,
        {"offline": True} if offline else {},
    )


def own_logprobs(trainer, exps):
    """The trainer's log-probs of each response [R], written into the experiences as their
    behaviour log-probs where action_mask is 1 (on-policy); 0.0 placeholders elsewhere."""
    from packing import pack, response_logprobs

    with torch.no_grad():
        lp, _ = response_logprobs(trainer.model, pack(exps, trainer.pad), trainer.cfg.temperature)
    out = []
    for i, e in enumerate(exps):
        out.append(lp[i, : len(e.action_mask)].tolist())
        if not e.info.get("offline"):
            e.behaviour_logprobs = [x if m else 0.0 for x, m in zip(out[-1], e.action_mask)]
    return out


def test_kl_reward_penalty_counts_only_the_policys_tokens(make_trainer):
    # behaviour = reference on the policy's tokens, so KL(behaviour || reference) is 0: environment tokens
    # (placeholder logprob 0) and offline sequences (no behaviour logprobs) must not add to it
    tr = make_trainer("--kl-reward-coef", "0.5")
    rollouts = [
        exp([5, 6, 7, 20 + i, 21, 40, 41, 22 + i], 3, [1, 1, 0, 0, 1], float(i % 2), "g")
        for i in range(4)
    ]
    offline = [exp([5, 6, 7, 30, 31 + i], 3, [1, 1], 1.0, "o", offline=True) for i in range(2)]
    own_logprobs(tr, rollouts + offline)
    m = tr.step([rollouts, offline])
    assert abs(m["reward/kl_penalty"]) < 1e-5, m["reward/kl_penalty"]


def test_trainer_gives_reinforce_pp_the_token_counts(make_trainer):
    tr = make_trainer("--advantage", "reinforce_pp", "--policy-loss", "reinforce_tis")
    lengths, rewards = [1, 4, 2, 6], [1.0, 0.0, 0.0, 1.0]
    group = [
        exp([5, 6] + [20 + i] * n, 2, [1] * n, r, "g")
        for i, (n, r) in enumerate(zip(lengths, rewards))
    ]
    own_logprobs(tr, group)
    from trainer import StepBatch

    batch = StepBatch.of([group])
    got = tr.advantages(batch, batch.rewards)  # the stage Trainer.step calls
    want = EA.reinforce_pp_advantages(
        torch.tensor(rewards),
        torch.zeros(4, dtype=torch.long),
        token_counts=torch.tensor(lengths, dtype=torch.float),
    )
    assert close(got.tolist(), want.tolist(), tol=1e-5)
    assert tr.step([group])["advantage/abs_mean"] == pytest.approx(
        float(want.abs().mean()), abs=1e-5
    )


def test_trainer_normalises_mix_parts_separately(make_trainer):
    # rollouts on-policy (ratio 1): PPO's token loss is -A; GRPO advantages of rewards 1, 0, 0, 0 are
    # 1.5, -0.5, -0.5, -0.5 on 3, 1, 1, 1 tokens; one expert sequence of 5 tokens
    tr = make_trainer("--policy-loss", "mix")
    rollouts = [
        exp([5, 6] + [20 + i] * n, 2, [1] * n, r, "g")
        for i, (n, r) in enumerate(zip([3, 1, 1, 1], [1.0, 0.0, 0.0, 0.0]))
    ]
    expert = [exp([5, 6, 30, 31, 32, 33, 34], 2, [1] * 5, 1.0, "e", offline=True)]
    own_logprobs(tr, rollouts)
    (expert_lp,) = own_logprobs(tr, expert)
    m = tr.step([rollouts, expert])
    mu = 0.1
    rollout_part = -(1.5 * 3 - 0.5 * 3) / 6
    expert_part = -sum(expert_lp) / 5
    assert m["loss/policy"] == pytest.approx((1 - mu) * rollout_part + mu * expert_part, abs=1e-4)
    assert m["reward/mean"] == pytest.approx(
        0.25
    )  # the rollouts' mean: the expert's reward 1.0 is not a rollout's


def test_gibberish_filter_averages_the_policys_tokens_only():
    behaviour_logprobs, mask = (
        [-1.0, 0.0, 0.0, -1.0],
        [1, 0, 0, 1],
    )  # two environment tokens with placeholder 0
    assert (
        EF.gibberish_filter([1] * 6, behaviour_logprobs, 1.0, mask, min_mean_logprob=-0.8) is False
    )
    assert (
        EF.gibberish_filter([1] * 6, behaviour_logprobs, 1.0, min_mean_logprob=-0.8) is True
    )  # no mask: every token
