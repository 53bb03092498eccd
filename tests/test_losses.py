"""losses.py against slow, obviously-correct references written out element by element."""

import math

import pytest
import torch

from engines import Sampling, sample_token
from extras.advantages import dr_grpo_advantages, rloo_advantages, stepwise_grpo_advantages
from extras.opmd import opmd_advantages
from extras.policy_losses import mix_loss
from losses import LossInputs, grpo_advantages, kl_estimate, masked_sum, ppo_clip_loss


def inputs(lp, behaviour, adv, mask=None, rewards=None, group_index=None, ref=None, expert=None):
    B = lp.shape[0]
    return LossInputs(
        lp,
        behaviour,
        adv,
        torch.ones_like(lp) if mask is None else mask,
        torch.zeros(B) if rewards is None else rewards,
        torch.arange(B) if group_index is None else group_index,
        ref,
        expert,
    )


def test_grpo_advantages_match_loop_reference():
    torch.manual_seed(0)
    rewards = torch.rand(12)
    index = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2, 2, 3, 3, 3])
    got = grpo_advantages(rewards, index)
    for i in range(12):
        members = [rewards[j].item() for j in range(12) if index[j] == index[i]]
        mean = sum(members) / len(members)
        std = math.sqrt(sum((x - mean) ** 2 for x in members) / (len(members) - 1))
        assert abs(got[i].item() - (rewards[i].item() - mean) / (std + 1e-6)) < 1e-5


def test_grpo_equal_rewards_give_zero_advantage():
    adv = grpo_advantages(torch.tensor([1.0, 1.0, 0.0, 0.0]), torch.tensor([0, 0, 1, 1]))
    assert torch.all(adv == 0)


GROUP_ESTIMATORS = {
    "grpo": grpo_advantages,
    "dr_grpo": dr_grpo_advantages,
    "rloo": rloo_advantages,
    "opmd mean": opmd_advantages,
    "opmd logavgexp": lambda r, i: opmd_advantages(r, i, baseline="logavgexp", tau=0.3),
}


@pytest.mark.parametrize("name", list(GROUP_ESTIMATORS))
def test_a_group_of_equal_non_dyadic_rewards_has_exactly_zero_advantage(name):
    # in float32 the mean of eight 0.7s is not 0.7: GRPO gave such a group +0.056 for every member
    fn = GROUP_ESTIMATORS[name]
    for value in (0.7, 0.1, 1 / 3, 0.3, 0.9, 2 / 3):
        for size in (2, 3, 5, 8):
            for n_constant in (1, 2, 5, 8):
                varying = torch.tensor([0.0, 1.0, 0.25])  # group 0
                rewards = torch.cat([varying, torch.full((size * n_constant,), value)])  # [B]
                index = torch.cat(
                    [torch.zeros(3), 1 + torch.arange(n_constant).repeat_interleave(size)]
                ).long()
                adv = fn(rewards, index)
                assert torch.all(adv[3:] == 0), (name, value, size, n_constant, adv[3:].abs().max())
                assert (
                    adv[:3].abs().max() > 0.1
                )  # the group with differing rewards keeps its advantage


def test_kl_estimators_as_losses_follow_the_gradient_each_is_documented_with():
    # exact enumeration over a categorical policy: the loss E_{y ~ pi}[k(log pi(y), log q(y))]
    # with the samples' distribution held fixed, as the trainer sees its own samples
    torch.manual_seed(0)
    theta = torch.randn(6, dtype=torch.float64, requires_grad=True)
    log_q = torch.log_softmax(torch.randn(6, dtype=torch.float64), -1)

    def grad(f):
        (g,) = torch.autograd.grad(f(torch.log_softmax(theta, -1)), theta)
        return g

    def as_loss(kind):
        return lambda log_pi: (log_pi.exp().detach() * kl_estimate(log_pi, log_q, kind)).sum()

    forward_kl = grad(lambda log_pi: (log_pi.exp() * (log_pi - log_q)).sum())  # KL(pi || q)
    reverse_kl = grad(lambda log_pi: (log_q.exp() * (log_q - log_pi)).sum())  # KL(q || pi)
    assert grad(as_loss("k1")).abs().max() < 1e-12
    assert torch.allclose(grad(as_loss("k2")), forward_kl, atol=1e-12)
    assert torch.allclose(grad(as_loss("k3")), reverse_kl, atol=1e-12)
    assert torch.allclose(grad(as_loss("low_var")), reverse_kl, atol=1e-12)
    assert not torch.allclose(forward_kl, reverse_kl, atol=1e-3)  # the two differ here


def test_ppo_clip_matches_scalar_reference():
    torch.manual_seed(1)
    lp, behaviour, adv = torch.randn(3, 5) * 0.3, torch.randn(3, 5) * 0.3, torch.randn(3, 5)
    out = ppo_clip_loss(inputs(lp, behaviour, adv), clip_low=0.2, clip_high=0.28, dual_clip=None)
    for b in range(3):
        for t in range(5):
            r = math.exp(lp[b, t].item() - behaviour[b, t].item())
            a = adv[b, t].item()
            ref = -min(r * a, min(max(r, 0.8), 1.28) * a)
            assert abs(out["loss"][b, t].item() - ref) < 1e-5
            assert out["clipped"][b, t].item() == float(min(max(r, 0.8), 1.28) * a < r * a)


def test_ppo_on_policy_gradient_is_policy_gradient():
    # ratio 1: the clipped loss has the gradient of -A * logprob (plain policy gradient)
    torch.manual_seed(2)
    lp = torch.randn(2, 4, requires_grad=True)
    adv = torch.randn(2, 4)
    ppo_clip_loss(inputs(lp, lp.detach(), adv))["loss"].sum().backward()
    assert torch.allclose(lp.grad, -adv)


def test_kl_estimators_reference_and_k3_nonnegative():
    lp, ref = torch.randn(4, 6), torch.randn(4, 6)
    k3 = kl_estimate(lp, ref, "k3")
    # verl's k3 / low_var_kl: the estimate is clamped to [-10, 10] (log-ratio to [-20, 20])
    assert torch.allclose(k3, (torch.exp(ref - lp) - 1 - (ref - lp)).clamp(max=10), atol=1e-6)
    assert torch.equal(kl_estimate(lp, ref, "low_var"), k3)
    assert (k3 >= 0).all() and kl_estimate(lp, lp, "k3").abs().max() == 0
    assert torch.allclose(kl_estimate(lp, ref, "k1"), lp - ref)
    assert torch.allclose(kl_estimate(lp, ref, "k2"), (lp - ref) ** 2 / 2)
    for far in (30.0, 3.0, -12.0):  # e^3 - 4 = 16.1 and e^-12 + 11 = 11.0 are clamped too
        assert kl_estimate(torch.tensor([[0.0]]), torch.tensor([[far]]), "low_var").item() == 10.0
    assert kl_estimate(
        torch.tensor([[0.0]]), torch.tensor([[2.0]]), "low_var"
    ).item() == pytest.approx(math.exp(2) - 3)
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_estimate(lp, ref, "k4")


def test_masked_sum_ignores_masked_entries():
    x = torch.tensor([[1.0, 100.0], [3.0, 5.0]])
    assert masked_sum(x, torch.tensor([[1.0, 0.0], [1.0, 1.0]])).item() == 9.0


def test_sample_token_logprob_is_exact_nucleus_distribution():
    torch.manual_seed(3)
    logits = torch.randn(3, 7)
    for temperature, top_p in [(1.0, 1.0), (0.7, 1.0), (1.0, 0.6)]:
        g = torch.Generator().manual_seed(0)
        tok, lp, _ = sample_token(logits, Sampling(temperature=temperature, top_p=top_p), g)
        for b in range(3):
            probs = torch.softmax(logits[b] / temperature, -1).tolist()
            order = sorted(range(7), key=lambda i: -probs[i])
            kept, mass = [], 0.0
            for i in order:  # smallest prefix reaching top_p
                if mass >= top_p:
                    break
                kept.append(i)
                mass += probs[i]
            assert tok[b].item() in kept
            assert abs(math.exp(lp[b].item()) - probs[tok[b]] / mass) < 1e-5


def test_sampled_tokens_follow_the_nucleus_distribution():
    # 20,000 draws of one row: each kept token's frequency within 4 standard errors of its probability;
    # tokens outside the nucleus (probability 0 after top-p) are never drawn
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    n, top_p = 20000, 0.8
    g = torch.Generator().manual_seed(1)
    tok, _, _ = sample_token(logits.expand(n, -1), Sampling(temperature=1.0, top_p=top_p), g)
    probs = torch.softmax(logits, -1)
    kept = (probs.cumsum(-1) - probs) < top_p  # the smallest prefix reaching top_p (sorted already)
    expected = torch.where(kept, probs, 0.0) / probs[kept].sum()
    freq = torch.bincount(tok, minlength=6).double() / n
    assert (freq[~kept] == 0).all()
    se = (expected * (1 - expected) / n).sqrt()
    assert ((freq - expected).abs() <= 4 * se + 1e-12).all(), (freq, expected)


def test_helpers_make_their_tensors_on_their_inputs_device():
    # CUDA inputs must not meet CPU helper tensors. Stand-ins for a second device on a CPU machine: CPU inputs
    # while torch's default device is "meta" (a helper tensor made without device= lands there), and meta inputs
    rewards, groups = torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([0, 0, 1, 1])
    trajectories = torch.tensor([0, 1, 2, 2])
    with torch.device("meta"):
        assert opmd_advantages(rewards, groups, baseline="logavgexp").device.type == "cpu"
        assert stepwise_grpo_advantages(rewards, groups, trajectories).device.type == "cpu"
    lp = torch.randn(4, 3, device="meta")
    out = mix_loss(
        inputs(lp, lp, lp, mask=torch.ones(4, 3, device="meta"))
    )  # no expert mask given: made here
    assert out["loss"].device.type == "meta"


def test_ppo_clip_names_the_bound_that_clipped_each_token():
    # ratios e^lp: 0.5 (A<0: low), 1.5 (A>0: high), 5.0 (A<0: dual), 1.0 (none), 0.5 (A>0: none)
    ratio = torch.tensor([[0.5, 1.5, 5.0, 1.0, 0.5]])
    adv = torch.tensor([[-1.0, 1.0, -1.0, 1.0, 1.0]])
    out = ppo_clip_loss(inputs(ratio.log(), torch.zeros(1, 5), adv))
    assert out["clipped_low"].tolist() == [[1, 0, 0, 0, 0]]
    assert out["clipped_high"].tolist() == [[0, 1, 0, 0, 0]]
    assert out["clipped_dual"].tolist() == [[0, 0, 1, 0, 0]]
    assert out["clipped"].tolist() == [[1, 1, 1, 0, 0]]
