"""On-policy distillation (--teacher, extras/distill.py): the advantage and the loss against
tinker-cookbook's (numbers from tests/fidelity_reference.py), the trainer's per-token term on real
tiny models, the teacher's own evaluation, bad teachers as one error line, and the benchmark runner."""

import dataclasses
import json
import math
import shutil
import subprocess
import sys

import fidelity_reference
import pytest
import torch
from fidelity_reference import BEHAVIOUR, G4, MASK, R4, TEACHER
from test_fidelity import _same, close, exp, make_trainer, own_logprobs, run  # noqa: F401 (make_trainer: a fixture)

import losses as L
from conftest import ROOT, make_tiny_model, run_py, subprocess_env
from explorer import eval_cache
from extras import advantages as EA
from extras import distill as D

# thinking-machines-lab/tinker-cookbook @ 9dfcc3a, tinker_cookbook/distillation/train_on_policy.py
# incorporate_kl_penalty (kl_discount_factor 0) after rl/data_processing.py compute_advantages (group-centred
# rewards), trained with Tinker's "importance_sampling" loss summed over the datums; per (kl_penalty_coef, task
# advantage): (advantages on the response tokens, teacher_kl, loss, d loss / d logprobs); "none": every reward 0
DISTILL = {
    (0.5, "rewards"): (
        [
            [0.7, 0.6, 0.2, 0],
            [-0.65, -0.65, -0.65, 0],
            [-0.025, 0.5, 0, 0],
            [-0.25, 2.7755576e-17, -0.25, -0.4],
        ],
        0.011538462,
        -0.36560285,
        [
            [-0.94490117, -0.98923276, -0.073575888, 0],
            [0.39424493, 0.65, 1.0716688, 0],
            [0.026281777, -1.3591409, 0, 0],
            [0.22620935, -2.0561836e-17, 0.30535069, 0.3274923],
        ],
    ),
    (1.0, "none"): (
        [[0.4, 0.2, -0.6, 0], [-0.3, -0.3, -0.3, 1], [-0.35, 0.7, 0, 0], [-0.2, 0.3, -0.2, -0.5]],
        0.011538462,
        -5.0765581,
        [
            [-0.53994352, -0.32974425, 0.22072766, 0],
            [0.1819592, 0.3, 0.49461638, -4.4816891],
            [0.36794488, -1.9027973, 0, 0],
            [0.18096748, -0.22224547, 0.24428055, 0.40936538],
        ],
    ),
}


@pytest.mark.parametrize("case", DISTILL)
def test_distill_advantage_and_loss_are_tinker_cookbooks(case):
    coef, task = case
    want_adv, want_kl, want_loss, want_grad = DISTILL[case]
    mask = torch.tensor(MASK, dtype=torch.float)
    estimator = (
        EA.dr_grpo_advantages if task == "rewards" else D.no_advantages
    )  # tinker: r - group mean
    task_adv = estimator(torch.tensor(R4), torch.tensor(G4))[:, None].expand(4, 4)
    adv = D.distill_advantages(task_adv, torch.tensor(TEACHER), torch.tensor(BEHAVIOUR), mask, coef)
    assert close(adv * mask, want_adv)
    # distill/reverse_kl: the trainer's masked sum of behaviour - teacher over its trained tokens
    assert close(
        L.masked_sum(torch.tensor(BEHAVIOUR) - torch.tensor(TEACHER), mask) / mask.sum(), want_kl
    )
    # PPO clip without clipping is the plain importance-sampled loss; 1 token as the total: Tinker's sum
    loss, grad, _ = run(
        "ppo_clip", adv=adv, totals=(1, 4), clip_low=1.0, clip_high=1e9, dual_clip=None
    )
    assert close(loss, want_loss) and close(grad, want_grad)


def test_distill_goldens_come_from_the_reference_script():
    ref = fidelity_reference.compute(fidelity_reference.DISTILL_PARTS)
    assert set(ref) == {"DISTILL"}
    _same(ref["DISTILL"], DISTILL, "DISTILL")


# ----------------------------------------------------------------------------- the trainer, on real tiny models


@pytest.fixture(scope="module")
def teacher_model(tmp_path_factory) -> str:
    """Another tiny model (other random weights) with the student's tokenizer."""
    return str(make_tiny_model(tmp_path_factory.mktemp("teacher") / "model", seed=1))


def teacher_logprobs(path: str, exps, pad: int) -> torch.Tensor:
    """The log-probs [B, R] of `exps`' responses under the model at `path`, computed here."""
    from transformers import AutoModelForCausalLM

    from packing import pack, response_logprobs

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        return response_logprobs(model, pack(exps, pad), 1.0)[0]


def test_the_trainer_adds_the_teachers_term_to_each_policy_token(make_trainer, teacher_model):
    # on-policy (ratio 1), no task advantage: PPO's token loss is -0.5 (teacher - behaviour) on the policy's
    # tokens; environment tokens and the offline sequences (no behaviour log-probs) get no term
    tr = make_trainer("--teacher", teacher_model, "--advantage", "none", "--distill-coef", "0.5")
    rollouts = [
        exp([5, 6, 7, 20 + i, 21, 40, 41, 22 + i], 3, [1, 1, 0, 0, 1], 0.0, "g") for i in range(4)
    ]
    offline = [exp([5, 6, 7, 30, 31 + i], 3, [1, 1], 1.0, "o", offline=True) for i in range(2)]
    own_logprobs(tr, rollouts + offline)
    mask = torch.tensor([e.action_mask for e in rollouts], dtype=torch.float)
    behaviour = torch.tensor([e.behaviour_logprobs for e in rollouts])
    kl = float(((behaviour - teacher_logprobs(teacher_model, rollouts, tr.pad)) * mask).sum())
    m = tr.step([rollouts, offline])
    tokens = float(mask.sum()) + 4  # the offline sequences: 2 tokens each
    assert abs(kl) > 1e-3 and m["distill/reverse_kl"] == pytest.approx(kl / tokens, abs=1e-5)
    assert m["loss/policy"] == pytest.approx(0.5 * kl / tokens, abs=1e-5)
    frozen = {id(p) for p in tr.teacher.model.parameters()}  # only the student trains and syncs
    assert not frozen & {id(p) for _, p in tr.named_trained_parameters()} and not any(
        p.requires_grad for p in tr.teacher.model.parameters()
    )


def test_the_teacher_scores_at_its_own_temperature_not_the_students(make_trainer, teacher_model):
    # the teacher was scored at the student's sampling temperature; tinker-cookbook and prime-rl
    # score it at 1.0 (--teacher-temperature, default 1.0)
    rollouts = [exp([5, 6, 7, 20 + i, 21, 22 + i], 3, [1, 1, 1], 0.0, "g") for i in range(4)]
    tr = make_trainer("--teacher", teacher_model, "--temperature", "0.7")
    seqs = tr.teacher.compute([rollouts], rollouts[0])
    got = torch.stack([seqs[id(e)] for e in rollouts])  # [B, R]
    assert torch.allclose(got, teacher_logprobs(teacher_model, rollouts, tr.pad), atol=1e-5)
    tr = make_trainer("--teacher", teacher_model, "--teacher-temperature", "0.5")
    seqs = tr.teacher.compute([rollouts], rollouts[0])
    at_half = torch.stack([seqs[id(e)] for e in rollouts])
    assert not torch.allclose(at_half, got, atol=1e-3)


def test_a_teacher_with_the_students_weights_has_reverse_kl_0(make_trainer, tiny_model):
    # the same weights at the same temperature (the teacher scores at --teacher-temperature 1.0)
    tr = make_trainer("--teacher", tiny_model, "--temperature", "1.0")
    group = [exp([5, 6, 20 + i, 21 + i], 2, [1, 1], float(i % 2), "g") for i in range(4)]
    own_logprobs(tr, group)
    assert abs(tr.step([group])["distill/reverse_kl"]) < 1e-5


def test_distill_coef_0_is_plain_rl(make_trainer, teacher_model):
    group = [exp([5, 6, 20 + i, 21 + i, 22], 2, [1, 1, 1], float(i % 2), "g") for i in range(4)]
    plain, beside = make_trainer(), make_trainer("--teacher", teacher_model, "--distill-coef", "0")
    own_logprobs(plain, group)
    want, got = plain.step([group]), beside.step([group])
    assert got["loss/policy"] == pytest.approx(want["loss/policy"], abs=1e-7)
    assert got["loss/grad_norm"] == pytest.approx(want["loss/grad_norm"], rel=1e-6)
    assert abs(got["distill/reverse_kl"]) > 1e-3  # the teacher scored them all the same


@pytest.fixture(scope="module")
def other_tokenizer_model(tmp_path_factory, tiny_model) -> str:
    """The tiny model with one token added to its tokenizer."""
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("other_tokenizer") / "model"
    shutil.copytree(tiny_model, path)
    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.add_tokens(["<only-the-teacher-knows>"])
    tok.save_pretrained(path)
    return str(path)


def test_a_teacher_must_have_the_students_tokenizer(
    tiny_model, teacher_model, other_tokenizer_model
):
    from transformers import AutoTokenizer

    from config import Config

    tok = AutoTokenizer.from_pretrained(tiny_model)
    D.Teacher.check(Config(teacher=teacher_model), tok)
    with pytest.raises(ValueError, match="its tokenizer differs from the student's"):
        D.Teacher.check(Config(teacher=other_tokenizer_model), tok)


def test_the_teachers_evaluation_is_its_own_and_cached(
    tiny_model, teacher_model, tmp_path, monkeypatch
):
    import components
    from config import Config
    from engines import HFEngine
    from explorer import Explorer
    from workflows import Task

    monkeypatch.setenv("NANORFT_CACHE", str(tmp_path / "cache"))
    cfg = Config(
        run_dir=str(tmp_path),
        model=tiny_model,
        teacher=teacher_model,
        group_size=4,
        eval_k=2,
        max_tokens=6,
        reward_fn="tests.rewards.length_parity",
        system_prompt="",
    )
    held_out = [Task(f"h{i}", f"question {i}", "1") for i in range(6)]
    student = HFEngine(tiny_model)
    explorer = Explorer(cfg, student, [], held_out, None, print, components.explorer_parts(cfg))
    first, again = (D.evaluate_teacher(explorer) for _ in range(2))
    assert (
        "teacher/cached" not in first
        and first["teacher/samples"] == 4
        and again["teacher/cached"] == 1
    )
    assert {k: v for k, v in again.items() if k not in ("teacher/cached", "teacher/seconds")} == {
        k: v for k, v in first.items() if k != "teacher/seconds"
    }
    (entry,) = (tmp_path / "cache" / "evals").glob(
        "*.json"
    )  # under the teacher's files, not the student's
    assert (
        entry.name
        == eval_cache(
            dataclasses.replace(cfg, model=teacher_model), HFEngine(teacher_model), held_out, 4
        ).name
    )
    assert entry.name != eval_cache(cfg, student, held_out, 4).name


def test_no_advantage_without_a_teacher_is_refused():
    from components import check_trainer
    from config import Config

    check_trainer(Config(advantage="none", teacher="smollm2-135m"))
    with pytest.raises(ValueError, match="advantage none makes every advantage 0"):
        check_trainer(Config(advantage="none"))


@pytest.mark.slow
def test_bad_teachers_are_one_error_line(tiny_model, other_tokenizer_model, tmp_path):
    for args, message in [
        (["--teacher", other_tokenizer_model], "its tokenizer differs from the student's"),
        (["--advantage", "none"], "advantage none makes every advantage 0"),
        (["--teacher", tmp_path / "nowhere"], "model directory not found"),
        (["--teacher", tiny_model, "--distill-coef", "-1"], "distill_coef must be >= 0"),
    ]:
        res = run_py(
            "--config",
            "configs/tiny.toml",
            "--model",
            tiny_model,
            "--run-dir",
            tmp_path / "r",
            *args,
            timeout=120,
        )
        last = res.stderr.strip().splitlines()[-1] if res.stderr.strip() else ""
        assert res.returncode == 2 and message in last and "Traceback" not in res.stderr, (
            args,
            res.stderr[-2000:],
        )


# ----------------------------------------------------------------------------- end to end


def records(run_dir) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_distillation_runs_end_to_end(tiny_model, teacher_model, tmp_path):
    env = {"NANORFT_CACHE": str(tmp_path / "cache")}
    run_dir = tmp_path / "opd"
    res = run_py(
        "--config",
        "configs/tiny.toml",
        "--model",
        tiny_model,
        "--teacher",
        teacher_model,
        "--run-dir",
        run_dir,
        "--steps",
        2,
        "--eval-k",
        2,
        env=env,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    steps = [r for r in records(run_dir) if "loss/policy" in r]
    assert len(steps) == 2 and all(math.isfinite(r["distill/reverse_kl"]) for r in steps)
    assert 0 <= steps[0]["teacher/accuracy"] <= 1 and 0 <= steps[0]["teacher/avg_at_k"] <= 1
    assert steps[0]["teacher/version"] == 0 and "teacher/accuracy" not in steps[1]  # evaluated once
    # the teacher is the student's own weights, float32: at the first step (version 0) on-policy, so 0
    run_dir = tmp_path / "self"
    res = run_py(
        "--config",
        "configs/tiny.toml",
        "--model",
        tiny_model,
        "--teacher",
        tiny_model,
        "--advantage",
        "none",
        # the student samples at the teacher's temperature (--teacher-temperature 1.0)
        "--temperature",
        1.0,
        "--run-dir",
        run_dir,
        "--steps",
        1,
        "--eval-size",
        0,
        env=env,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    (first,) = [r for r in records(run_dir) if "loss/policy" in r]
    assert abs(first["distill/reverse_kl"]) < 1e-4 and first["advantage/abs_mean"] == 0


@pytest.mark.slow
def test_the_benchmark_runs_on_a_tiny_config(tiny_model, tmp_path):
    out = tmp_path / "results"
    cmd = [
        sys.executable,
        "benchmarks/distill.py",
        "--teacher",
        tiny_model,
        "--arms",
        "grpo",
        "opd",
        "--seeds",
        "0",
        "--steps",
        "2",
        "--config",
        "configs/tiny.toml",
        "--results",
        str(out),
        "--plot",
        str(tmp_path / "d.png"),
        "--",
        "--model",
        tiny_model,
        "--eval-k",
        "2",
    ]
    res = subprocess.run(
        cmd,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        env={**subprocess_env(), "NANORFT_CACHE": str(tmp_path / "cache")},
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    summary = json.loads((out / "distill.json").read_text())
    assert set(summary["arms"]) == {"grpo", "opd"} and (out / "distill" / "opd_s0.jsonl").is_file()
    assert summary["arms"]["opd"]["teacher"] is not None and (tmp_path / "d.png").stat().st_size > 0
    again = subprocess.run(
        [*cmd[:2], "--plot-only", "--results", str(out), "--plot", str(tmp_path / "e.png")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert again.returncode == 0 and (tmp_path / "e.png").is_file(), again.stderr[-2000:]


def test_the_preset_is_the_default_job_until_a_teacher_is_named():
    from config import parse_config

    preset, defaults = (
        parse_config(["--config", str(ROOT / "configs" / "distill.toml")]),
        parse_config([]),
    )
    differ = {
        f.name
        for f in dataclasses.fields(preset)
        if getattr(preset, f.name) != getattr(defaults, f.name)
    }
    assert differ == {"run_dir"} and preset.distill_coef == 1.0 and not preset.teacher
