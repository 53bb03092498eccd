"""benchmarks/gpu_check.py's plan and checks, on the CPU: what it runs on 1-3 GPUs and how it reads a stage's files
(the stages themselves need CUDA: tests/test_gpu.py and the check's own run)."""

import json
import sys
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
    names = list(stages)  # the criteria's measurements before the tests
    assert names[:5] == ["cuda", "sync-135m", "sync-0.5b", "bench", "trainer"] and names.index(
        "tests"
    ) > names.index("both-0.5b")


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
