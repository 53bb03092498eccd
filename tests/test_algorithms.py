"""The algorithm zoo of losses.py against references written out element by element, plus
gradient-level checks where the theory gives one and a one-step direction check of every
policy loss. tests/test_fidelity.py pins each one to numbers from its reference code."""

import dataclasses
import json
import math

import pytest
import torch
from test_losses import inputs

import components
import losses as L
from buffer import Experience
from extras import advantages as EA
from extras import filters as EF
from extras import opmd as OPMD
from extras import policy_losses as EP
from packing import token_entropy

REWARDS = torch.tensor([1.0, 0.0, 0.5, 0.0, 1.0, 1.0, 0.2, 0.7, 0.9])
INDEX = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2, 2])


def loss_named(name: str) -> L.PolicyLoss:
    """The policy loss registered as `name`, resolved as the composition root does."""
    return L.resolve_loss(name, registry=components.policy_losses(name))


def groups():
    out = {}
    for i, g in enumerate(INDEX.tolist()):
        out.setdefault(g, []).append(i)
    return out


def mean(xs):
    return sum(xs) / len(xs)


def test_dr_grpo_rloo_opmd_advantages_reference():
    r = REWARDS.tolist()
    dr = EA.dr_grpo_advantages(REWARDS, INDEX)
    rloo = EA.rloo_advantages(REWARDS, INDEX)
    opmd = OPMD.opmd_advantages(REWARDS, INDEX, baseline="logavgexp", tau=0.5)
    for members in groups().values():
        for i in members:
            assert dr[i].item() == pytest.approx(r[i] - mean([r[j] for j in members]), abs=1e-6)
            others = [r[j] for j in members if j != i]
            assert rloo[i].item() == pytest.approx(r[i] - mean(others), abs=1e-6)
            log_z = 0.5 * math.log(mean([math.exp(r[j] / 0.5) for j in members]))
            assert opmd[i].item() == pytest.approx(r[i] - log_z, abs=1e-5)
    assert torch.equal(OPMD.opmd_advantages(REWARDS, INDEX), dr)  # mean baseline
    # a group of one has no baseline and keeps its reward (verl; Trinity-RFT's OPMD)
    lone, one = torch.tensor([3.0]), torch.tensor([0])
    assert EA.rloo_advantages(lone, one).item() == EA.dr_grpo_advantages(lone, one).item() == 3.0
    assert L.grpo_advantages(lone, one).item() == pytest.approx(3.0 / (1 + 1e-6))
    assert OPMD.opmd_advantages(lone, one, baseline="logavgexp", tau=0.5).item() == 3.0


def whiten_tokens(values, counts):
    """Whitening over the batch's tokens, written out: sequence i stands for counts[i] tokens."""
    tokens = [v for v, c in zip(values, counts) for _ in range(c)]
    mu = mean(tokens)
    var = sum((x - mu) ** 2 for x in tokens) / (len(tokens) - 1)
    return [(v - mu) / math.sqrt(var + 1e-8) for v in values]


def test_reinforce_pp_batch_normalisation_reference():
    r = REWARDS.tolist()
    centred = [r[i] - mean([r[j] for j in groups()[g]]) for i, g in enumerate(INDEX.tolist())]
    counts = [3, 1, 4, 2, 2, 5, 1, 3, 2]
    got = EA.reinforce_pp_advantages(REWARDS, INDEX, token_counts=torch.tensor(counts))
    assert got.tolist() == pytest.approx(whiten_tokens(centred, counts), abs=1e-5)
    # without token counts every sequence counts once
    assert EA.reinforce_pp_advantages(REWARDS, INDEX).tolist() == pytest.approx(
        whiten_tokens(centred, [1] * 9), abs=1e-5
    )
    raw = EA.reinforce_pp_advantages(REWARDS, INDEX, group_baseline=False)
    assert raw.mean().item() == pytest.approx(0, abs=1e-6) and raw.std().item() == pytest.approx(
        1, abs=1e-4
    )


def test_stepwise_grpo_counts_each_trajectory_once():
    # group 0: trajectory 0 has 3 steps (reward 1 at its end), trajectory 1 one step (reward 0)
    # group 1: trajectories 2 and 3 with rewards 0.5 and 0.25
    rewards = torch.tensor([0.0, 0.0, 1.0, 0.0, 0.5, 0.25])
    index = torch.tensor([0, 0, 0, 0, 1, 1])
    traj = torch.tensor([0, 0, 0, 1, 2, 3])
    got = EA.stepwise_grpo_advantages(rewards, index, traj)
    a = 0.5 / (math.sqrt(0.5) + 1e-6)  # two trajectories (1, 0): mean 0.5, unbiased std sqrt(0.5)
    b = 0.125 / (math.sqrt(2 * 0.125**2) + 1e-6)
    assert got.tolist() == pytest.approx([a, a, a, -a, b, -b], abs=1e-5)


def test_length_penalty_and_aggregations():
    assert L.length_penalty(
        torch.tensor([1.0, 1.0]), torch.tensor([10.0, 3.0]), 0.01
    ).tolist() == pytest.approx([0.9, 0.97])
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    # two micro-batches of a global batch of 3 sequences / 5 tokens: this one holds 2 / 3
    assert L.aggregate(loss, mask, "token-mean", 5, 3).item() == pytest.approx((1 + 2 + 4) / 5)
    assert L.aggregate(loss, mask, "seq-mean-token-sum", 5, 3).item() == pytest.approx((3 + 4) / 3)
    assert L.aggregate(loss, mask, "seq-mean-token-mean", 5, 3).item() == pytest.approx(
        (1.5 + 4) / 3
    )
    # per-sequence totals (MIX's parts): sequence 0 belongs to a part of 4 tokens / 2 sequences,
    # sequence 1 to one of 1 token / 1 sequence
    tokens, seqs = torch.tensor([4.0, 1.0]), torch.tensor([2.0, 1.0])
    assert L.aggregate(loss, mask, "token-mean", tokens, seqs).item() == pytest.approx(
        (1 + 2) / 4 + 4 / 1
    )
    assert L.aggregate(loss, mask, "seq-mean-token-sum", tokens, seqs).item() == pytest.approx(
        3 / 2 + 4 / 1
    )
    assert L.aggregate(loss, mask, "seq-mean-token-mean", tokens, seqs).item() == pytest.approx(
        1.5 / 2 + 4 / 1
    )
    expert = torch.tensor([True, False, True, False])
    tok, seq = L.part_totals(
        torch.tensor([2.0, 3.0, 5.0, 7.0]), expert, torch.tensor([True, True, True, False])
    )
    assert tok.tolist() == [7.0, 3.0, 7.0, 3.0] and seq.tolist() == [2.0, 1.0, 2.0, 1.0]
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        L.aggregate(loss, mask, "mean", 5, 3)


def rand_inputs(seed=0, B=4, T=5):
    g = torch.Generator().manual_seed(seed)
    lp = (torch.randn(B, T, generator=g) * 0.3 - 1).requires_grad_()
    behaviour = lp.detach() + torch.randn(B, T, generator=g) * 0.4
    adv = torch.randn(B, 1, generator=g).expand(B, T)
    mask = (torch.rand(B, T, generator=g) > 0.2).float()
    mask[:, 0] = 1
    return lp, behaviour, adv, mask


def test_ppo_dual_clip_reference():
    lp, behaviour, adv, mask = rand_inputs(1)
    out = L.ppo_clip_loss(
        inputs(lp, behaviour, adv, mask), clip_low=0.2, clip_high=0.2, dual_clip=1.5
    )
    for b in range(4):
        for t in range(5):
            r, a = math.exp(lp[b, t].item() - behaviour[b, t].item()), adv[b, t].item()
            ref = -min(r * a, min(max(r, 0.8), 1.2) * a)
            if a < 0:
                ref = min(ref, -1.5 * a)
            assert out["loss"][b, t].item() == pytest.approx(ref, abs=1e-5)


def test_dppo_kl_masks_by_probability_difference_on_the_advantage_side():
    lp, behaviour, adv, mask = rand_inputs(2)
    out = EP.dppo_kl_loss(
        inputs(lp, behaviour, adv, mask),
        dppo_mask_low=0.1,
        dppo_mask_high=0.05,
        adv_tau=2.0,
        kl_tau=0.1,
    )
    masked = 0
    for b in range(4):
        for t in range(5):
            lr, a = lp[b, t].item() - behaviour[b, t].item(), adv[b, t].item()
            diff = math.exp(lp[b, t].item()) - math.exp(behaviour[b, t].item())
            outside = (
                diff > 0.05 if a > 0 else diff < -0.1
            )  # up-moves for A > 0, down-moves otherwise
            masked += outside
            ref = (0.0 if outside else -2.0 * a * math.exp(lr)) + 0.1 * lr**2
            assert out["loss"][b, t].item() == pytest.approx(ref, abs=1e-5)
            assert out["masked"][b, t].item() == float(outside)
    assert 0 < masked < 20


def test_detached_weight_losses_reference_and_gradients():
    lp, behaviour, adv, mask = rand_inputs(3)
    inp = inputs(lp, behaviour, adv, mask)
    seq_ratio = [math.exp(seq_logratio(lp, behaviour, mask, b)) for b in range(4)]  # pi(y) / mu(y)
    for name, weight in [
        ("reinforce_tis", lambda r, a, b: min(r, 1.02)),
        ("cispo", lambda r, a, b: min(max(r, 0.0), 1.2)),
        ("topr", lambda r, a, b: 1.0 if a >= 0 else min(seq_ratio[b], 1.0)),
    ]:
        lp.grad = None
        out = loss_named(name).fn(inp)
        (out["loss"] * mask).sum().backward()
        for b in range(4):
            for t in range(5):
                r, a = math.exp(lp[b, t].item() - behaviour[b, t].item()), adv[b, t].item()
                w = weight(r, a, b)
                assert out["loss"][b, t].item() == pytest.approx(
                    -w * a * lp[b, t].item(), abs=1e-5
                ), name
                # the weight is detached: d loss / d logprob = -w A
                assert lp.grad[b, t].item() == pytest.approx(
                    -w * a * mask[b, t].item(), abs=1e-5
                ), name


def test_gspo_sequence_ratio_reference_and_on_policy_gradient():
    lp, behaviour, adv, mask = rand_inputs(4)
    out = EP.gspo_loss(inputs(lp, behaviour, adv, mask), clip_low=0.1, clip_high=0.1)
    for b in range(4):
        n = mask[b].sum().item()
        s = math.exp(
            sum((lp[b, t].item() - behaviour[b, t].item()) * mask[b, t].item() for t in range(5))
            / n
        )
        a = adv[b, 0].item()
        ref = -min(s * a, min(max(s, 0.9), 1.1) * a)
        for t in range(5):
            assert out["loss"][b, t].item() == pytest.approx(ref, abs=1e-5)


@pytest.mark.parametrize(
    "name", ["ppo_clip", "dppo_kl", "reinforce_tis", "cispo", "gspo", "topr", "mix"]
)
def test_on_policy_case_reduces_to_policy_gradient(name):
    # ratio 1 everywhere: every clipped / weighted loss has the gradient of -A logprob
    lp, _, adv, mask = rand_inputs(5)
    kwargs = (
        {"kl_tau": 0.3} if name == "dppo_kl" else {}
    )  # the squared log-ratio has zero gradient at ratio 1
    out = loss_named(name).fn(inputs(lp, lp.detach(), adv, mask), **kwargs)
    (out["loss"] * mask).sum().backward()
    scale = 0.9 if name == "mix" else 1.0  # (1 - mu) on rollouts
    assert torch.allclose(lp.grad, -adv * mask * scale, atol=1e-6), name


def seq_logratio(lp, behaviour, mask, b):
    return sum(
        (lp[b, t].item() - behaviour[b, t].item()) * mask[b, t].item() for t in range(lp.shape[1])
    )


def test_opmd_kimi_and_pairwise_reference():
    lp, behaviour, _, mask = rand_inputs(6, B=5)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0])
    index = torch.tensor([0, 0, 0, 1, 1])
    tau = 0.7
    adv = OPMD.opmd_advantages(rewards, index, baseline="logavgexp", tau=tau)
    inp = inputs(lp, behaviour, adv[:, None].expand(5, 5), mask, rewards, index)
    kimi = OPMD.opmd_kimi_loss(inp, tau=tau)["loss"]
    pair = OPMD.opmd_pairwise_loss(inp, tau=tau)["loss"]
    members = {0: [0, 1, 2], 1: [3, 4]}
    for g, ms in members.items():
        log_z = tau * math.log(mean([math.exp(rewards[j].item() / tau) for j in ms]))
        for i in ms:
            a, s = rewards[i].item() - log_z, seq_logratio(lp, behaviour, mask, i)
            ref_kimi = (
                -a * sum(lp[i, t].item() * mask[i, t].item() for t in range(5)) + tau / 2 * s**2
            )
            assert (kimi[i] * mask[i]).sum().item() == pytest.approx(ref_kimi, abs=1e-5)
            # in value d = r: the squared deviation of the reward from its group mean
            ref_pair = (rewards[i].item() - mean([rewards[j].item() for j in ms])) ** 2
            assert (pair[i] * mask[i]).sum().item() == pytest.approx(ref_pair, abs=1e-5)


def test_kimi_gradient_is_the_squared_loss_gradient_over_2_tau():
    # grad of (r - tau log Z - tau s)^2 = -2 tau (r - tau log Z - tau s) grad s, s = log pi/pi_old
    lp, behaviour, _, mask = rand_inputs(11, B=5)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5])
    index = torch.tensor([0, 0, 0, 1, 1])
    tau = 0.4
    adv = OPMD.opmd_advantages(rewards, index, baseline="logavgexp", tau=tau)
    out = OPMD.opmd_kimi_loss(
        inputs(lp, behaviour, adv[:, None].expand(5, 5), mask, rewards, index), tau=tau
    )
    (out["loss"] * mask).sum().backward()
    s = torch.tensor([seq_logratio(lp, behaviour, mask, b) for b in range(5)])
    squared_grad = -2 * tau * (adv - tau * s)[:, None] * mask
    assert torch.allclose(lp.grad, squared_grad / (2 * tau), atol=1e-5)


def test_simple_opmd_gradient_is_scaled_mean_baseline_policy_gradient():
    lp, behaviour, _, mask = rand_inputs(7, B=6)
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.3, 1.0, 0.9])
    index = torch.tensor([0, 0, 0, 1, 1, 1])
    tau = 0.5
    adv = OPMD.opmd_advantages(rewards, index)[:, None].expand(6, 5)
    out = OPMD.opmd_simple_loss(inputs(lp, behaviour, adv, mask, rewards, index), tau=tau)
    (out["loss"] * mask).sum().backward()
    # reference: gradient of -sum_i (r_i - mean of its group) * sum_t logprob_it, times 1/(1+tau)
    for b in range(6):
        g = index[b].item()
        base = mean([rewards[j].item() for j in range(6) if index[j].item() == g])
        for t in range(5):
            expect = -(rewards[b].item() - base) * mask[b, t].item() / (1 + tau)
            assert lp.grad[b, t].item() == pytest.approx(expect, abs=1e-6)


def test_pairwise_opmd_gradient_is_mean_baseline_policy_gradient():
    # the loss sum_groups sum_i (d_i - mean d)^2 / (n_tokens max(1, tau)), aggregated token-mean,
    # has the gradient 2 tau / (n_tokens max(1, tau)) times the group-mean-baseline policy gradient
    # -sum_i (r_i - mean of its group) grad log pi(y_i), whatever the behaviour policy
    lp, behaviour, _, mask = rand_inputs(8, B=5)
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.5, 0.9])
    index = torch.tensor([0, 0, 0, 1, 1])  # a group of 3 and a group of 2
    for tau in (0.3, 2.5):
        lp.grad = None
        out = OPMD.opmd_pairwise_loss(
            inputs(lp, behaviour, torch.zeros(5, 5), mask, rewards, index), tau=tau
        )
        n_tokens = mask.sum()
        L.aggregate(
            out["loss"],
            mask,
            components.policy_losses()["opmd_pairwise"].agg,
            n_tokens,
            len(rewards),
        ).backward()
        group_mean = torch.tensor([1 / 3] * 3 + [0.7] * 2)
        expect = -(2 * tau / (n_tokens * max(1.0, tau))) * (rewards - group_mean)[:, None] * mask
        assert torch.allclose(lp.grad, expect, atol=1e-6)


def test_sft_and_dpo_reference():
    lp, _, _, mask = rand_inputs(9, B=4)
    out = EP.sft_loss(inputs(lp, lp.detach(), torch.zeros(4, 5), mask))
    assert torch.equal(out["loss"], -lp)
    ref = lp.detach() - 0.5
    rewards = torch.tensor(
        [1.0, 0.0, 0.0, 0.0]
    )  # group 0: pair (0 chosen, 1 rejected); group 1: no gap
    index = torch.tensor([0, 0, 1, 1])
    dpo = EP.dpo_loss(
        inputs(lp, lp.detach(), torch.zeros(4, 5), mask, rewards, index, ref), beta=0.2
    )
    margin = 0.2 * ((seq_logratio(lp, ref, mask, 0)) - seq_logratio(lp, ref, mask, 1))
    pair = -math.log(1 / (1 + math.exp(-margin)))
    sums = (dpo["loss"] * mask).sum(-1).tolist()
    assert sums == pytest.approx([pair, pair, 0.0, 0.0], abs=1e-5)
    with pytest.raises(ValueError, match="ref_logprobs"):
        EP.dpo_loss(inputs(lp, lp.detach(), torch.zeros(4, 5), mask, rewards, index))
    # a micro-batch without a pair (no reward gap) still has a loss in the graph: every FSDP2 rank must run backward
    flat = EP.dpo_loss(
        inputs(lp, lp.detach(), torch.zeros(4, 5), mask, torch.zeros(4), index, ref)
    )["loss"]
    assert flat.requires_grad and float((flat * mask).sum()) == 0.0


def test_mix_weights_expert_sft_and_rollout_ppo():
    lp, behaviour, adv, mask = rand_inputs(10)
    expert = torch.tensor([True, False, False, True])
    out = EP.mix_loss(inputs(lp, behaviour, adv, mask, expert=expert), mu=0.25)
    ppo = L.ppo_clip_loss(
        inputs(lp, behaviour, adv, mask), clip_low=0.2, clip_high=0.2, dual_clip=3.0
    )["loss"]
    assert torch.allclose(out["loss"][0], -0.25 * lp[0]) and torch.allclose(
        out["loss"][1], 0.75 * ppo[1]
    )
    assert out["expert"][:, 0].tolist() == [1.0, 0.0, 0.0, 1.0]


def test_entropy_reference():
    logits = torch.randn(2, 3, 7)
    p = torch.softmax(logits, -1)
    assert torch.allclose(token_entropy(logits), -(p * p.log()).sum(-1), atol=1e-5)


def test_filters():
    assert not EF.zero_advantage_filter([1, 2], [-0.1], 0.0) and EF.zero_advantage_filter(
        [1, 2], [-0.1], -0.5
    )
    assert not EF.gibberish_filter([1, 2, 3], [-9.0, -8.0], 1.0) and EF.gibberish_filter(
        [1, 2, 3], [-1.0, -2.0], 1.0
    )
    loop = [7, 8] * 10
    assert not EF.repetition_filter(
        [1] + loop, [0.0] * len(loop), 1.0, ngram=2, max_repeat_frac=0.5
    )
    assert EF.repetition_filter(
        [1] + list(range(20)), [0.0] * 20, 1.0, ngram=2, max_repeat_frac=0.5
    )


def test_resolve_plugins_and_errors():
    assert L.resolve_loss("ppo_clip", {"dual_clip": 3.0}).fn is L.ppo_clip_loss
    plugin = L.resolve_loss("extras.policy_losses.dpo_loss")  # by path: a plain function's defaults
    assert plugin.fn is EP.dpo_loss and not plugin.needs_ref and plugin.agg == "token-mean"
    declared = L.resolve_loss("tests.plugins.PAIRWISE")  # by path: a PolicyLoss with its needs
    assert declared.fn is EP.dpo_loss and declared.needs_groups and declared.needs_ref
    with pytest.raises(ValueError, match="unknown policy_loss 'nope'"):
        L.resolve_loss("nope")
    with pytest.raises(ValueError, match="cannot be imported"):
        L.resolve_loss("no_such_module.fn")
    with pytest.raises(ValueError, match=r"takes no argument\(s\) \['clip'\]"):
        L.resolve_loss("ppo_clip", {"clip": 0.1})


def test_the_core_registries_are_the_cores_and_the_root_imports_extras_for_their_names_only():
    import subprocess
    import sys

    from conftest import ROOT, subprocess_env

    assert L.ADVANTAGES == {"grpo": L.grpo_advantages} and L.FILTERS == {}
    assert L.POLICY_LOSSES == {"ppo_clip": L.PolicyLoss(L.ppo_clip_loss)}
    code = (
        "import sys, components, config\n"
        "def extras(): return sorted(m for m in sys.modules if m.split('.')[0] == 'extras')\n"
        "a = components.algorithm(config.Config())\n"
        "assert (a.advantage, a.loss.fn) == (components.losses.grpo_advantages,\n"
        "    components.losses.ppo_clip_loss)\n"
        "print(extras())\n"
        "components.algorithm(config.Config(policy_loss='cispo'))\n"
        "print(extras())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=subprocess_env(), capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-2000:]
    default, cispo = out.stdout.strip().splitlines()
    assert default == "[]" and "extras.policy_losses" in cispo


def test_expert_data_goes_with_a_loss_that_aggregates_it_apart():
    from config import Config

    with pytest.raises(ValueError, match="policy_loss mix and expert_fraction > 0 go together"):
        components.check_trainer(Config(policy_loss="mix"))
    with pytest.raises(ValueError, match="needs a policy loss that aggregates expert tokens apart"):
        components.check_trainer(Config(expert_fraction=0.5))
    with pytest.raises(ValueError, match="compares the rollouts of a group"):
        components.check_trainer(Config(advantage="rloo", group_size=1))


def test_every_estimator_and_filter_takes_its_contracts_arguments():
    # the trainer passes every estimator and filter the same positional arguments (losses.py)
    every = ((components.advantages(), L.ADVANTAGE_ARGS), (components.filters(), L.FILTER_ARGS))
    for registry, takes in every:
        for name in registry:
            L.resolve(name, registry, name, {}, takes)
    old = "tests.plugins.rewards_only_advantages"  # (rewards, group_index): a plug-in of another contract
    with pytest.raises(ValueError, match=r"takes \(rewards, group_index\); losses.py's contract"):
        L.resolve(old, L.ADVANTAGES, "advantage", {}, L.ADVANTAGE_ARGS)
    with pytest.raises(ValueError, match=r"\['token_counts'\] are given by the trainer"):
        L.resolve(
            "reinforce_pp",
            components.advantages("reinforce_pp"),
            "advantage",
            {"token_counts": 1},
            L.ADVANTAGE_ARGS,
        )


# ----------------------------------------------------------------------------- one step moves the right way


def one_step(loss: L.PolicyLoss, name):
    """One SGD step on free logits [B, T, V] (the parameters) with `loss` (registered as
    `name`) aggregated as the trainer does, on-policy, on a batch of 4 sequences: rewards 1, 1,
    0, 0 in groups {0, 2} and {1, 3}, so sequences 0 and 1 have A > 0 (and are DPO's chosen
    ones), 2 and 3 A < 0; for MIX sequence 1 is expert data. Token (1, 2) is padding.
    Returns the change of every token's log-prob [B, T] and the mask."""
    g = torch.Generator().manual_seed(0)
    B, T, V = 4, 3, 6
    logits = torch.randn(B, T, V, generator=g).requires_grad_()
    tokens = torch.randint(V, (B, T), generator=g)
    mask = torch.ones(B, T)
    mask[1, 2] = 0
    rewards, index = torch.tensor([1.0, 1.0, 0.0, 0.0]), torch.tensor([0, 1, 0, 1])
    expert = torch.tensor([False, True, False, False])
    advantage = {
        "opmd_kimi": lambda r, i: OPMD.opmd_advantages(r, i, baseline="logavgexp"),
        "opmd_simple": OPMD.opmd_advantages,
    }.get(name, L.grpo_advantages)
    adv = advantage(rewards, index)[:, None].expand(B, T)

    def logprobs(z):
        return torch.log_softmax(z, -1).gather(-1, tokens[..., None]).squeeze(-1)  # [B, T]

    lp = logprobs(logits)
    out = loss.fn(L.LossInputs(lp, lp.detach(), adv, mask, rewards, index, lp.detach(), expert))
    totals = (
        L.part_totals(mask.sum(-1), expert, torch.ones(B, dtype=torch.bool))
        if loss.split_expert
        else (mask.sum(), B)
    )
    L.aggregate(out["loss"], mask, loss.agg, *totals).backward()
    with torch.no_grad():
        return logprobs(logits - 0.5 * logits.grad) - lp, mask


def moves_as_intended(loss: L.PolicyLoss, name):
    delta, mask = one_step(loss, name)
    on = mask > 0
    if delta[~on].abs().max() != 0:  # padding never moves
        return False
    if name == "sft":  # imitation: every token up
        return bool((delta[on] > 0).all())
    if name == "dpo":  # the chosen sequences gain log-prob relative to the rejected ones
        seq = (delta * mask).sum(-1)
        return bool(seq[0] - seq[2] > 0 and seq[1] - seq[3] > 0)
    return bool((delta[:2][on[:2]] > 0).all() and (delta[2:][on[2:]] < 0).all())


def flipped(loss: L.PolicyLoss) -> L.PolicyLoss:
    """`loss` with its sign flipped (the same needs)."""

    def neg(inp, **kw):
        out = loss.fn(inp, **kw)
        return {**out, "loss": -out["loss"]}

    return dataclasses.replace(loss, fn=neg)


@pytest.mark.parametrize("name", sorted(components.policy_losses()))
def test_one_step_raises_positive_and_lowers_negative_sequences(name):
    loss = loss_named(name)
    assert moves_as_intended(loss, name)
    assert not moves_as_intended(flipped(loss), name)


def test_pass_at_k_is_the_unbiased_estimator():
    from metrics import pass_at_k

    # Chen et al. 2021, eq. 1, worked by hand: 1 - C(n - c, k) / C(n, k)
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - 21 / 252)
    assert (
        pass_at_k(10, 3, 1) == pytest.approx(0.3)
        and pass_at_k(4, 0, 2) == 0.0
        and pass_at_k(4, 3, 2) == 1.0
    )


def test_avg_at_k_stderr_and_pass_at_k_by_hand():
    from metrics import eval_line, mean_stderr, sampled_eval

    # 4 tasks, 4 samples each, 0 / 1 / 4 / 2 right: per-task means 0, .25, 1, .5
    r = sampled_eval([0, 1, 4, 2], 4, 4)
    assert (
        r["eval/avg_at_k"] == pytest.approx(0.4375) and r["eval/samples"] == 4 and r["eval/k"] == 4
    )
    # squared deviations .19140625 + .03515625 + .31640625 + .00390625 = .546875; / (4 - 1) / 4, square root
    assert r["eval/avg_at_k_stderr"] == pytest.approx((0.546875 / 3 / 4) ** 0.5)
    # pass@2 per task: 0, 1 - C(3,2)/C(4,2) = .5, 1, 1 - C(2,2)/C(4,2) = 5/6
    assert r["eval/pass_at_2"] == pytest.approx((0 + 0.5 + 1 + 5 / 6) / 4)
    assert r["eval/pass_at_1"] == pytest.approx(r["eval/avg_at_k"]) and r[
        "eval/pass_at_4"
    ] == pytest.approx(0.75)
    # 6 samples (version 0: the group size) for avg@4: pass@J for J = 1, 2, 4 and 6
    r = sampled_eval([1, 2, 3], 6, 4)
    assert sorted(k for k in r if k.startswith("eval/pass_at_")) == [
        f"eval/pass_at_{j}" for j in (1, 2, 4, 6)
    ]
    assert r["eval/pass_at_4"] == pytest.approx(
        (1 - 5 / 15 + 1 - 1 / 15 + 1) / 3
    )  # C(5,4)=5, C(4,4)=1, C(6,4)=15
    assert r["eval/pass_at_6"] == 1.0
    assert mean_stderr([0.5]) == (0.5, 0.0)
    with pytest.raises(ValueError):
        sampled_eval([1], 2, 4)
    line = eval_line(
        {"eval/accuracy": 0.25, "eval/accuracy_stderr": 0.03, **r, "eval/format_rate": 0.9}
    )
    assert line == (
        "held-out accuracy 0.250 +- 0.030 (greedy), avg@4 0.333 +- 0.096, format 0.90, pass@6 1.000"
    )


def test_the_learnability_forecast_by_hand_and_without_bias():
    from metrics import eval_line, learnable_groups, sampled_eval

    # groups of 8 from 8 samples: a task with 0 or 8 right never differs, one with 4 right always does
    assert learnable_groups([0, 8, 4], 8, 8) == pytest.approx(1 / 3)
    # 4 samples, 2 right, groups of 2: P(both right) = P(both wrong) = C(2,2) / C(4,2) = 1/6
    assert learnable_groups([2], 4, 2) == pytest.approx(1 - 2 / 6)
    # fewer samples than the group: p = 1/2 plugged in, 1 - 2 / 2^4
    assert learnable_groups([1], 2, 4) == pytest.approx(0.875)
    # unbiased: over c ~ Binomial(10, p) the estimate averages to 1 - p^4 - (1 - p)^4 exactly
    p = 0.3
    mean = sum(
        math.comb(10, c) * p**c * (1 - p) ** (10 - c) * learnable_groups([c], 10, 4)
        for c in range(11)
    )
    assert mean == pytest.approx(1 - p**4 - (1 - p) ** 4, abs=1e-12)
    hard = sampled_eval([0, 0, 0, 1], 8, 4, group_size=8)
    assert hard["eval/learnable_groups"] == pytest.approx(
        0.25
    ) and "eval/learnable_groups" not in sampled_eval([1], 8, 4)
    line = eval_line({"eval/accuracy": 0.0, **hard}, 8)
    assert "learnable groups 25%" in line and "warning" not in line
    hard = sampled_eval([0, 0, 0, 0, 1], 8, 4, group_size=8)
    line = eval_line({"eval/accuracy": 0.0, **hard}, 8)
    assert (
        line.splitlines()[1].startswith("warning: only 20% of groups of 8")
        and "--group-size" in line
    )


def test_format_rate_counts_replies_a_reward_can_read():
    from explorer import format_rate
    from workflows import readable

    assert readable({"response": "5 + 3 = 8", "answer": "8", "finish_reason": "stop"}) is True
    assert (
        readable({"response": "5 + 3 = 8 and then", "answer": "8", "finish_reason": "length"})
        is False
    )
    assert readable({"response": "I cannot say", "answer": "8", "finish_reason": "stop"}) is False
    assert readable({"turns": 2}) is None
    exps = [
        Experience([1, 2], 1, [0.0], [1], 1.0, "g", "t", 0, info)
        for info in (
            {"response": "8", "answer": "8", "finish_reason": "stop"},
            {"response": "eight", "answer": "8", "finish_reason": "stop"},
            {"turns": 2},
        )
    ]
    assert format_rate(exps, "eval/format_rate") == {"eval/format_rate": 0.5}
    assert format_rate(exps[2:], "eval/format_rate") == {}


def test_seeds_summary_and_sweep_table(tmp_path, monkeypatch):
    from conftest import ROOT

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import seeds

    monkeypatch.setattr(seeds, "RESULTS", tmp_path)

    def ev(v, greedy, avg, **more):
        return {
            "step": v,
            "eval/version": v,
            "eval/accuracy": greedy,
            "eval/avg_at_k": avg,
            "eval/avg_at_k_stderr": 0.02,
            "eval/k": 4,
            "eval/samples": 4,
            **more,
        }

    runs = {
        0: [
            ev(0, 0.0, 0.2, **{"eval/samples": 8, "eval/pass_at_8": 0.5}),
            ev(10, 0.3, 0.4),
            {"step": 0, "loss/grad_norm": 1.0, "loss/entropy": 1.5, "batch": 0},
        ],
        1: [ev(0, 0.1, 0.4, **{"eval/samples": 8, "eval/pass_at_8": 0.7}), ev(10, 0.5, 0.6)],
    }
    kept = {s: seeds.keep(r) for s, r in runs.items()}
    assert kept[0][-1] == {
        "step": 0,
        "loss/grad_norm": 1.0,
        "loss/entropy": 1.5,
    }  # a step keeps only STEP_KEYS
    summary = seeds.summarize("base", kept, ["--lr", "1e-5"], {0: 60.0, 1: 120.0})
    v0, v10 = summary["curve"]
    assert v0["avg_at_k"]["mean"] == pytest.approx(0.3) and v0["avg_at_k"]["std"] == pytest.approx(
        0.02**0.5
    )
    assert v0["pass_at_8"]["mean"] == pytest.approx(0.6) and "pass_at_8" not in v10
    assert v10["greedy"] == pytest.approx({"mean": 0.4, "std": 0.02**0.5, "min": 0.3, "max": 0.5})
    (tmp_path / "base.json").write_text(json.dumps(summary))
    for s, recs in kept.items():
        (tmp_path / f"base_s{s}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert seeds.plot(summary, kept, tmp_path / "base.png").stat().st_size > 0
    # a later call with the same flags adds its seeds to these; with other flags it starts afresh
    assert seeds.earlier("base", ["--lr", "1e-5"]) == (kept, {0: 60.0, 1: 120.0})
    assert seeds.earlier("base", ["--lr", "2e-5"]) == ({}, {}) and seeds.earlier("other", []) == (
        {},
        {},
    )
    table = seeds.compare(["base"], "sweep")
    assert (
        "| base | `--lr 1e-5` | 2 | 0.500 +- 0.141 | 0.500 (v10) | 0.400 +- 0.141 | 1.5 |" in table
    )
    assert (tmp_path / "sweep.png").exists() and (
        tmp_path / "sweep.md"
    ).read_text().strip() == table


@pytest.mark.slow
def test_seeds_runs_a_fully_asynchronous_seed_as_two_launches(tiny_model, tmp_path, monkeypatch):
    """seeds.py --fully-async: an explorer and a trainer launched at once into a fresh run
    directory; its records hold every step and the explorer's evaluations, the last version's too."""
    from conftest import ROOT

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import seeds

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "stale.txt").write_text("an earlier seed's file")
    flags = [
        "--config",
        "configs/tiny.toml",
        "--reward-fn",
        "tests.rewards.length_parity",
        "--model",
        tiny_model,
        "--steps",
        "4",
        "--max-staleness",
        "2",
    ]
    wall = seeds.run_job(run_dir, flags, 0, tmp_path / "run.log", fully_async=True)
    assert wall > 0
    assert not (run_dir / "stale.txt").exists()
    assert (run_dir / "config_train.json").exists() and (run_dir / "config_explore.json").exists()
    recs = seeds.records(run_dir / "metrics.jsonl")
    assert [r["step"] for r in recs if "loss/grad_norm" in r] == [0, 1, 2, 3]
    # the last version's evaluation, which the explorer makes after the trainer's last step
    assert [r["eval/version"] for r in recs if "eval/accuracy" in r][-1] == 4
    assert "eval @ version" in (tmp_path / "run.explore.log").read_text()


def test_lr_schedules_are_transformers_and_bad_ones_one_error_line():
    from transformers import get_cosine_schedule_with_warmup

    from run import Config
    from trainer import lr_schedule

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    factor = lr_schedule(Config(lr=1e-3, lr_schedule="cosine", lr_warmup_steps=2, steps=10), opt)
    reference = get_cosine_schedule_with_warmup(
        torch.optim.AdamW(model.parameters(), lr=1e-3), 2, 10
    ).lr_lambdas[0]
    assert [factor(i) for i in range(10)] == [reference(i) for i in range(10)]
    assert factor(1) == 0.5 and factor(6) == pytest.approx(
        0.5 * (1 + math.cos(math.pi * 4 / 8))
    )  # by hand
    assert opt.param_groups[0]["lr"] == 1e-3  # the optimiser keeps cfg.lr until its first step
    # the default: 3 steps of warm-up from 0, then a cosine to a tenth of lr at the last step
    # (by hand)
    n = Config().steps
    default = lr_schedule(Config(), opt)
    assert [default(i) for i in range(4)] == [0.0, 1 / 3, 2 / 3, 1.0]
    cosine = 0.5 * (1 + math.cos(math.pi * (n - 4) / (n - 3)))
    assert default(n - 1) == pytest.approx(0.1 + 0.9 * cosine)
    assert default(n) == pytest.approx(0.1)
    half_floor = lr_schedule(Config(lr_schedule_kwargs={"min_lr_rate": 0.5}), opt)
    assert half_floor(n) == pytest.approx(0.5)
    assert (
        lr_schedule(Config(lr_schedule="constant"), opt)(29) == 1.0
    )  # no floor handed to another schedule
    with pytest.raises(ValueError, match=r"^lr_schedule 'nope' with \{\}: ValueError: "):
        lr_schedule(Config(lr_schedule="nope"), opt)
    with pytest.raises(
        ValueError,
        match=r"^lr_schedule 'cosine_with_min_lr' with \{'floor': 1, 'min_lr_rate': 0.1\}: TypeError",
    ):
        lr_schedule(Config(lr_schedule="cosine_with_min_lr", lr_schedule_kwargs={"floor": 1}), opt)
