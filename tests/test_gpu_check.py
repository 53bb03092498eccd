"""benchmarks/gpu_check.py's plan and checks, on the CPU: what it runs on 1-3 GPUs and how it reads a stage's files
(the stages themselves need CUDA: tests/test_gpu.py and the check's own run)."""

import json
import os
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import gpu_check  # noqa: E402


@pytest.mark.parametrize("gpus", [["0"], ["0", "1"], ["0", "1", "2"]])
def test_the_plan_runs_ipc_only_where_the_explorer_shares_trainer_rank_0s_gpu(
    tmp_path, gpus, monkeypatch
):
    # every job stage syncs by auto's choice, and its check expects it: ipc where the explorer shares trainer rank
    # 0's GPU, NCCL where it has one of its own
    for name in (
        "PYTORCH_CUDA_ALLOC_CONF",
        "PYTORCH_ALLOC_CONF",
    ):  # settings that rule CUDA IPC out
        monkeypatch.delenv(name, raising=False)
    stages = {s.name: s for s in gpu_check.plan(tmp_path, gpus)}
    jobs = [name for name in stages if name.startswith(("both-", "lora-", "multi-"))]
    assert jobs and not any("--sync-method" in stages[name].cmd for name in jobs)
    assert gpu_check.placement(1, 1).endswith("(colocated with trainer rank 0); weight sync ipc")
    assert gpu_check.placement(2, 2).endswith("(colocated with trainer rank 0); weight sync ipc")
    assert gpu_check.placement(2, 1).endswith("explorer on cuda:1; weight sync NCCL")
    assert gpu_check.placement(3, 2).endswith("explorer on cuda:2; weight sync NCCL")
    assert ("multi-1rank" in stages) == (len(gpus) >= 2)


def test_the_plan_runs_the_tests_first_within_the_budget_each_compile_on_its_own(tmp_path):
    # the tests alone assert the graph sampling and ipc code: they once ran last, after stage
    # limits adding up to 1,320 s, so that a run cut short by the budget dropped them
    stages = gpu_check.plan(tmp_path, ["0"])
    planned = [s for s in stages if not s.extra]
    assert [s.name for s in planned] == [
        "cuda",
        "tests",
        "sync-135m",
        "sync-0.5b",
        "bench",
        "trainer",
        "both-135m",
    ]
    # within one command of 600 s on a lent GPU machine, with its start
    assert sum(s.limit_s for s in planned) + gpu_check.PREPARE_S <= gpu_check.BUDGET_S <= 580
    compiling = {s.name: s for s in stages if s.compile_s}
    assert sorted(compiling) == ["bench", "trainer"]
    for s in compiling.values():  # the stage's command is told its compile budget
        i = s.cmd.index("--compile-budget-s")
        assert float(s.cmd[i + 1]) == s.compile_s < s.limit_s
    assert {s.name for s in stages if s.extra} <= {"lora-135m", "both-0.5b"}
    assert all(s.figures for s in stages if s.name in ("cuda", "bench", "trainer"))


def test_a_stage_that_runs_out_of_time_keeps_the_figures_it_wrote(tmp_path):
    figures = tmp_path / "figures.json"
    writes_then_hangs = (
        f"import json, time; open({str(figures)!r}, 'w').write(json.dumps({{'arm': 1.5}})); "
        "print('written', flush=True); time.sleep(60)"
    )
    stage = gpu_check.Stage(
        "slow", [sys.executable, "-c", writes_then_hangs], [], 3, lambda out: ("", {}), 0, figures
    )
    with (tmp_path / "log").open("w") as log:
        r = gpu_check.run_stage(stage, time.monotonic() + 60, dict(os.environ), log)
    assert r["status"] == "FAIL" and r["detail"] == "timed out after 3 s"
    assert r["figures"] == {"arm": 1.5}


def test_the_summary_is_written_after_every_stage(tmp_path, monkeypatch):
    # a check cut short (the machine taken back) once lost every stage: gpu_check.json came at the end
    import argparse

    import torch

    out, work = tmp_path / "out", tmp_path / "work"
    out.mkdir()
    work.mkdir()
    copy = (
        f"import shutil; shutil.copy({str(out / 'gpu_check.json')!r}, {str(work / 'seen.json')!r})"
    )
    stages = [
        gpu_check.Stage("first", [sys.executable, "-c", "print(1)"], ["0"], 30, lambda o: ("", {})),
        gpu_check.Stage("second", [sys.executable, "-c", copy], ["0"], 30, lambda o: ("", {})),
    ]
    prepared = {"vocab": 1, "tasks": 1, "models": {}, "jobs_validated": [], "tests_collected": 0}
    monkeypatch.setattr(gpu_check, "prepare", lambda work, env: prepared)
    monkeypatch.setattr(gpu_check, "plan", lambda work, gpus: stages)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    args = argparse.Namespace(only="", budget_s=420.0)
    start = time.monotonic()
    summary = {"python": sys.version.split()[0]}
    env = dict(os.environ)
    assert gpu_check.checks(args, work, out, env, start + 420, start, summary) == 0
    seen = json.loads((work / "seen.json").read_text())
    assert seen["stages"]["first"]["status"] == "PASS" and "second" not in seen["stages"]


def test_a_static_cache_arm_fails_in_one_line_where_the_cache_is_not_max_cache_len(
    tiny_model, monkeypatch, tmp_path
):
    # a transformers that ignores max_cache_len sizes the cache to each call: every round
    # recompiles. Here generate runs on the CPU (it compiles on a GPU only); the cache asked
    # for is shorter than the call needs, which generate ignores the same way
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    prompts = [[5, 6, 7], [8, 9]]
    n, cache = gpu_check.raw_generate(
        model, prompts, 2, 4, 0, cache_implementation="static", max_cache_len=64
    )
    assert n > 0
    gpu_check.check_static_cache(cache, 64)
    _, dynamic = gpu_check.raw_generate(model, prompts, 2, 4, 0)
    with pytest.raises(gpu_check.Failed, match="its cache is a DynamicCache, not max_cache_len 64"):
        gpu_check.check_static_cache(dynamic, 64)
    # the arm in the bench stage, timed on the CPU, its compile budget of 0.4 s
    monkeypatch.setattr(gpu_check, "cuda_timed", lambda fn: (fn(), 0.5, 0.0))
    budget = gpu_check.CompileBudget(0.4)
    arm = gpu_check.StaticGenerate(model, 0, 64, budget)
    assert arm(prompts, 2, 4)[0] > 0 and arm(prompts, 2, 4)[0] > 0 and budget.spent == 0.5
    short = gpu_check.StaticGenerate(AutoModelForCausalLM.from_pretrained(tiny_model), 0, 4, budget)
    budget.spent = 0.0
    assert short(prompts, 2, 4) is None and budget.spent == 0.5  # it compiled, then failed
    (line,) = short.figures("static_generate").values()
    assert "\n" not in line
    assert line.startswith("static-cache generate: its cache is ") and "not max_cache_len 4" in line
    later = gpu_check.StaticGenerate(model, 0, 128, gpu_check.CompileBudget(0.0))
    assert later(prompts, 2, 4) is None and "compile budget is spent" in later.skipped
    # the bench stage fails with the arm's line, its other figures kept
    bench = {"135m": {"raw_copy_d2h2d_s": 0.1, **short.figures("static_generate")}}
    bench["0.5b"] = {"raw_copy_d2h2d_s": 0.1, **later.figures("long_static_generate")}
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    with pytest.raises(gpu_check.Failed) as failed:
        gpu_check.check_bench(tmp_path)("")
    assert str(failed.value) == f"135m: {line}"


def test_a_job_stage_reports_its_median_step(tmp_path):
    # a step that recompiled a decoder block (torch.compile, new shapes) is not the job's pace
    elapsed = [5.0, 5.5, 6.0, 16.0, 16.5, 17.0, 17.5, 18.0]
    recs = []
    for step, t in enumerate(elapsed):
        recs.append(
            {
                "step": step,
                "version": step + 1,
                "time/elapsed_s": t,
                "reward/mean": 0.0,
                "time/explore_s": 0.2,
                "time/train_s": 0.2,
                "time/sync_s": 0.05,
                "time/wait_s": 0.0,
                "explorer/tokens_per_s": 1e4,
                "train/tokens_per_s": 1e4,
                "memory/peak_allocated_gib": 1.0,
                "memory/reserved_gib": 2.0,
                "sync/trainer_checksum": 1.5,
            }
        )
        recs.append({"explorer/received_version": step + 1, "sync/explorer_checksum": 1.5})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    detail, fig = gpu_check.check_both(tmp_path, "P")("placement: P\n")
    assert fig["s_per_step"] == 0.5 and fig["s_per_step_mean"] == pytest.approx(12.5 / 6)
    assert "0.50 s/step (median" in detail


def test_a_sync_stage_reports_seconds_per_gb(tmp_path, monkeypatch):
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    (results / "sync_colocated.json").write_text(
        json.dumps(
            {
                "bytes": 2e9,
                "nanorft_s": 1.0,
                "raw_s": 0.5,
                "bucketed_s": 1.2,
                "ratio_raw_over_nanorft": 0.5,
                "ratio_raw_over_bucketed": 0.4,
                "nanorft_gb_per_s": 2.0,
                "raw_gb_per_s": 4.0,
                "ipc_s": 0.1,
                "ratio_bucketed_over_ipc": 12.0,
                "ipc_gb_per_s": 20.0,
            }
        )
    )
    monkeypatch.setattr(gpu_check, "ROOT", tmp_path)
    detail, fig = gpu_check.check_sync("colocated")("")
    assert fig["ipc_s_per_gb"] == pytest.approx(0.05) and "0.050 s/GB" in detail
