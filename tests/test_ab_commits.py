"""benchmarks/ab_commits.py's command line: run.py's flags after "--" reach both runs."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import ab_commits  # noqa: E402


def test_flags_after_the_separator_reach_the_runs():
    args = ab_commits.parse_args(
        [
            "a9c6379",
            "HEAD",
            "--steps",
            "12",
            "--b-flags",
            "--old-logprobs recompute",
            "--",
            "--engine",
            "hf",
        ]
    )
    assert (args.a, args.b, args.steps) == ("a9c6379", "HEAD", 12)
    assert args.flags == ["--engine", "hf"] and args.b_flags == "--old-logprobs recompute"
    assert ab_commits.parse_args(["A", "B"]).flags == []


def test_a_base_eval_run_gets_a_cache_of_everything_but_the_evaluations(tmp_path, monkeypatch):
    mine = tmp_path / "mine"
    for name in ("models", "evals", "peak.json"):
        (mine / name).mkdir(parents=True)
    monkeypatch.setenv("NANORFT_CACHE", str(mine))
    cache = ab_commits.cache_without_evals(tmp_path / "run-cache")
    assert sorted(p.name for p in cache.iterdir()) == ["models", "peak.json"]
    assert (cache / "models").resolve() == mine / "models"
    assert ab_commits.parse_args(["A", "B", "--base-eval"]).base_eval
