"""The algorithm zoo of losses.py against references written out element by element, plus
gradient-level checks where the theory gives one."""
import math

import pytest
import torch

import losses as L
from test_losses import inputs

REWARDS = torch.tensor([1.0, 0.0, 0.5, 0.0, 1.0, 1.0, 0.2, 0.7, 0.9])
INDEX = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2, 2])


def groups():
    out = {}
    for i, g in enumerate(INDEX.tolist()):
        out.setdefault(g, []).append(i)
    return out


def mean(xs):
    return sum(xs) / len(xs)


def test_dr_grpo_rloo_opmd_advantages_reference():
    r = REWARDS.tolist()
    dr = L.dr_grpo_advantages(REWARDS, INDEX)
    rloo = L.rloo_advantages(REWARDS, INDEX)
    opmd = L.opmd_advantages(REWARDS, INDEX, baseline="logavgexp", tau=0.5)
    for members in groups().values():
        for i in members:
            assert dr[i].item() == pytest.approx(r[i] - mean([r[j] for j in members]), abs=1e-6)
            others = [r[j] for j in members if j != i]
            assert rloo[i].item() == pytest.approx(r[i] - mean(others), abs=1e-6)
            log_z = 0.5 * math.log(mean([math.exp(r[j] / 0.5) for j in members]))
            assert opmd[i].item() == pytest.approx(r[i] - log_z, abs=1e-5)
    assert torch.equal(L.opmd_advantages(REWARDS, INDEX), dr)  # mean baseline
    assert L.rloo_advantages(torch.tensor([3.0]), torch.tensor([0])).item() == 0.0  # group of one


def test_reinforce_pp_batch_normalisation_reference():
    r = REWARDS.tolist()
    centred = [r[i] - mean([r[j] for j in groups()[g]]) for i, g in enumerate(INDEX.tolist())]
    mu = mean(centred)
    sd = math.sqrt(sum((x - mu) ** 2 for x in centred) / (len(centred) - 1))
    got = L.reinforce_pp_advantages(REWARDS, INDEX)
    assert got.tolist() == pytest.approx([(x - mu) / (sd + 1e-6) for x in centred], abs=1e-5)
    raw = L.reinforce_pp_advantages(REWARDS, INDEX, group_baseline=False)
    assert raw.mean().item() == pytest.approx(0, abs=1e-6) and raw.std().item() == pytest.approx(1, abs=1e-4)


def test_stepwise_grpo_counts_each_trajectory_once():
    # group 0: trajectory 0 has 3 steps (reward 1 at its end), trajectory 1 one step (reward 0)
    # group 1: trajectories 2 and 3 with rewards 0.5 and 0.25
    rewards = torch.tensor([0.0, 0.0, 1.0, 0.0, 0.5, 0.25])
    index = torch.tensor([0, 0, 0, 0, 1, 1])
    traj = torch.tensor([0, 0, 0, 1, 2, 3])
    got = L.stepwise_grpo_advantages(rewards, index, traj)
    a = 0.5 / (math.sqrt(0.5) + 1e-6)  # two trajectories (1, 0): mean 0.5, unbiased std sqrt(0.5)
    b = 0.125 / (math.sqrt(2 * 0.125 ** 2) + 1e-6)
    assert got.tolist() == pytest.approx([a, a, a, -a, b, -b], abs=1e-5)


def test_length_penalty_and_aggregations():
    assert L.length_penalty(torch.tensor([1.0, 1.0]), torch.tensor([10.0, 3.0]), 0.01).tolist() == pytest.approx([0.9, 0.97])
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    # two micro-batches of a global batch of 3 sequences / 5 tokens: this one holds 2 / 3
    assert L.aggregate(loss, mask, "token-mean", 5, 3).item() == pytest.approx((1 + 2 + 4) / 5)
    assert L.aggregate(loss, mask, "seq-mean-token-sum", 5, 3).item() == pytest.approx((3 + 4) / 3)
    assert L.aggregate(loss, mask, "seq-mean-token-mean", 5, 3).item() == pytest.approx((1.5 + 4) / 3)
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        L.aggregate(loss, mask, "mean", 5, 3)


def rand_inputs(seed=0, B=4, T=5):
    g = torch.Generator().manual_seed(seed)
    lp = (torch.randn(B, T, generator=g) * 0.3 - 1).requires_grad_()
    old = lp.detach() + torch.randn(B, T, generator=g) * 0.4
    adv = torch.randn(B, 1, generator=g).expand(B, T)
    mask = (torch.rand(B, T, generator=g) > 0.2).float()
    mask[:, 0] = 1
    return lp, old, adv, mask


def test_ppo_dual_clip_reference():
    lp, old, adv, mask = rand_inputs(1)
    out = L.ppo_clip_loss(inputs(lp, old, adv, mask), clip_low=0.2, clip_high=0.2, dual_clip=1.5)
    for b in range(4):
        for t in range(5):
            r, a = math.exp(lp[b, t].item() - old[b, t].item()), adv[b, t].item()
            ref = -min(r * a, min(max(r, 0.8), 1.2) * a)
            if a < 0:
                ref = min(ref, -1.5 * a)
            assert out["loss"][b, t].item() == pytest.approx(ref, abs=1e-5)


def test_dppo_kl_masks_outside_range_and_adds_squared_log_ratio():
    lp, old, adv, mask = rand_inputs(2)
    old = old.clone()
    old[0, 0] = lp[0, 0].item() + 3.0  # ratio e^-3 < 0.125: masked
    out = L.dppo_kl_loss(inputs(lp, old, adv, mask), dppo_mask_low=0.125, dppo_mask_high=8.0, kl_tau=0.1)
    for b in range(4):
        for t in range(5):
            lr = lp[b, t].item() - old[b, t].item()
            inside = 0.125 <= math.exp(lr) <= 8.0
            ref = (-math.exp(lr) * adv[b, t].item() if inside else 0.0) + 0.1 * lr ** 2
            assert out["loss"][b, t].item() == pytest.approx(ref, abs=1e-5)
    assert out["masked"][0, 0].item() == 1.0


def test_detached_weight_losses_reference_and_gradients():
    lp, old, adv, mask = rand_inputs(3)
    inp = inputs(lp, old, adv, mask)
    for name, weight in [
        ("reinforce_tis", lambda r, a: min(r, 2.0)),
        ("cispo", lambda r, a: min(max(r, 0.0), 1.28)),
        ("topr", lambda r, a: 1.0 if a >= 0 else min(r, 1.0)),
    ]:
        lp.grad = None
        out = L.POLICY_LOSSES[name](inp)
        (out["loss"] * mask).sum().backward()
        for b in range(4):
            for t in range(5):
                r, a = math.exp(lp[b, t].item() - old[b, t].item()), adv[b, t].item()
                assert out["loss"][b, t].item() == pytest.approx(-weight(r, a) * a * lp[b, t].item(), abs=1e-5), name
                # the weight is detached: d loss / d logprob = -w A
                assert lp.grad[b, t].item() == pytest.approx(-weight(r, a) * a * mask[b, t].item(), abs=1e-5), name


def test_gspo_sequence_ratio_reference_and_on_policy_gradient():
    lp, old, adv, mask = rand_inputs(4)
    out = L.gspo_loss(inputs(lp, old, adv, mask), clip_low=0.1, clip_high=0.1)
    for b in range(4):
        n = mask[b].sum().item()
        s = math.exp(sum((lp[b, t].item() - old[b, t].item()) * mask[b, t].item() for t in range(5)) / n)
        a = adv[b, 0].item()
        ref = -min(s * a, min(max(s, 0.9), 1.1) * a)
        for t in range(5):
            assert out["loss"][b, t].item() == pytest.approx(ref, abs=1e-5)


@pytest.mark.parametrize("name", ["ppo_clip", "dppo_kl", "reinforce_tis", "cispo", "gspo", "topr", "mix"])
def test_on_policy_case_reduces_to_policy_gradient(name):
    # ratio 1 everywhere: every clipped / weighted loss has the gradient of -A logprob
    lp, _, adv, mask = rand_inputs(5)
    kwargs = {"kl_tau": 0.3} if name == "dppo_kl" else {}  # the squared log-ratio has zero gradient at ratio 1
    out = L.POLICY_LOSSES[name](inputs(lp, lp.detach(), adv, mask), **kwargs)
    (out["loss"] * mask).sum().backward()
    scale = 0.9 if name == "mix" else 1.0  # (1 - mu) on rollouts
    assert torch.allclose(lp.grad, -adv * mask * scale, atol=1e-6), name


def seq_logratio(lp, old, mask, b):
    return sum((lp[b, t].item() - old[b, t].item()) * mask[b, t].item() for t in range(lp.shape[1]))


def test_opmd_kimi_and_pairwise_reference():
    lp, old, _, mask = rand_inputs(6, B=5)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0])
    index = torch.tensor([0, 0, 0, 1, 1])
    inp = inputs(lp, old, torch.zeros(5, 5), mask, rewards, index)
    tau = 0.7
    kimi = L.opmd_kimi_loss(inp, tau=tau)["loss"]
    pair = L.opmd_pairwise_loss(inp, tau=tau)["loss"]
    members = {0: [0, 1, 2], 1: [3, 4]}
    for g, ms in members.items():
        log_z = tau * math.log(mean([math.exp(rewards[j].item() / tau) for j in ms]))
        a = {j: rewards[j].item() - tau * seq_logratio(lp, old, mask, j) for j in ms}
        for i in ms:
            ref_kimi = (rewards[i].item() - log_z - tau * seq_logratio(lp, old, mask, i)) ** 2
            assert (kimi[i] * mask[i]).sum().item() == pytest.approx(ref_kimi, abs=1e-5)
            ref_pair = sum((a[i] - a[j]) ** 2 for j in ms) / (2 * len(ms))
            assert (pair[i] * mask[i]).sum().item() == pytest.approx(ref_pair, abs=1e-5)


def test_simple_opmd_gradient_is_scaled_mean_baseline_policy_gradient():
    lp, old, _, mask = rand_inputs(7, B=6)
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.3, 1.0, 0.9])
    index = torch.tensor([0, 0, 0, 1, 1, 1])
    tau = 0.5
    adv = L.opmd_advantages(rewards, index)[:, None].expand(6, 5)
    out = L.opmd_simple_loss(inputs(lp, old, adv, mask, rewards, index), tau=tau)
    (out["loss"] * mask).sum().backward()
    # reference: gradient of -sum_i (r_i - mean of its group) * sum_t logprob_it, times 1/(1+tau)
    for b in range(6):
        g = index[b].item()
        base = mean([rewards[j].item() for j in range(6) if index[j].item() == g])
        for t in range(5):
            expect = -(rewards[b].item() - base) * mask[b, t].item() / (1 + tau)
            assert lp.grad[b, t].item() == pytest.approx(expect, abs=1e-6)


def test_pairwise_opmd_gradient_on_policy_is_mean_baseline_policy_gradient():
    # at ratio 1 the gradient of the group loss 1/(2K^2) sum_ij (a_i - a_j)^2 (= the mean over
    # the group's sequences, as seq-mean-token-sum aggregates it) is 2 tau / K times the
    # group-mean-baseline policy gradient -sum_i (r_i - mean r) grad log pi(y_i)
    lp, _, _, mask = rand_inputs(8, B=4)
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.5])
    index = torch.zeros(4, dtype=torch.long)
    tau = 0.3
    out = L.opmd_pairwise_loss(inputs(lp, lp.detach(), torch.zeros(4, 5), mask, rewards, index), tau=tau)
    L.aggregate(out["loss"], mask, L.opmd_pairwise_loss.agg, mask.sum(), 4).backward()
    base = rewards.mean()
    expect = -(2 * tau / 4) * (rewards - base)[:, None] * mask
    assert torch.allclose(lp.grad, expect, atol=1e-6)


def test_sft_and_dpo_reference():
    lp, _, _, mask = rand_inputs(9, B=4)
    out = L.sft_loss(inputs(lp, lp.detach(), torch.zeros(4, 5), mask))
    assert torch.equal(out["loss"], -lp)
    ref = lp.detach() - 0.5
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])  # group 0: pair (0 chosen, 1 rejected); group 1: no gap
    index = torch.tensor([0, 0, 1, 1])
    dpo = L.dpo_loss(inputs(lp, lp.detach(), torch.zeros(4, 5), mask, rewards, index, ref), beta=0.2)
    margin = 0.2 * ((seq_logratio(lp, ref, mask, 0)) - seq_logratio(lp, ref, mask, 1))
    pair = -math.log(1 / (1 + math.exp(-margin)))
    sums = (dpo["loss"] * mask).sum(-1).tolist()
    assert sums == pytest.approx([pair, pair, 0.0, 0.0], abs=1e-5)
    with pytest.raises(ValueError, match="ref_logprobs"):
        L.dpo_loss(inputs(lp, lp.detach(), torch.zeros(4, 5), mask, rewards, index))


def test_mix_weights_expert_sft_and_rollout_ppo():
    lp, old, adv, mask = rand_inputs(10)
    expert = torch.tensor([True, False, False, True])
    out = L.mix_loss(inputs(lp, old, adv, mask, expert=expert), mu=0.25)
    ppo = L.ppo_clip_loss(inputs(lp, old, adv, mask))["loss"]
    assert torch.allclose(out["loss"][0], -0.25 * lp[0]) and torch.allclose(out["loss"][1], 0.75 * ppo[1])
    assert out["expert"][:, 0].tolist() == [1.0, 0.0, 0.0, 1.0]


def test_entropy_reference():
    logits = torch.randn(2, 3, 7)
    p = torch.softmax(logits, -1)
    assert torch.allclose(L.token_entropy(logits), -(p * p.log()).sum(-1), atol=1e-5)


def test_filters():
    assert not L.zero_advantage_filter([1, 2], [-0.1], 0.0) and L.zero_advantage_filter([1, 2], [-0.1], -0.5)
    assert not L.gibberish_filter([1, 2, 3], [-9.0, -8.0], 1.0) and L.gibberish_filter([1, 2, 3], [-1.0, -2.0], 1.0)
    loop = [7, 8] * 10
    assert not L.repetition_filter([1] + loop, [0.0] * len(loop), 1.0, ngram=2, max_repeat_frac=0.5)
    assert L.repetition_filter([1] + list(range(20)), [0.0] * 20, 1.0, ngram=2, max_repeat_frac=0.5)


def test_resolve_plugins_and_errors():
    assert L.resolve("ppo_clip", L.POLICY_LOSSES, "policy_loss", {"dual_clip": 3.0}) is L.ppo_clip_loss
    assert L.resolve("losses.sft_loss", L.POLICY_LOSSES, "policy_loss") is L.sft_loss
    with pytest.raises(ValueError, match="unknown policy_loss 'nope'"):
        L.resolve("nope", L.POLICY_LOSSES, "policy_loss")
    with pytest.raises(ValueError, match="cannot be imported"):
        L.resolve("no_such_module.fn", L.POLICY_LOSSES, "policy_loss")
    with pytest.raises(ValueError, match=r"takes no argument\(s\) \['clip'\]"):
        L.resolve("ppo_clip", L.POLICY_LOSSES, "policy_loss", {"clip": 0.1})
