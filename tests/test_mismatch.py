"""Mismatch attribution (extras/mismatch.py): the recomputed engine side, the parts adding up to the
total per token, each part 0 where its cause is absent."""

import copy
import json

import pytest
import torch
from test_fidelity import make_trainer  # noqa: F401 (a fixture)

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14, 15]]


def sampled(model: str, top_p: float = 1.0, version: int = 0, seed: int = 0) -> list:
    """Rollouts of PROMPTS (2 each, 12 tokens at temperature 1, rewards 0 and 1) by the HF engine in float32 as
    experiences sampled at `version`, each with the floors of its kept set when truncated."""
    import asyncio

    from buffer import Experience
    from conftest import served
    from engines import HFEngine, Sampling

    engine = HFEngine(model, seed=seed)
    sampling = Sampling(max_tokens=12, temperature=1.0, top_p=top_p)

    async def go():
        return await asyncio.gather(*(engine.generate(p, 2, sampling) for p in PROMPTS))

    outs = served(engine, go())
    exps = []
    for i, (p, completions) in enumerate(zip(PROMPTS, outs)):
        for j, c in enumerate(completions):
            info = {}
            if c.logprob_floors is not None:
                info["logprob_floors"] = c.logprob_floors
            exps.append(
                Experience(
                    p + c.tokens,
                    len(p),
                    c.behaviour_logprobs,
                    [1] * len(c.tokens),
                    float(j),
                    str(i),
                    "t",
                    version,
                    info,
                )
            )
    return exps


def trained_mask(exps: list) -> torch.Tensor:
    R = max(len(e.action_mask) for e in exps)
    mask = torch.zeros(len(exps), R, dtype=torch.float64)
    for i, e in enumerate(exps):
        mask[i, : len(e.action_mask)] = 1.0
    return mask


def test_the_engines_decoding_is_recomputed_to_float_noise(make_trainer, tiny_model):
    """The engine side of the path (incremental decode over a KV cache, teacher-forced) gives
    back the log-probs the HF engine sampled with, in float32 at the same weights; the
    trainer's packed forward differs from both by kernels and layout alone."""
    from extras.mismatch import incremental_logprobs

    tr = make_trainer("--dtype", "float32", "--temperature", "1.0")
    for top_p in (1.0, 0.9):
        exps = sampled(tiny_model, top_p)
        got = incremental_logprobs(tr.model, exps, tr.pad, 1.0, tr.device).double()
        mask = trained_mask(exps)
        want = torch.zeros_like(got)
        for i, e in enumerate(exps):
            want[i, : len(e.behaviour_logprobs)] = torch.tensor(e.behaviour_logprobs)
        gap = float(((got - want).abs() * mask).max())
        assert gap < 1e-5, (top_p, gap)


def test_each_part_is_0_where_its_cause_is_absent(make_trainer, tiny_model):
    """float32, top_p 1, the batch at the trainer's version: precision, truncation and
    staleness are exactly 0 and the layout part is the whole (tiny) gap."""
    from extras import mismatch

    tr = make_trainer("--dtype", "float32", "--temperature", "1.0", "--mismatch-every", "1")
    exps = sampled(tiny_model)
    parts = mismatch.parts(mismatch.path(tr.old_policy, exps, tr.version))
    mask = trained_mask(exps)
    for name in ("precision", "truncation", "staleness"):
        assert float((parts[name].abs() * mask).max()) == 0.0, name
    assert torch.equal(parts["layout"] * mask, parts["total"] * mask)
    assert float((parts["layout"].abs() * mask).max()) < 1e-4


def test_the_parts_add_up_to_the_total_of_every_token(make_trainer, tiny_model):
    """bfloat16, top_p 0.9, a batch one version old: every part is there, and per token the
    parts' signed differences sum to the total."""
    from extras import mismatch

    tr = make_trainer(
        "--dtype",
        "bfloat16",
        "--temperature",
        "1.0",
        "--top-p",
        "0.9",
        "--lr",
        "1e-2",
        "--sync-interval",
        "2",
        "--mismatch-every",
        "1",
    )
    exps = sampled(tiny_model, top_p=0.9)
    tr.step([copy.deepcopy(exps[:2]), copy.deepcopy(exps[2:4])])
    assert tr.version == 1
    parts = mismatch.parts(mismatch.path(tr.old_policy, exps, 0))
    mask = trained_mask(exps)
    summed = sum(parts[name] for name in mismatch.PARTS)
    assert float(((summed - parts["total"]).abs() * mask).max()) < 1e-9
    for name in mismatch.PARTS:
        assert float((parts[name].abs() * mask).sum()) > 0, name
    # truncation: each token's part is minus the log of the kept mass, which is <= 0
    assert float((parts["truncation"] * mask).max()) <= 1e-6


def test_the_step_logs_the_parts_every_n_steps(make_trainer, tiny_model):
    tr = make_trainer("--temperature", "1.0", "--mismatch-every", "2", "--sync-interval", "2")
    exps = sampled(tiny_model)
    first = tr.step([copy.deepcopy(exps[:2])])
    second = tr.step([copy.deepcopy(exps[:2])])
    keys = {
        f"mismatch/{p}/{s}"
        for p in (*("precision", "layout"), "truncation", "staleness", "total")
        for s in ("abs", "k3")
    }
    assert keys <= set(first) and first["mismatch/tokens"] > 0
    assert not keys & set(second)


@pytest.mark.parametrize("flags", [["--one-gpu-fsdp"]])
def test_the_attribution_refuses_a_sharded_trainer_in_one_line(flags):
    import components
    import run

    cfg = run.parse_config(["--config", "configs/tiny.toml", "--mismatch-every", "5", *flags])
    with pytest.raises(ValueError, match="one trainer rank without FSDP sharding") as e:
        components.check_trainer(cfg)
    assert "\n" not in str(e.value)


def test_the_parts_table_takes_each_steps_mean_over_seeds(tmp_path, monkeypatch):
    """benchmarks/mismatch.py over a run of several seeds: the first and the last step's column
    is that step's mean over the seeds (it took seed 0's first step and the last seed's last)."""
    from conftest import ROOT

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import mismatch

    monkeypatch.setattr(mismatch, "RESULTS", tmp_path)
    for seed, scale in ((0, 1.0), (1, 3.0)):
        lines = []
        for step in (0, 10):
            record = {"step": step, "loss/grad_norm": 1.0}
            for part in mismatch.PARTS:
                record[f"mismatch/{part}/abs"] = scale * (step + 1)
                record[f"mismatch/{part}/k3"] = 0.0
            lines.append(json.dumps(record))
        (tmp_path / f"run_s{seed}.jsonl").write_text("\n".join(lines))
    assert mismatch.by_step(mismatch.steps("run"), "mismatch/total/abs") == [(0, 2.0), (10, 22.0)]
    row = next(x for x in mismatch.parts_table(["run"]).splitlines() if "| total |" in x)
    assert row.split(" | ")[-2:] == ["2.00e+00", "2.20e+01 |"]
