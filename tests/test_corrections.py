"""extras/corrections.py, the rollout corrections, against numbers produced by their references.

CORRECTIONS_REF below was computed (in float64) by tests/fidelity_reference.py
(`rollout_corrections`), which re-implements volcengine/verl's rollout_corr_helper.py
compute_rollout_correction_and_rejection_mask @ b178a3c (with the presets of
verl/trainer/config/algorithm.py) and OpenRLHF's IcePop coefficient (openrlhf/models/loss.py
PolicyLoss.forward @ 3c3be62) line by line, on the fixed inputs CORR_OLD, CORR_BEHAVIOUR, CORR_MASK
it holds (imported here); `test_goldens_come_from_the_reference_script` recomputes them. Compared
on the trained tokens (the references zero the others; extras/corrections.py leaves them at 1).
"""

import math

import fidelity_reference
import pytest
import torch
from fidelity_reference import CORR_BEHAVIOUR, CORR_CASES, CORR_MASK, CORR_OLD
from test_fidelity import _same, close

from extras import corrections as C

# (kind, low, high) -> (weights, kept) [B, T] on the trained tokens (0 elsewhere), low / high None:
# the source's default. verl @ b178a3c compute_rollout_correction_and_rejection_mask: tis-token
# decoupled_token_is, tis-seq decoupled_seq_is, mis-token rollout_is "token" + rollout_rs
# "token_k1", mis-seq decoupled_seq_is_rs, geo-mask decoupled_geo_rs (weights: 1), the case's band
# (low, high) on rho as the k1 threshold f"{1 / high}_{1 / low}"; icepop: OpenRLHF @ 3c3be62
# PolicyLoss.forward's vllm_is (is_correction_threshold [0.5, 5.0] by default) and its band mask
CORRECTIONS_REF = {
    ("tis-token", None, None): (
        [
            [1.0004001, 0.99940018, 1.0002, 0, 0],
            [1.3498588, 2, 0.44932896, 2, 1.1051709],
            [0.67032005, 0.60653066, 0.81873075, 0, 0],
            [1.2214028, 0.90483742, 1.3498588, 1.1051709, 0.81873075],
            [0, 0, 0, 0, 0],
            [2, 2.0611536e-09, 1.1051709, 0, 0],
        ],
        [
            [1, 1, 1, 0, 0],
            [1, 1, 1, 1, 1],
            [1, 1, 1, 0, 0],
            [1, 1, 1, 1, 1],
            [0, 0, 0, 0, 0],
            [1, 1, 1, 0, 0],
        ],
    ),
    ("tis-token", None, 1.2): (
        [
            [1.0004001, 0.99940018, 1.0002, 0, 0],
            [1.2, 1.2, 0.44932896, 1.2, 1.1051709],
            [0.67032005, 0.60653066, 0.81873075, 0, 0],
            [1.2, 0.90483742, 1.2, 1.1051709, 0.81873075],
            [0, 0, 0, 0, 0],
            [1.2, 2.0611536e-09, 1.1051709, 0, 0],
        ],
        [
            [1, 1, 1, 0, 0],
            [1, 1, 1, 1, 1],
            [1, 1, 1, 0, 0],
            [1, 1, 1, 1, 1],
            [0, 0, 0, 0, 0],
            [1, 1, 1, 0, 0],
        ],
    ),
    ("tis-seq", None, None): (
        [
            [1, 1, 1, 0, 0],
            [2, 2, 2, 2, 2],
            [0.33287108, 0.33287108, 0.33287108, 0, 0],
            [1.3498588, 1.3498588, 1.3498588, 1.3498588, 1.3498588],
            [0, 0, 0, 0, 0],
            [0.0074465831, 0.0074465831, 0.0074465831, 0, 0],
        ],
        [
            [1, 1, 1, 0, 0],
            [1, 1, 1, 1, 1],
            [1, 1, 1, 0, 0],
            [1, 1, 1, 1, 1],
            [0, 0, 0, 0, 0],
            [1, 1, 1, 0, 0],
        ],
    ),
    ("tis-seq", None, 12): (
        [
            [1, 1, 1, 0, 0],
            [9.9741825, 9.9741825, 9.9741825, 9.9741825, 9.9741825],
            [0.33287108, 0.33287108, 0.33287108, 0, 0],
            [1.3498588, 1.3498588, 1.3498588, 1.3498588, 1.3498588],
            [0, 0, 0, 0, 0],
            [0.0074465831, 0.0074465831, 0.0074465831, 0, 0],
        ],
        [
            [1, 1, 1, 0, 0],
            [1, 1, 1, 1, 1],
            [1, 1, 1, 0, 0],
            [1, 1, 1, 1, 1],
            [0, 0, 0, 0, 0],
            [1, 1, 1, 0, 0],
        ],
    ),
    ("mis-token", None, None): (
        [
            [1.0004001, 0.99940018, 1.0002, 0, 0],
            [1.3498588, 2, 0.44932896, 2, 1.1051709],
            [0.67032005, 0.60653066, 0.81873075, 0, 0],
            [1.2214028, 0.90483742, 1.3498588, 1.1051709, 0.81873075],
            [0, 0, 0, 0, 0],
            [2, 2.0611536e-09, 1.1051709, 0, 0],
        ],
        [
            [1, 1, 1, 0, 0],
            [1, 0, 0, 0, 1],
            [1, 1, 1, 0, 0],
            [1, 1, 1, 1, 1],
            [0, 0, 0, 0, 0],
            [0, 0, 1, 0, 0],
        ],
    ),
    ("mis-token", 0.6, 3): (
        [
            [1.0004001, 0.99940018, 1.0002, 0, 0],
            [1.3498588, 2.4596031, 0.44932896, 3, 1.1051709],
            [0.67032005, 0.60653066, 0.81873075, 0, 0],
            [1.2214028, 0.90483742, 1.3498588, 1.1051709, 0.81873075],
            [0, 0, 0, 0, 0],
            [3, 2.0611536e-09, 1.1051709, 0, 0],
        ],
        [
            [1, 1, 1, 0, 0],
            [1, 1, 0, 0, 1],
            [1, 1, 1, 0, 0],
            [1, 1, 1, 1, 1],
            [0, 0, 0, 0, 0],
            [0, 0, 1, 0, 0],
        ],
    ),
    ("mis-seq", None, None): (
        [
            [1, 1, 1, 0, 0],
            [2, 2, 2, 2, 2],
            [0.33287108, 0.33287108, 0.33287108, 0, 0],
            [1.3498588, 1.3498588, 1.3498588, 1.3498588, 1.3498588],
            [0, 0, 0, 0, 0],
            [0.0074465831, 0.0074465831, 0.0074465831, 0, 0],
        ],
        [
            [1, 1, 1, 0, 0],
            [0, 0, 0, 0, 0],
            [0, 0, 0, 0, 0],
            [1, 1, 1, 1, 1],
            [0, 0, 0, 0, 0],
            [1, 1, 1, 0, 0],
        ],
    ),
    ("mis-seq", 0.3, 1.2): (
        [
            [1, 1, 1, 0, 0],
            [1.2, 1.2, 1.2, 1.2, 1.2],
            [0.33287108, 0.33287108, 0.33287108, 0, 0],
            [1.2, 1.2, 1.2, 1.2, 1.2],
            [0, 0, 0, 0, 0],
            [0.0074465831, 0.0074465831, 0.0074465831, 0, 0],
        ],
        [
            [1, 1, 1, 0, 0],
            [0, 0, 0, 0, 0],
            [1, 1, 1, 0, 0],
            [0, 0, 0, 0, 0],
            [0, 0, 0, 0, 0],
            [1, 1, 1, 0, 0],
        ],
    ),
    ("geo-mask", None, None): (
        [
            [1, 1, 1, 0, 0],
            [1, 1, 1, 1, 1],
            [1, 1, 1, 0, 0],
            [1, 1, 1, 1, 1],
            [0, 0, 0, 0, 0],
            [1, 1, 1, 0, 0],
        ],
        [
            [1, 1, 1, 0, 0],
            [0, 0, 0, 0, 0],
            [0, 0, 0, 0, 0],
            [0, 0, 0, 0, 0],
            [0, 0, 0, 0, 0],
            [0, 0, 0, 0, 0],
        ],
    ),
    ("geo-mask", 0.9, 1.1): (
        [
            [1, 1, 1, 0, 0],
            [1, 1, 1, 1, 1],
            [1, 1, 1, 0, 0],
            [1, 1, 1, 1, 1],
            [0, 0, 0, 0, 0],
            [1, 1, 1, 0, 0],
        ],
        [
            [1, 1, 1, 0, 0],
            [0, 0, 0, 0, 0],
            [0, 0, 0, 0, 0],
            [1, 1, 1, 1, 1],
            [0, 0, 0, 0, 0],
            [1, 1, 1, 0, 0],
        ],
    ),
    ("icepop", None, None): (
        [
            [1.0004001, 0.99940018, 1.0002, 0, 0],
            [1.3498588, 2.4596031, 0, 0, 1.1051709],
            [0.67032005, 0.60653066, 0.81873075, 0, 0],
            [1.2214028, 0.90483742, 1.3498588, 1.1051709, 0.81873075],
            [0, 0, 0, 0, 0],
            [0, 0, 1.1051709, 0, 0],
        ],
        [
            [1, 1, 1, 0, 0],
            [1, 1, 0, 0, 1],
            [1, 1, 1, 0, 0],
            [1, 1, 1, 1, 1],
            [0, 0, 0, 0, 0],
            [0, 0, 1, 0, 0],
        ],
    ),
    ("icepop", 0.65, 2): (
        [
            [1.0004001, 0.99940018, 1.0002, 0, 0],
            [1.3498588, 0, 0, 0, 1.1051709],
            [0.67032005, 0, 0.81873075, 0, 0],
            [1.2214028, 0.90483742, 1.3498588, 1.1051709, 0.81873075],
            [0, 0, 0, 0, 0],
            [0, 0, 1.1051709, 0, 0],
        ],
        [
            [1, 1, 1, 0, 0],
            [1, 0, 0, 0, 1],
            [1, 0, 1, 0, 0],
            [1, 1, 1, 1, 1],
            [0, 0, 0, 0, 0],
            [0, 0, 1, 0, 0],
        ],
    ),
}


def inputs(dtype=torch.float32):
    """The fixed batch: (old, behaviour, mask) [6, 5]."""
    return (
        torch.tensor(CORR_OLD, dtype=dtype),
        torch.tensor(CORR_BEHAVIOUR, dtype=dtype),
        torch.tensor(CORR_MASK, dtype=dtype),
    )


@pytest.mark.parametrize("case", CORR_CASES)
def test_each_kind_is_its_reference(case):
    kind, low, high = case
    old, behaviour, mask = inputs()
    weight, keep, terms = C.correction_weights(old, behaviour, mask, kind, low, high)
    want_weight, want_keep = CORRECTIONS_REF[case]
    assert close(weight * mask, want_weight) and close(keep * mask, want_keep)
    # off the trained tokens: neither weighed nor dropped
    assert (weight[mask == 0] == 1).all() and (keep[mask == 0] == 1).all()
    assert weight.dtype == keep.dtype == torch.float32 and not weight.requires_grad
    # the terms: per token [B, T], and the extremes over the trained tokens (0-dim)
    trained = mask.bool()
    assert close(terms["correction/weight"] * mask, want_weight)
    assert close(terms["correction/masked"] * mask, (mask - torch.tensor(want_keep)).tolist())
    weights = torch.tensor(want_weight)[trained]
    assert terms["correction/weight_max"].dim() == terms["correction/weight_min"].dim() == 0
    assert close(terms["correction/weight_max"], float(weights.max()))
    assert close(terms["correction/weight_min"], float(weights.min()))
    # capped: kept tokens whose weight is the cap (no ratio of the batch equals a cap)
    cap = C.check_correction(kind, low, high)[1]
    want_capped = torch.zeros_like(mask)
    if kind[:3] in ("tis", "mis"):
        want_capped = (torch.tensor(want_weight) == cap) & (torch.tensor(want_keep) == 1)
    assert close(terms["correction/capped"] * mask, want_capped.float().tolist())


def test_float64_inputs_are_computed_in_float64():
    # against the reference script's unrounded float64 numbers
    ref = fidelity_reference.compute(fidelity_reference.CORRECTION_PARTS)["CORRECTIONS_REF"]
    old, behaviour, mask = inputs(torch.float64)
    for case in CORR_CASES:
        weight, keep, _ = C.correction_weights(old, behaviour, mask, *case)
        assert weight.dtype == keep.dtype == torch.float64
        assert close(weight * mask, ref[case][0], tol=1e-12), case
        assert close(keep * mask, ref[case][1], tol=0), case


def test_defaults_are_the_sources():
    # verl's presets (rollout_is_threshold 2.0, "0.5_2.0", "0.999_1.001"), IcePop's alpha, beta
    assert C.DEFAULT_BOUNDS == {
        "none": (None, None),
        "tis-token": (None, 2.0),
        "tis-seq": (None, 2.0),
        "mis-token": (0.5, 2.0),
        "mis-seq": (0.5, 2.0),
        "geo-mask": (0.999, 1.001),
        "icepop": (0.5, 5.0),
    }
    assert set(C.DEFAULT_BOUNDS) == set(C.CORRECTIONS)
    assert fidelity_reference.OPENRLHF_IS_CORRECTION_THRESHOLD == list(C.DEFAULT_BOUNDS["icepop"])
    for kind in C.CORRECTIONS:
        assert C.check_correction(kind) == C.DEFAULT_BOUNDS[kind]
    assert C.check_correction("icepop", high=3.0) == (0.5, 3.0)
    assert C.check_correction("mis-seq", low=0.25) == (0.25, 2.0)


def test_none_and_on_policy_batches_change_nothing():
    old, behaviour, mask = inputs()
    weight, keep, terms = C.correction_weights(old, behaviour, mask, "none")
    assert (weight == 1).all() and (keep == 1).all()
    assert (terms["correction/capped"] == 0).all() and (terms["correction/masked"] == 0).all()
    assert terms["correction/weight_max"] == terms["correction/weight_min"] == 1
    # ratios of 1 lie inside every kind's default bounds
    for kind in C.CORRECTIONS:
        weight, keep, _ = C.correction_weights(old, old.clone(), mask, kind)
        assert (weight == 1).all() and (keep == 1).all(), kind


def test_bounds_around_every_ratio_keep_everything():
    old, behaviour, mask = inputs()
    ratio = torch.exp((old - behaviour).clamp(-20, 20))  # [B, T]
    for kind in ("mis-token", "mis-seq", "geo-mask", "icepop"):
        weight, keep, terms = C.correction_weights(old, behaviour, mask, kind, 1e-12, 1e12)
        assert (keep == 1).all() and (terms["correction/masked"] == 0).all(), kind
        if kind == "geo-mask":
            assert (weight == 1).all()
        if kind in ("mis-token", "icepop"):  # weighed by the plain ratio, uncapped
            assert close(weight * mask, (ratio * mask).tolist(), tol=1e-5)
    weight, keep, terms = C.correction_weights(old, behaviour, mask, "tis-token", high=1e12)
    assert close(weight * mask, (ratio * mask).tolist(), tol=1e-5)
    assert (terms["correction/capped"] == 0).all() and (keep == 1).all()


@pytest.mark.parametrize("kind", [k for k in C.CORRECTIONS if k != "none"])
def test_each_kind_changes_the_batch_at_its_defaults(kind):
    # the fixed batch has ratios past every default bound: each kind weighs or drops something
    old, behaviour, mask = inputs()
    weight, keep, terms = C.correction_weights(old, behaviour, mask, kind)
    ratio = torch.exp((old - behaviour).clamp(-20, 20))
    trained = mask.bool()
    if kind.startswith("tis"):
        assert (weight[trained] == 2.0).any() and terms["correction/capped"][trained].any()
        assert not torch.allclose(weight[trained], ratio[trained])
    else:
        assert (keep[trained] == 0).any() and terms["correction/masked"][trained].any()
        assert (keep[trained] == 1).any()


def test_extreme_log_ratios_stay_finite():
    # OpenRLHF exponentiates the raw log-ratio: past 88 it is inf in float32, and inf * 0 is NaN
    old = torch.tensor([[0.0, -200.0, -1.0, 0.0]])
    behaviour = torch.tensor([[-150.0, 0.0, -1.0, -500.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    for kind in C.CORRECTIONS:
        weight, keep, terms = C.correction_weights(old, behaviour, mask, kind)
        assert torch.isfinite(weight).all() and torch.isfinite(keep).all(), kind
        assert all(torch.isfinite(v).all() for v in terms.values()), kind


def test_no_trained_token_gives_identities_for_the_extremes():
    old, behaviour, mask = inputs()
    _, _, terms = C.correction_weights(old[4:5], behaviour[4:5], mask[4:5], "tis-token")
    assert terms["correction/weight_max"] == -math.inf
    assert terms["correction/weight_min"] == math.inf


def test_no_gradient_reaches_the_log_probs():
    old, behaviour, mask = inputs()
    old.requires_grad_(True)
    for kind in C.CORRECTIONS:
        weight, keep, terms = C.correction_weights(old, behaviour, mask, kind)
        assert not weight.requires_grad and not keep.requires_grad, kind
        assert not any(v.requires_grad for v in terms.values()), kind


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ("tis",),
            "unknown correction 'tis'; known: none, tis-token, tis-seq, mis-token, mis-seq, "
            "geo-mask, icepop",
        ),
        (("none", None, 2.0), "correction 'none' takes no bounds, got low=None, high=2.0"),
        (
            ("tis-token", 0.5, 2.0),
            "correction 'tis-token' caps weights at high only; it takes no low bound",
        ),
        (("tis-seq", None, 0.0), "correction 'tis-seq': high must be > 0, got 0.0"),
        (("tis-token", None, float("nan")), "correction 'tis-token': high must be > 0, got nan"),
        (("icepop", 5.0, 0.5), "correction 'icepop': need 0 < low <= high, got low=5.0, high=0.5"),
        (
            ("mis-seq", 0.0, 2.0),
            "correction 'mis-seq': need 0 < low <= high, got low=0.0, high=2.0",
        ),
        (
            ("geo-mask", 1.01, None),
            "correction 'geo-mask': need 0 < low <= high, got low=1.01, high=1.001",
        ),
        (("mis-token", None, -1.0), "correction 'mis-token': high must be > 0, got -1.0"),
    ],
)
def test_bad_kinds_and_bounds_are_one_line_errors(args, message):
    with pytest.raises(ValueError) as e:
        C.check_correction(*args)
    assert str(e.value) == message and "\n" not in str(e.value)
    old, behaviour, mask = inputs()
    with pytest.raises(ValueError, match="correction"):
        C.correction_weights(old, behaviour, mask, *args)


def test_goldens_come_from_the_reference_script():
    ref = fidelity_reference.compute(fidelity_reference.CORRECTION_PARTS)
    assert set(ref) == {"CORRECTIONS_REF"}
    _same(ref["CORRECTIONS_REF"], CORRECTIONS_REF, "CORRECTIONS_REF")
    assert list(CORRECTIONS_REF) == list(CORR_CASES)
