"""pi_old of decoupled PPO (extras/old_policy.py): the trainer's own log-probs at each experience's
behaviour version, the loss's ratio anchored there, and the staleness guard."""

import copy

import pytest
import torch
from test_fidelity import exp, make_trainer, own_logprobs  # noqa: F401 (make_trainer: a fixture)


def group(version: int):
    """A group of two rollouts of one prompt, sampled at `version`, rewards 1 and 0."""
    exps = [
        exp([5, 6, 7, 8, 9, 10], 3, [1, 1, 1], 1.0, "g"),
        exp([5, 6, 7, 11, 12], 3, [1, 1], 0.0, "g"),
    ]
    for e in exps:
        e.model_version = version
    return exps


def test_kept_weights_hold_the_bound_plus_one_versions_and_reuse_the_oldest_copy():
    from extras.old_policy import KeptWeights

    params = [torch.zeros(3), torch.zeros(2)]
    kept = KeptWeights(bound=1)
    for v in range(4):
        for p in params:
            p.fill_(v)
        kept.keep(v, params)
    assert sorted(kept.copies) == [2, 3]
    assert kept.versions(3) == {2, 3}
    kept.load(2, params)
    assert all(bool((p == 2).all()) for p in params)
    # a bound of 0 copies nothing: the trainer's own weights are the only version
    none = KeptWeights(bound=0)
    none.keep(0, params)
    assert none.copies == {} and none.versions(5) == {5}


def test_pi_old_is_the_trainers_forward_at_the_behaviour_version(make_trainer):
    """After a step moved the weights, a group sampled at version 0 gets as pi_old the
    trainer's log-probs under version 0's weights, not the current ones."""
    from trainer import StepBatch

    tr = make_trainer("--lr", "1e-2", "--old-logprobs", "recompute", "--sync-interval", "2")
    g0 = group(0)
    at_v0 = own_logprobs(tr, g0)  # [R] each: version 0's log-probs (also its behaviour ones)
    tr.step([copy.deepcopy(g0)])
    assert tr.version == 1
    now = own_logprobs(tr, copy.deepcopy(g0))
    moved = max(abs(a - b) for x, y in zip(at_v0, now) for a, b in zip(x, y))
    assert moved > 1e-3, "the step did not move the weights: the test would prove nothing"
    batch = StepBatch.of([g0])
    old, unkept = tr.old_policy.old_logprobs(batch, [g0], g0[0])
    assert unkept == set()
    for i, want in enumerate(at_v0):
        assert torch.allclose(old[i], torch.tensor(want), atol=1e-5), (old[i], want)
    # the trainer's own weights are back
    assert own_logprobs(tr, copy.deepcopy(g0)) == now


def test_a_version_no_longer_kept_falls_back_on_the_behaviour_logprobs(make_trainer):
    tr = make_trainer("--old-logprobs", "recompute", "--sync-interval", "1")
    tr.version = 5  # a resumed run: version 3's weights were never kept
    g = group(3)
    own_logprobs(tr, g)
    m = tr.step([g])
    assert m["old_logprobs/unkept"] == 1.0


def test_on_policy_the_ratio_to_pi_old_is_one(make_trainer):
    """Staleness 0 in float32: pi_old is the current forward, so every importance ratio of the
    loss is 1 and PPO clips nothing, whatever the behaviour log-probs say."""
    tr = make_trainer("--old-logprobs", "recompute", "--sync-interval", "1")
    g = group(0)
    own_logprobs(tr, g)
    for e in g:  # behaviour log-probs far from the trainer's: outside PPO's clip range
        e.behaviour_logprobs = [x - 1.0 for x in e.behaviour_logprobs]
    m = tr.step([g])
    assert m["loss/clipped"] == 0.0
    plain = make_trainer("--sync-interval", "1")
    assert plain.step([copy.deepcopy(g)])["loss/clipped"] > 0.5


def test_the_loss_ratio_is_anchored_at_pi_old_when_given():
    from losses import LossInputs, importance_ratio

    lp = torch.tensor([[-1.0, -2.0]])
    inp = LossInputs(
        lp,
        lp - 0.5,
        torch.ones(1, 2),
        torch.ones(1, 2),
        torch.ones(1),
        torch.zeros(1, dtype=torch.long),
    )
    assert torch.allclose(importance_ratio(inp), torch.full((1, 2), 0.5).exp())
    inp.old_logprobs = lp - 0.25
    assert torch.allclose(importance_ratio(inp), torch.full((1, 2), 0.25).exp())


@pytest.mark.parametrize(
    "flags,warns",
    [
        (["--policy-loss", "importance_sampling", "--sync-interval", "3"], True),
        (
            ["--policy-loss", "importance_sampling", "--sync-interval", "2", "--sync-offset", "1"],
            True,
        ),
        (["--policy-loss", "importance_sampling", "--sync-interval", "2"], False),
        (["--policy-loss", "ppo_clip", "--sync-interval", "3"], False),
        (
            [
                "--policy-loss",
                "importance_sampling",
                "--sync-interval",
                "3",
                "--old-logprobs",
                "recompute",
                "--rollout-correction",
                "tis-token",
            ],
            False,
        ),
    ],
)
def test_the_staleness_guard_warns_for_a_loss_without_trust_region_on_stale_data(
    flags, warns, capsys
):
    import components
    import run

    cfg = run.parse_config(["--config", "configs/tiny.toml", *flags])
    if (
        "tis-token" in flags
        and "tis-token" not in __import__("extras.corrections").corrections.CORRECTIONS
    ):
        pytest.skip("the rollout corrections are not in corrections.py")
    components.check_trainer(cfg)
    err = capsys.readouterr()
    line = [x for x in (err.out + err.err).splitlines() if "no trust region" in x]
    assert bool(line) == warns, line
    if warns:
        assert "importance_sampling" in line[0] and "versions old" in line[0]


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--rollout-correction", "tis-token"], "needs --old-logprobs recompute"),
        (["--rollout-correction", "nope", "--old-logprobs", "recompute"], "nope"),
        (["--rollout-correction-kwargs", '{"cap": 2}'], "takes low and high"),
    ],
)
def test_bad_correction_settings_are_one_error_line(flags, message):
    import components
    import run

    cfg = run.parse_config(["--config", "configs/tiny.toml", *flags])
    with pytest.raises(ValueError, match=message) as e:
        components.check_trainer(cfg)
    assert "\n" not in str(e.value)


def shifted(tr, shift: float):
    """A group sampled at the trainer's version, its behaviour log-probs the trainer's own plus
    `shift` (rho = pi_old / pi_behaviour = exp(-shift) on every token)."""
    g = group(tr.version)
    own_logprobs(tr, g)
    for e in g:
        e.behaviour_logprobs = [x + shift for x in e.behaviour_logprobs]
    return g


def test_a_correction_weighs_each_tokens_loss_and_masks_it_out_of_the_step(make_trainer):
    flags = ["--old-logprobs", "recompute", "--sync-interval", "1"]
    plain = make_trainer(*flags).step([shifted(make_trainer(*flags), -2.0)])
    # rho = e^2 > the cap 2: every token's loss weighs 2
    tis = make_trainer(*flags, "--rollout-correction", "tis-token")
    capped = tis.step([shifted(tis, -2.0)])
    assert capped["correction/capped"] == 1.0 and capped["correction/weight_max"] == 2.0
    assert capped["loss/policy"] == pytest.approx(2 * plain["loss/policy"], rel=1e-5)
    assert capped["loss/grad_norm"] == pytest.approx(2 * plain["loss/grad_norm"], rel=1e-4)
    # rho = e^-3 outside IcePop's band [0.5, 5]: every token masked, nothing trained
    ice = make_trainer(*flags, "--rollout-correction", "icepop")
    masked = ice.step([shifted(ice, 3.0)])
    assert masked["correction/masked"] == 1.0
    assert masked["loss/grad_norm"] == 0.0 and plain["loss/grad_norm"] > 0


def test_masked_tokens_leave_the_token_mean_denominator(make_trainer):
    """verl's rejection mask multiplies the response mask before the loss is aggregated: a
    token-mean over the kept tokens only."""
    flags = ["--old-logprobs", "recompute", "--sync-interval", "1", "--loss-agg", "token-mean"]
    tr = make_trainer(*flags, "--rollout-correction", "mis-token")
    g = shifted(tr, 0.0)
    g[1].behaviour_logprobs = [x + 3.0 for x in g[1].behaviour_logprobs]  # rho e^-3: masked
    m = tr.step([g])
    assert m["correction/masked"] == pytest.approx(2 / 5)
    # the ratio is 1 on-policy: the loss is -A of the first sequence over its own 3 tokens (over
    # all 5 trained tokens it would be 3/5 of that)
    from losses import grpo_advantages

    adv = grpo_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]))
    assert m["loss/policy"] == pytest.approx(-float(adv[0]), rel=1e-5)
