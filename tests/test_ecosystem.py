"""Hugging Face datasets as task sources, math-verify rewards, experiment trackers.

Offline: Hub repositories are laid out in a temporary Hugging Face cache as
huggingface_hub writes them (refs/main -> snapshots/<commit>/files), dataset files are
written by the tests.
"""

import importlib.util
import json
import sqlite3
import struct

import pytest

import components
from components import load_tasks
from conftest import run_py
from extras.math_verify_reward import math_verify_reward
from workflows import Task


def gsm8k_style(n: int) -> dict[str, list[str]]:
    """Columns of a GSM8K-like table: word problems whose answer ends with '#### number'."""
    return {
        "question": [
            f"Tom has {i} apples and buys {i + 3} more. How many apples does he have?"
            for i in range(n)
        ],
        "answer": [
            f"He has {i} + {i + 3} = {2 * i + 3} apples.\n#### {2 * i + 3}" for i in range(n)
        ],
    }


def write_parquet(path, columns: dict) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path)


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An offline Hugging Face cache holding dataset tiny-org/gsm8k-mini (config "main",
    splits train (20 rows) and test (5 rows), as on the Hub: parquet + README configs)."""
    repo = tmp_path / "hub" / "datasets--tiny-org--gsm8k-mini"
    snapshot = repo / "snapshots" / ("0" * 40)
    write_parquet(snapshot / "main" / "train-00000-of-00001.parquet", gsm8k_style(20))
    test = gsm8k_style(25)
    write_parquet(
        snapshot / "main" / "test-00000-of-00001.parquet", {k: v[20:] for k, v in test.items()}
    )
    (snapshot / "README.md").write_text(
        "---\nconfigs:\n- config_name: main\n  data_files:\n  - split: train\n"
        "    path: main/train-*\n  - split: test\n    path: main/test-*\n---\n"
    )
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    return tmp_path / "hub"


def test_hub_dataset_from_the_local_cache_and_clear_errors(hub_cache):
    kw = {"config": "main", "eval_split": "test"}
    train, held, dataset = load_tasks("tiny-org/gsm8k-mini", kw, 12, 3, 0)
    assert dataset is None and len(train) == 12 and len(held) == 3
    assert (
        train[4].question.startswith("Tom has 4 apples") and train[4].answer == "11"
    )  # after '####'
    assert held[0].answer == "43" and held[0].task_id == "tiny-org/gsm8k-mini/test/0"
    # without eval_split, the last eval_size rows of the split are held out
    train, held, _ = load_tasks("tiny-org/gsm8k-mini", {"config": "main"}, 100, 5, 0)
    assert len(train) == 15 and [t.answer for t in held] == [str(2 * i + 3) for i in range(15, 20)]
    with pytest.raises(
        FileNotFoundError,
        match="dataset 'tiny-org/other' is neither a local path nor in the local "
        "Hugging Face cache .*`hf download --repo-type dataset tiny-org/other`",
    ):
        load_tasks("tiny-org/other", {}, 4, 1, 0)
    for kwargs, message in [
        ({"config": "nope"}, "task tiny-org/gsm8k-mini: BuilderConfig 'nope' not found"),
        ({"eval_split": "validation"}, 'task tiny-org/gsm8k-mini: Unknown split "validation"'),
        ({"question": "problem"}, "no field 'problem' .*task_kwargs"),
        ({"min_digits": 2}, r"unknown task_kwargs \['min_digits'\]"),
    ]:
        with pytest.raises(ValueError, match=message) as e:
            load_tasks("tiny-org/gsm8k-mini", kwargs, 4, 1, 0)
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("suffix", ["parquet", "json", "csv"])
def test_local_dataset_files(tmp_path, suffix):
    cols = {
        "problem": [f"{i} + 1 = ?" for i in range(6)],
        "solution": [f"$\\boxed{{{i + 1}}}$" for i in range(6)],
    }
    path = tmp_path / f"tasks.{suffix}"
    if suffix == "parquet":
        write_parquet(path, cols)
    elif suffix == "json":
        path.write_text("\n".join(json.dumps({k: v[i] for k, v in cols.items()}) for i in range(6)))
    else:
        path.write_text(
            "problem,solution\n" + "\n".join(f'"{q}","{a}"' for q, a in zip(*cols.values()))
        )
    train, held, _ = load_tasks(str(path), {"question": "problem", "answer": "solution"}, 100, 2, 0)
    assert [t.question for t in train] == cols["problem"][:4] and [t.answer for t in held] == cols[
        "solution"
    ][4:]
    with pytest.raises(FileNotFoundError, match="task file not found"):
        load_tasks(str(tmp_path / f"missing.{suffix}"), {}, 4, 1, 0)


@pytest.mark.parametrize(
    "reference,completion,expected",
    [
        ("72", "Natalia sold 48 + 24 = 72 clips.", 1.0),  # GSM8K: the last number
        ("72", "She sold 48/2 = 24 in May, so 48 + 24 = 70.", 0.0),
        ("1,000", "The total is 1000.", 1.0),  # thousands separator
        (
            "\\frac{1}{2}",
            "So the probability is $\\boxed{0.5}$.",
            1.0,
        ),  # MATH: LaTeX reference, boxed answer
        ("$\\frac{1}{2}$", "The answer is $\\boxed{\\frac{2}{4}}$", 1.0),
        ("\\frac{1}{2}", "The answer is $\\boxed{\\frac{1}{3}}$", 0.0),
        ("x^2 + 2x + 1", "We get $\\boxed{(x+1)^2}$.", 1.0),  # symbolic equality
        ("7", "I don't know.", 0.0),
    ],
)
def test_math_verify_reward(reference, completion, expected):
    assert math_verify_reward(Task("t", "q", reference), completion, None) == expected


def test_math_verify_reward_refuses_a_reference_without_an_answer():
    with pytest.raises(ValueError, match="no answer found in the reference"):
        math_verify_reward(Task("t", "q", ""), "42", None)


def wandb_history(run_dir) -> list[dict]:
    """The history rows of an offline W&B run, read from its run-<id>.wandb file (a LevelDB
    log of wandb_internal_pb2.Record messages after a 7-byte ':W&B' header)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    data, rows, pos, chunk, block = path.read_bytes(), [], 7, b"", 32768
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = chunk + data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = pb.Record()
            record.ParseFromString(chunk)
            chunk = b""
            if record.WhichOneof("record_type") == "history":
                rows.append(
                    {
                        i.key or "/".join(i.nested_key): json.loads(i.value_json)
                        for i in record.history.item
                    }
                )
    return rows


@pytest.mark.slow
def test_gsm8k_style_dataset_trains_with_math_verify_and_every_tracker(
    tiny_model, tmp_path, monkeypatch
):
    missing = [p for p in ("wandb", "mlflow") if importlib.util.find_spec(p) is None]
    if missing:
        pytest.skip(f"optional tracker packages not installed: {missing} (CI installs them)")
    write_parquet(tmp_path / "gsm8k" / "train.parquet", gsm8k_style(40))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run_dir = tmp_path / "run"
    res = run_py(
        "--config",
        "configs/tiny.toml",
        "--model",
        tiny_model,
        "--run-dir",
        run_dir,
        "--task",
        tmp_path / "gsm8k" / "train.parquet",
        "--reward-fn",
        "math_verify",
        "--log",
        "tensorboard,wandb,mlflow",
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "tensorboard --logdir" in res.stdout
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss/grad_norm" in r]
    evals = [r for r in records if "eval/accuracy" in r]
    assert len(steps) == 3 and evals
    assert all(
        r["rollout/all_rewards_errored"] == 0 for r in steps
    )  # math-verify scored every rollout
    with sqlite3.connect(run_dir / "buffer.sqlite") as db:
        infos = [json.loads(x) for (x,) in db.execute("SELECT info FROM experiences")]
    assert len(infos) == 3 * 2 * 4 and not [i["reward_error"] for i in infos if "reward_error" in i]
    assert {i["answer"] for i in infos} <= {
        str(2 * i + 3) for i in range(40)
    }  # the part after '####'

    # TensorBoard: the same keys, steps and values as metrics.jsonl
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(run_dir / "tensorboard"))
    board.Reload()
    for key in ("reward/mean", "loss/policy", "response/len_mean"):
        assert [(e.step, e.value) for e in board.Scalars(key)] == [
            (r["step"], pytest.approx(r[key])) for r in steps
        ]
    assert [(e.step, e.value) for e in board.Scalars("eval/accuracy")] == [
        (r["step"], r["eval/accuracy"]) for r in evals
    ]

    # W&B offline run
    rows = wandb_history(run_dir)
    assert [(r["step"], r["loss/policy"]) for r in rows if "loss/policy" in r] == [
        (r["step"], pytest.approx(r["loss/policy"])) for r in steps
    ]
    assert [r["eval/accuracy"] for r in rows if "eval/accuracy" in r] == [
        r["eval/accuracy"] for r in evals
    ]

    # MLflow run in RUN_DIR/mlflow.db, with the config as params
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    run_id = (run_dir / "mlflow_run_id").read_text()
    history = client.get_metric_history(run_id, "loss/policy")
    assert sorted((m.step, m.value) for m in history) == [
        (r["step"], pytest.approx(r["loss/policy"])) for r in steps
    ]
    run = client.get_run(run_id)
    assert (
        run.info.status == "FINISHED" and json.loads(run.data.params["reward_fn"]) == "math_verify"
    )


def test_tracker_errors_are_one_line(monkeypatch):
    import components
    import run

    with pytest.raises(ValueError, match="--log: unknown tracker 'tensorbord'"):
        components.tracker_names(run.Config(log="tensorbord"))
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    with pytest.raises(
        ValueError, match=r"--log wandb: the wandb package is not installed \(pip install wandb\)"
    ):
        components.tracker_names(run.Config(log="tensorboard, wandb"))
    assert components.tracker_names(run.Config(log="none")) == [] and components.tracker_names(
        run.Config(log="tensorboard")
    ) == ["tensorboard"]


def test_optional_packages_missing_give_one_error_line(monkeypatch, tmp_path):
    # without datasets a Hub/parquet task, and without math-verify --reward-fn math_verify, ended in a traceback
    # (ModuleNotFoundError is not a user error to run.main); now each is one line naming the package
    import sys

    from config import Config

    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    monkeypatch.setitem(sys.modules, "math_verify", None)
    monkeypatch.delitem(sys.modules, "extras.math_verify_reward", raising=False)
    (tmp_path / "t.csv").write_text("question,answer\n1+1,2\n2+2,4\n")
    with pytest.raises(ValueError, match="needs the datasets package: pip install datasets"):
        load_tasks(str(tmp_path / "t.csv"), {}, 10, 1, 0)
    with pytest.raises(ValueError, match="reward_fn 'math_verify' cannot be imported"):
        components.reward_fn(Config(reward_fn="math_verify"))
