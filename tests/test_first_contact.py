"""What a new user meets first: --help, any task by name, the model names, the outputs of a run."""

import json
import shutil
import sys

import pytest
import torch
from safetensors.torch import load_file

import components
import metrics
import models
import run
from conftest import ROOT, run_py, tiny_args
from workflows import extract_answer, load_tasks


def strict_json_lines(path):
    """Parse JSONL rejecting NaN / Infinity (Python's json accepts them; JSON does not)."""

    def bad(x):
        raise ValueError(f"not JSON: {x}")

    return [json.loads(x, parse_constant=bad) for x in path.read_text().splitlines()]


def test_help_lists_every_setting_with_its_help_and_one_default(capsys):
    with pytest.raises(SystemExit) as done:
        run.parse_config(["--config", "configs/tiny.toml", "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    flat = " ".join(text.replace("│", " ").split())  # (tyro draws boxes on a terminal)
    assert "each --config FILE.toml" in flat
    assert flat.count("(default:") == len(run.dataclasses.fields(run.Config))
    assert "(default: None)" not in flat
    assert (
        "--dtype {auto,bfloat16,float32} compute precision of trainer and engines: auto (bfloat16 where"
        in flat
    )
    assert "--overwrite, --no-overwrite delete an existing run_dir first" in flat
    assert (
        "--steps INT trainer steps of the run (= explorer batches) (default: 3)" in flat
    )  # the preset's value
    for name in ("--sync-interval", "--task-kwargs JSON", "--no-activation-checkpointing"):
        assert name in flat, name


def test_default_toml_spells_out_the_defaults():
    # configs/default.toml is "the default job, spelled out": a changed default must change it too
    import dataclasses

    spelled, defaults = (
        run.parse_config(["--config", str(ROOT / "configs/default.toml")]),
        run.parse_config([]),
    )
    differ = {
        f.name
        for f in dataclasses.fields(defaults)
        if getattr(spelled, f.name) != getattr(defaults, f.name)
    }
    assert differ == set() and spelled.lr_schedule == "cosine_with_min_lr"


def test_task_by_name_uses_its_own_defaults():
    default = run.parse_config([])
    assert default.task == "basic_arithmetic" and default.task_kwargs["operators"] == ["+", "-"]
    other = run.parse_config(["--task", "leg_counting"])
    assert other.task_kwargs == {} and "as a number" not in other.system_prompt
    given = run.parse_config(
        ["--task", "chain_sum", "--task-kwargs", '{"min_terms": 3}', "--system-prompt", "S"]
    )
    assert given.task_kwargs == {"min_terms": 3} and given.system_prompt == "S"


@pytest.mark.slow
def test_every_reasoning_gym_dataset_loads_by_name():
    from reasoning_gym.factory import DATASETS

    failed = {}
    for name in sorted(DATASETS):
        if name == "composite":  # a mix of other datasets: it needs its kwargs
            continue
        try:
            train, held, ds = load_tasks(name, {}, 4, 2, 0)
            assert train and held
            if (
                train[0].entry["answer"] is not None
            ):  # some puzzles have no single answer: the verifier checks
                assert ds.score_answer(train[0].answer, train[0].entry) == 1.0
        except Exception as e:  # collect all failures
            failed[name] = repr(e)[:200]
    assert not failed, failed
    with pytest.raises(ValueError, match="reasoning-gym dataset 'composite'"):
        load_tasks("composite", {}, 4, 2, 0)


@pytest.mark.parametrize(
    "completion,reference,expected",
    [
        ("so 3 + 4 = 7", "7", "7"),
        ("it is -12.0", "-12", "-12"),
        ("1,000 legs", "1000", "1000"),
        ("sorted:\napple, banana", "apple, banana", "apple, banana"),
        ("<answer> x y </answer> z", "x y", "x y"),
        ("no number", "3", None),
        ("  \n", "a", None),
    ],
)
def test_extract_answer(completion, reference, expected):
    assert extract_answer(completion, reference) == expected


def test_metrics_are_valid_json(tmp_path):
    m = metrics.Metrics(tmp_path)
    m.write({"step": 0, "eval/last_accuracy": float("nan"), "x": [float("inf"), 1.0]})
    assert strict_json_lines(tmp_path / "metrics.jsonl") == [
        {"step": 0, "eval/last_accuracy": None, "x": [None, 1.0]}
    ]


@pytest.mark.slow
def test_another_task_that_cannot_learn_warns_and_saves_in_the_model_dtype(tiny_model, tmp_path):
    model = (
        tmp_path / "bf16_model"
    )  # a model whose own dtype is bfloat16 (weights stored in float32)
    shutil.copytree(tiny_model, model)
    conf = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**conf, "dtype": "bfloat16"}))
    res = run_py(
        "--config",
        "configs/tiny.toml",
        "--model",
        model,
        "--run-dir",
        tmp_path / "run",
        "--task",
        "leg_counting",
        "--reward-fn",
        "tests.rewards.constant",
        "--eval-size",
        0,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "explorer: engine hf" in res.stdout
    steps = [
        r for r in strict_json_lines(tmp_path / "run" / "metrics.jsonl") if "loss/grad_norm" in r
    ]
    assert [r["advantage/zero_steps"] for r in steps] == [1, 2, 3]
    assert "warning: every advantage has been 0 for 3 steps" in res.stderr
    final = load_file(tmp_path / "run" / "final" / "model.safetensors")
    assert {t.dtype for t in final.values()} == {torch.bfloat16}
    assert (
        json.loads((tmp_path / "run" / "final" / "config.json").read_text())["dtype"] == "bfloat16"
    )
    samples = (tmp_path / "run" / "samples.log").read_text()
    assert "[prompt]" in samples and "legs" in samples and "[policy]" in samples


@pytest.mark.slow
def test_bench_takes_the_model_names_of_model(tiny_model, tmp_path, monkeypatch):
    cache = (
        tmp_path / "cache"
    )  # a converted default model in the cache: here the tiny model stands in
    shutil.copytree(tiny_model, cache / "SmolLM2-135M-Instruct")
    monkeypatch.setenv("NANORFT_CACHE", str(cache))
    res = run_py(
        "--config",
        "configs/tiny.toml",
        "--mode",
        "bench",
        "--run-dir",
        tmp_path / "run",
        "--bench-models",
        f"smollm2-135m,{tiny_model}",
        "--bench-k",
        2,
        "--eval-size",
        2,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads((tmp_path / "run" / "bench.json").read_text())
    assert [r["model"] for r in rows] == [str(cache / "SmolLM2-135M-Instruct"), tiny_model]
    res = run_py(
        "--mode", "bench", "--run-dir", tmp_path / "run", "--bench-models", "/no/such/model"
    )
    assert (
        res.returncode == 2
        and "model directory not found (no config.json): /no/such/model" in res.stderr
    )


def test_model_by_hub_id_from_the_local_cache_and_a_clear_offline_error(
    tiny_model, tmp_path, monkeypatch
):
    # a Hugging Face cache populated as huggingface_hub lays it out (refs/main -> snapshots/<commit>/files)
    repo = tmp_path / "hub" / "models--tiny-org--tiny-llama"
    snapshot = repo / "snapshots" / ("0" * 40)
    shutil.copytree(tiny_model, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    assert components.resolve_model("tiny-org/tiny-llama") == str(snapshot)
    with pytest.raises(
        FileNotFoundError,
        match="model 'other-org/missing' is neither a local path nor in the local Hugging Face cache .* "
        "`hf download other-org/missing`",
    ):
        components.resolve_model("other-org/missing")


@pytest.mark.parametrize(
    "device,native,requested,dtype,says",
    [
        ("cpu", True, "auto", "bfloat16", "computes bf16 natively"),
        ("cpu", False, "auto", "float32", "has no native bf16"),
        ("cpu", False, "bfloat16", "bfloat16", "warning"),  # asked for: it runs, with a warning
        ("cpu", True, "float32", "float32", "--dtype"),
        ("cuda", True, "auto", "bfloat16", "CUDA device computes bf16 natively"),
        ("cuda", False, "auto", "float32", "CUDA device has no native bf16"),
    ],
)
def test_precision_follows_the_hardware(monkeypatch, device, native, requested, dtype, says):
    monkeypatch.setattr(models, "native_bf16", lambda device_type: native)
    got, why = models.choose_dtype(requested, device)
    assert got == dtype and says in why


@pytest.mark.parametrize("forced,expected", [("0", False), ("1", True)])
def test_cpu_bf16_probe_can_be_forced(monkeypatch, forced, expected):
    monkeypatch.setenv("NANORFT_CPU_BF16", forced)
    assert models.native_bf16("cpu") is expected


@pytest.mark.slow
def test_the_chosen_precision_is_in_the_banner_and_config_json(tiny_model, tmp_path):
    builds = (
        tmp_path / "builds.txt"
    )  # tests/count_builds: a line per reasoning-gym dataset built, in any process
    res = run_py(
        "--config",
        "configs/tiny.toml",
        "--model",
        tiny_model,
        "--run-dir",
        tmp_path / "r",
        "--dtype",
        "auto",
        "--steps",
        1,
        "--eval-size",
        0,
        env={
            "NANORFT_CPU_BF16": "0",
            "NANORFT_BUILD_LOG": str(builds),
            "PYTHONPATH": str(ROOT / "tests" / "count_builds"),
        },
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert (
        len(builds.read_text().splitlines()) == 2
    )  # the tasks are built once (train + held-out), not again by the explorer
    assert "precision float32 (this CPU" in res.stdout and "has no native bf16" in res.stdout
    assert "the trainer's decoder blocks run eagerly (float32 on a CPU)" in res.stdout
    saved = json.loads((tmp_path / "r" / "config.json").read_text())
    assert saved["dtype"] == "float32" and "no native bf16" in saved["precision"]
    step = [
        json.loads(x)
        for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()
        if "loss/grad_norm" in x
    ][0]
    assert (
        0 < step["memory/trainer_peak_rss_gib"] < 24
        and 0 < step["memory/explorer_peak_rss_gib"] < 24
    )
    assert (
        0 < step["cpu/utilisation_pct"]
        and 0 < step["train/computed_tokens"] < step["train/sequence_tokens"]
    )
    assert (
        "Loading weights" not in res.stdout + res.stderr
    )  # transformers' bars stay out of the step bar


def test_the_default_task_without_reasoning_gym_is_one_error_line(
    tiny_model, tmp_path, monkeypatch, capsys
):
    # the default task and reward are reasoning-gym's; a machine without it (the GPU box) gets the run's one
    # error line naming the package and the alternatives, not a ModuleNotFoundError traceback
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # `import reasoning_gym` fails
    assert run.main(["--model", tiny_model, "--run-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("run.py: error: task 'basic_arithmetic'"), err
    assert "pip install reasoning-gym" in err and "guess_number" in err and ".jsonl" in err


@pytest.mark.parametrize(
    "dtype,weights", [("bfloat16", torch.bfloat16), ("float32", torch.float32)]
)
def test_the_hf_engine_holds_its_weights_in_the_runs_precision(tiny_model, dtype, weights):
    # bf16 weights, not float32 ones cast at every decode step: faster decoding and half the explorer's weights
    from engines import HFEngine

    cfg = run.parse_config(["--model", tiny_model, "--dtype", dtype])
    engine = HFEngine.from_config(cfg, tiny_model, 0, "cpu", colocated=False)
    assert {p.dtype for p in engine.parameters()} == {weights}


def test_every_config_file_is_read_in_turn_and_a_missing_one_is_an_error(tmp_path):
    # the second --config was ignored in silence: a run went on with the first file alone
    from config import parse_config

    first = tmp_path / "a.toml"
    first.write_text("lr = 1e-5\nsteps = 7\n")
    second = tmp_path / "b.toml"
    second.write_text("steps = 9\n")
    cfg = parse_config(["--config", str(first), f"--config={second}"])
    assert (cfg.lr, cfg.steps) == (1e-5, 9)
    assert (
        parse_config(["--config", str(first), "--config", str(second), "--steps", "3"]).steps == 3
    )
    with pytest.raises(FileNotFoundError, match="config file not found: /nonexistent.toml"):
        parse_config(["--config", "configs/tiny.toml", "--config", "/nonexistent.toml"])


def test_the_same_command_run_again_writes_to_a_new_run_dir(tiny_model, tmp_path, monkeypatch):
    # a second run of the README's command failed: "run_dir runs/default is not empty"
    monkeypatch.chdir(tmp_path)
    argv = ["--config", str(ROOT / "configs/tiny.toml"), "--model", tiny_model, "--eval-size", "2"]
    dirs = []
    for _ in range(3):
        cfg = run.parse_config(argv)
        run.prepare(cfg, 0)
        dirs.append(cfg.run_dir)
    assert dirs == ["runs/tiny", "runs/tiny-2", "runs/tiny-3"]
    assert all((tmp_path / d / "config.json").is_file() for d in dirs)
    # a run dir the user names is theirs: a used one is refused, as before
    with pytest.raises(FileExistsError, match="is not empty"):
        run.prepare(run.parse_config([*argv, "--run-dir", "runs/tiny"]), 0)
    # --resume and --overwrite mean the run dir given
    assert run.own_run_dir(run.parse_config([*argv, "--overwrite"])) == "runs/tiny"


def test_another_tasks_preset_is_named_at_the_start(tiny_model, tmp_path, capsys):
    # --task chain_sum changed task_kwargs and system_prompt in silence
    argv = tiny_args(tiny_model, tmp_path / "r")
    cfg = run.parse_config([*argv, "--task", "chain_sum", "--system-prompt", "Answer."])
    assert (cfg.task_kwargs, cfg.system_prompt) == ({}, "Answer.")
    run.prepare(cfg, 0)
    out = capsys.readouterr().out
    assert "nanorft: task chain_sum: task_kwargs {} (the defaults are basic_arithmetic's" in out
    assert "system_prompt" not in out.split("nanorft: task chain_sum:")[1].splitlines()[0]
    run.prepare(run.parse_config([*argv, "--overwrite"]), 0)
    assert "nanorft: task basic_arithmetic:" not in capsys.readouterr().out


def test_a_json_flag_replaces_a_presets_list_of_tables():
    # a preset's list of tables narrowed the setting's type to a list of dicts, and the flag's
    # JSON list became one entry of it
    flag = '[{"op": "dedup"}, {"op": "pass_rate_difficulty", "k": 2}]'
    preset = run.parse_config(["--config", str(ROOT / "configs/pipelines.toml")])
    assert preset.task_pipeline[0] == {"op": "dedup"} and len(preset.task_pipeline) == 3
    cfg = run.parse_config(
        ["--config", str(ROOT / "configs/pipelines.toml"), "--task-pipeline", flag]
    )
    assert cfg.task_pipeline == [{"op": "dedup"}, {"op": "pass_rate_difficulty", "k": 2}]
    cfg = run.parse_config(["--task-kwargs", '{"min_terms": 3}'])  # over a non-empty dict default
    assert cfg.task_kwargs == {"min_terms": 3}
