"""Sampling-mask replay: top-p / top-k rollouts train without bias. The engine records each token's
kept set as a log-prob floor (engines.sample_token), the explorer stores the floors in
info["logprob_floors"], and the trainer renormalises its log-probs over the same kept sets
(packing.HeadLogprobs with floors)."""

import json
import math

import pytest
import torch
from test_logprobs import process_group  # noqa: F401 (an autouse fixture: a Trainer needs one rank)

import run
from buffer import Buffer, Experience
from conftest import one_batch, run_py, tiny_args, tiny_explorer
from engines import Completion, HFEngine, Sampling, sample_token
from packing import chunked_logprobs
from trainer import Trainer

TEMPERATURE = 0.7
# (top_p, top_k): nucleus alone, top-k alone, both (top-k first, then top-p over its renormalised
# mass, as vLLM's sampler)
TRUNCATIONS = [(0.9, 0), (1.0, 20), (0.9, 20)]


@pytest.fixture(scope="module")
def trainer(tiny_model):
    """A float32 trainer at the tiny model's weights (never stepped: the engine's weights)."""
    cfg = run.parse_config(["--config", "configs/tiny.toml", "--temperature", str(TEMPERATURE)])
    assert cfg.dtype == "float32"
    return Trainer(cfg, tiny_model, torch.device("cpu"))


def explored(tiny_model, tmp_path, top_p: float, top_k: int) -> list[Experience]:
    """One explorer batch (2 tasks x 2 rollouts of up to 12 tokens) sampled by the HF engine at
    `top_p`, `top_k`, through the buffer (its JSON) and back."""
    engine = HFEngine(tiny_model, max_batch=8, seed=0)
    settings = dict(batch_size=2, max_tokens=12, temperature=TEMPERATURE, top_p=top_p, top_k=top_k)
    explorer, _ = tiny_explorer(engine, tmp_path, 4, **settings)
    buffer = Buffer(tmp_path / "buffer.sqlite")
    try:
        one_batch(explorer, 0, buffer)
        groups = buffer.read(2, timeout_s=10)
    finally:
        buffer.close()
    return [e for g in groups for e in g]


def naive_logp(model, e: Experience) -> torch.Tensor:
    """Full-softmax log-probs [R, V] at TEMPERATURE of the distributions that sampled `e`'s
    response, from one plain forward."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([e.tokens])).logits[0].float()  # [L, V]
    return torch.log_softmax(logits[e.prompt_length - 1 : -1] / TEMPERATURE, -1)  # [R, V]


@pytest.mark.parametrize("top_p,top_k", TRUNCATIONS)
def test_on_policy_trainer_logprobs_equal_the_behaviour_ones_over_the_kept_sets(
    tiny_model, trainer, tmp_path, top_p, top_k
):
    exps = explored(tiny_model, tmp_path, top_p, top_k)
    assert len(exps) == 4 and sum(len(e.action_mask) for e in exps) > 8
    for e in exps:  # one finite floor per response token, recorded with the sampling settings
        floors = e.info["logprob_floors"]
        assert len(floors) == len(e.behaviour_logprobs) and all(map(math.isfinite, floors))
        assert (e.info["top_p"], e.info["top_k"]) == (top_p, top_k)
    with torch.no_grad():
        b, lp, _ = trainer.logprobs(trainer.model, exps, False)  # the policy's: replayed
        _, full, _ = trainer.logprobs(trainer.model, exps, False, replay=False)
    mask, behaviour = b["mask"], b["behaviour_logprobs"]
    diff = ((lp - behaviour).abs() * mask).max().item()
    assert diff <= 1e-4, diff
    # the control: over the full vocabulary the trainer's log-prob is short of the behaviour's by
    # the log of the kept set's mass, which a plain forward and the floors give independently
    for i, e in enumerate(exps):
        logp = naive_logp(trainer.model, e)  # [R, V]
        floors = torch.tensor(e.info["logprob_floors"])  # [R]
        kept = logp >= floors[:, None]  # [R, V]
        kept_logmass = torch.logsumexp(logp.masked_fill(~kept, float("-inf")), -1)  # [R]
        R = len(e.action_mask)
        gap = behaviour[i, :R] - full[i, :R]  # [R]
        # (a token within float32 noise of a dense nucleus's boundary has a mass of ~2e-5)
        assert torch.allclose(gap, -kept_logmass, atol=1e-4), (gap, kept_logmass)
        if top_k:
            assert (kept.sum(-1) <= top_k).all()
            assert top_p < 1 or (kept.sum(-1) == top_k).all()
        if top_p < 1:  # the smallest top-p prefix of the (renormalised top-k) distribution
            kp = torch.softmax(logp.masked_fill(~kept, float("-inf")), -1)  # [R, V]
            smallest = kp.masked_fill(~kept, 1.0).min(-1).values  # [R]
            if top_k:  # top-p over the top-k's renormalised mass
                topk_lp = logp.topk(top_k, -1).values  # [R, k]
                base = torch.logsumexp(topk_lp, -1)  # [R]
                mass = (kept_logmass - base).exp()  # [R]
            else:
                mass = kept_logmass.exp()
            assert (mass >= top_p - 1e-4).all() and (mass - smallest * mass < top_p + 1e-4).all()
    assert (((behaviour - full) * mask).sum() / mask.sum()).item() > 0.05


def test_no_truncation_records_no_floors(tiny_model, tmp_path):
    exps = explored(tiny_model, tmp_path, 1.0, 0)
    assert all("logprob_floors" not in e.info for e in exps)
    logits = torch.randn(3, 50)
    assert sample_token(logits, Sampling(temperature=1.0))[2] is None
    assert sample_token(logits, Sampling(temperature=0.0, top_p=0.5, top_k=5))[2] is None


def test_a_workflow_without_floors_is_refused_at_its_first_batch(tiny_model, tmp_path, monkeypatch):
    # its experiences would train with the full softmax's log-probs: every ratio off by the mass
    import workflows

    monkeypatch.setattr(workflows, "floors_info", lambda floors: {})
    with pytest.raises(RuntimeError, match="recorded no info\\['logprob_floors'\\] per response"):
        explored(tiny_model, tmp_path, 1.0, 20)


def test_sample_token_keeps_top_k_then_top_p_of_the_renormalised_top_k():
    torch.manual_seed(0)
    logits = torch.randn(64, 30) * 2
    for top_p, top_k in [(0.7, 0), (1.0, 5), (0.7, 5), (1.0, 30), (0.999999, 0)]:
        sampling = Sampling(temperature=0.8, top_p=top_p, top_k=top_k)
        tok, lp, floors = sample_token(logits, sampling, torch.Generator().manual_seed(1))
        logp = torch.log_softmax(logits / 0.8, -1)  # [B, V]
        kept = logp >= floors[:, None]  # [B, V]
        for b in range(logits.shape[0]):  # the rule written out (vLLM's apply_top_k_top_p)
            order = logp[b].argsort(descending=True).tolist()[: top_k or None]
            probs = torch.softmax(logp[b, order], -1).tolist()
            want, mass = set(), 0.0
            for i, p in zip(order, probs):
                if mass >= top_p:
                    break
                want.add(i)
                mass += p
            assert set(kept[b].nonzero().squeeze(1).tolist()) == want
            assert kept[b, tok[b]]
        want_lp = logp.gather(-1, tok[:, None]).squeeze(1) - torch.logsumexp(
            logp.masked_fill(~kept, float("-inf")), -1
        )
        assert torch.allclose(lp, want_lp, atol=1e-6) and torch.isfinite(floors).all()


def naive_head(hidden, weight, bias, targets, temperature, floors):
    """(log-probs [T], entropy [T]) by autograd through a masked log_softmax, in float64."""
    z = (hidden @ weight.T + bias) / temperature  # [T, V]
    logp = torch.log_softmax(z, -1)
    keep = torch.ones_like(z, dtype=torch.bool)
    if floors is not None:
        keep = logp >= floors[:, None]
        keep[torch.arange(len(targets)), targets] = True
    lk = torch.log_softmax(z.masked_fill(~keep, float("-inf")), -1)  # [T, V]
    # (0 x -inf outside the kept set would bring NaN gradients)
    ent = -(lk.exp() * lk.masked_fill(~keep, 0.0)).sum(-1)
    return lk.gather(-1, targets[:, None]).squeeze(-1), ent


@pytest.mark.parametrize("entropy", [False, True])
def test_head_logprobs_gradients_with_floors_equal_a_masked_log_softmax(entropy):
    torch.manual_seed(0)
    T, H, V, temperature = 11, 8, 40, 0.7
    hidden = torch.randn(T, H, requires_grad=True)
    weight = torch.randn(V, H, requires_grad=True)
    bias = torch.randn(V, requires_grad=True)
    targets = torch.randint(0, V, (T,))
    full = torch.log_softmax((hidden @ weight.T + bias).detach() / temperature, -1)
    # floors: halfway below each token's 3rd..12th largest log-prob (no token at the boundary);
    # one target below its floor (kept anyway), one token without a floor (the full vocabulary)
    ranked = full.sort(-1, descending=True).values  # [T, V]
    j = torch.arange(T) % 10 + 2
    floors = (ranked[torch.arange(T), j] + ranked[torch.arange(T), j + 1]) / 2
    targets[0] = full[0].argmin()
    floors[1] = float("-inf")
    g_lp, g_ent = torch.randn(T), torch.randn(T)
    for fl in (floors, None):
        lp, ent = chunked_logprobs(
            hidden, weight, targets, temperature, entropy, chunk_elems=3 * V, bias=bias, floors=fl
        )
        loss = (g_lp * lp).sum() + ((g_ent * ent).sum() if entropy else 0)
        got = torch.autograd.grad(loss, (hidden, weight, bias))
        leaves = [x.detach().double().requires_grad_() for x in (hidden, weight, bias)]
        want_lp, want_ent = naive_head(
            *leaves, targets, temperature, None if fl is None else fl.double()
        )
        want_loss = (g_lp.double() * want_lp).sum()
        if entropy:
            want_loss = want_loss + (g_ent.double() * want_ent).sum()
            assert torch.allclose(ent.double(), want_ent, atol=1e-5)
        want = torch.autograd.grad(want_loss, leaves)
        assert torch.allclose(lp.double(), want_lp, atol=1e-5)
        for a, b in zip(got, want):
            assert torch.allclose(a.double(), b, atol=1e-4, rtol=1e-4), (a - b).abs().max()
    # the kept sets change the numbers: a test that can fail
    lp_f, _ = chunked_logprobs(hidden, weight, targets, temperature, floors=floors)
    lp_n, _ = chunked_logprobs(hidden, weight, targets, temperature)
    gap = lp_f - lp_n
    assert (gap[torch.arange(T) != 1] > 0).all() and gap[1].abs() < 1e-6


@pytest.mark.parametrize("entropy", [False, True])
def test_floors_of_minus_infinity_give_the_full_vocabularys_numbers(entropy):
    # a token without a floor in a replayed batch (offline data beside rollouts) is computed as
    # without replay, up to float32 rounding (one exp pass serves both normalisers)
    torch.manual_seed(1)
    T, H, V = 7, 8, 33
    hidden = torch.randn(T, H, requires_grad=True)
    weight = torch.randn(V, H, requires_grad=True)
    targets = torch.randint(0, V, (T,))
    outs = []
    for fl in (None, torch.full((T,), float("-inf"))):
        lp, ent = chunked_logprobs(hidden, weight, targets, 0.9, entropy, 2 * V, floors=fl)
        loss = lp.sum() + (ent.sum() if entropy else 0)
        outs.append((lp, ent, *torch.autograd.grad(loss, (hidden, weight))))
    for a, b in zip(*outs):
        assert a is None and b is None or torch.allclose(a, b, atol=1e-5, rtol=1e-5)


def test_multi_turn_samples_carry_floors_aligned_with_their_tokens():
    from extras.multiturn import extend_sample, new_sample

    s = new_sample([1, 2])
    extend_sample(s, [1, 2], Completion([3, 4], [-1.0, -2.0], "stop", (0, 0), [-5.0, -6.0]))
    extend_sample(s, [1, 2, 3, 4, 9, 9], Completion([5], [-1.5], "stop", (0, 0), [-7.0]))
    assert s["mask"] == [1, 1, 0, 0, 1]
    assert s["logprob_floors"] == [-5.0, -6.0, 0.0, 0.0, -7.0]  # environment tokens: any finite
    plain = new_sample([1])
    extend_sample(plain, [1], Completion([3], [-1.0], "stop"))
    assert "logprob_floors" not in plain


def test_check_sampling_refuses_another_top_k_and_truncated_rollouts_without_floors():
    import loop

    cfg = run.parse_config(["--mode", "train", "--temperature", "1.0", "--top-k", "20"])

    def group(**info):
        return [Experience([1, 2, 3], 2, [-0.5], [1], 1.0, "g", "t", 0, info, "e")]

    sampled = dict(temperature=1.0, top_p=1.0)
    loop.check_sampling(cfg, [group(**sampled, top_k=20, logprob_floors=[-3.0])])
    with pytest.raises(RuntimeError, match="top_k 0 there, 20 here: launch both sides"):
        loop.check_sampling(cfg, [group(**sampled, top_k=0)])
    with pytest.raises(RuntimeError, match="top_k 20 without info\\['logprob_floors'\\]"):
        loop.check_sampling(cfg, [group(**sampled, top_k=20)])
    # a rollout recording no sampling settings (written before top_k existed): cfg's assumed
    plain = run.parse_config(["--mode", "train", "--temperature", "1.0"])
    loop.check_sampling(plain, [group(**sampled)])


def test_the_vllm_engine_refuses_truncation_for_training_in_one_line():
    from engines import vllm_available
    from extras import vllm_engine

    if not vllm_available():
        pytest.skip("vLLM is not installed")
    for mode in ("both", "explore"):
        for flags in (["--top-k", "20"], ["--top-p", "0.9"]):
            cfg = run.parse_config(["--engine", "vllm", "--mode", mode, *flags])
            with pytest.raises(ValueError) as err:
                vllm_engine.check_config(cfg)
            assert "vLLM records no kept set" in str(err.value) and "\n" not in str(err.value)
    for mode in ("bench", "train"):  # mode bench trains nothing; mode train samples nothing
        vllm_engine.check_config(
            run.parse_config(["--engine", "vllm", "--mode", mode, "--top-k", "20"])
        )


@pytest.mark.slow
def test_run_py_refuses_vllm_top_k_training_in_one_error_line(tiny_model, tmp_path):
    from engines import vllm_available

    if not vllm_available():
        pytest.skip("vLLM is not installed")
    res = run_py(*tiny_args(tiny_model, tmp_path / "r", "--engine", "vllm", "--top-k", "20"))
    last = res.stderr.strip().splitlines()[-1]
    assert res.returncode == 2 and "--engine vllm with top_p 1.0, top_k 20" in last, res.stderr
    assert "Traceback" not in res.stderr


def test_the_floors_cost_few_bytes_of_json_per_token(tiny_model, tmp_path):
    exps = explored(tiny_model, tmp_path, 1.0, 20)
    tokens = sum(len(e.action_mask) for e in exps)
    extra = sum(len(json.dumps({"logprob_floors": e.info["logprob_floors"]})) for e in exps)
    assert extra / tokens < 14, extra / tokens  # rounded to 1e-6: "-10.123456, "


def test_kept_set_replay_off_scores_the_whole_vocabulary(tiny_model, tmp_path):
    """--no-kept-set-replay (the comparison's arm): the policy's log-probs are the full
    softmax's, short of the behaviour ones by the kept mass."""
    exps = explored(tiny_model, tmp_path, 0.9, 0)
    flags = ["--config", "configs/tiny.toml", "--temperature", str(TEMPERATURE), "--top-p", "0.9"]
    gaps = []
    for more in ([], ["--no-kept-set-replay"]):
        tr = Trainer(run.parse_config([*flags, *more]), tiny_model, torch.device("cpu"))
        with torch.no_grad():
            b, lp, _ = tr.logprobs(tr.model, exps, False)
        gaps.append((((b["behaviour_logprobs"] - lp) * b["mask"]).sum() / b["mask"].sum()).item())
    assert abs(gaps[0]) < 1e-4 and gaps[1] > 0.05, gaps
