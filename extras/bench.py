"""Mode bench: avg@k, pass@k and pass@1 of models (default RUN_DIR/final) on the held-out tasks,
RUN_DIR/bench.json.
python run.py --mode bench --bench-models base,runs/default/final --bench-k 8"""

import json
import os
import time
from pathlib import Path

from config import OTHER_TASK_DEFAULTS, Config, coerce

# what mode bench on a run directory takes from the run's saved config
RUN_TASK_SETTINGS = (
    "task",
    "task_kwargs",
    "system_prompt",
    "reward_fn",
    "reward_kwargs",
    "workflow",
    "eval_size",
    "seed",
    "eval_seed",
    "max_tokens",
)


def take_run_settings(cfg: Config) -> None:
    """Without --bench-models: take the RUN_TASK_SETTINGS not given from the run's saved config;
    ValueError."""
    run_dir = Path(cfg.run_dir)
    src = next(
        (
            p
            for p in (run_dir / "final" / "nanorft_config.json", run_dir / "config.json")
            if p.is_file()
        ),
        None,
    )
    if cfg.bench_models or src is None:
        return
    try:
        saved = json.loads(src.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{src}: not a saved config ({e})") from None
    if not isinstance(saved, dict):
        raise ValueError(f"{src}: not a saved config (a JSON object)")
    same_task = "task" not in cfg.given or cfg.task == saved.get("task")
    taken = [
        name
        for name in RUN_TASK_SETTINGS
        if name in saved
        and name not in cfg.given
        and (same_task or name not in OTHER_TASK_DEFAULTS)
    ]
    for name in taken:
        setattr(cfg, name, coerce(name, saved[name]))
    cfg.given = cfg.given | set(taken)  # the run's own settings, as if given
    if taken:
        print(
            f"nanorft: mode bench on {run_dir / 'final'}: task {cfg.task}; "
            f"{', '.join(taken)} from {src} "
            "(a flag or --config sets any of them)"
        )


def bench(cfg: Config, prepare, make_engine, explorer_parts) -> int:
    """Mode bench, its tasks from `prepare` (run.prepare), its engines and explorer parts from
    the composition root (components.make_engine, components.explorer_parts); returns the exit
    code 0. ValueError / OSError (one line): bad input."""
    take_run_settings(cfg)
    tasks = prepare(cfg, 0).tasks
    if not tasks[1]:
        raise ValueError(
            f"mode bench needs held-out tasks: task {cfg.task!r} with eval_size {cfg.eval_size} "
            "has none"
        )
    evaluate_models(cfg, tasks, make_engine, explorer_parts)
    return 0


def evaluate_models(cfg: Config, tasks: tuple, make_engine, explorer_parts) -> list[dict]:
    """Evaluate each model of --bench-models on the held-out tasks: print a table, save
    RUN_DIR/bench.json, its rows."""
    from explorer import Explorer, correct_counts, engine_seed
    from extras.hub import model_dir
    from metrics import LEARNABLE_MIN, sampled_eval

    models = [m.strip() for m in cfg.bench_models.split(",") if m.strip()] or [
        str(Path(cfg.run_dir) / "final")
    ]
    paths = [model_dir(m) for m in models]
    cfg.explorer_threads = cfg.explorer_threads or (os.cpu_count() or 1)
    k, (_, held_out, dataset) = cfg.bench_k, tasks
    print(
        f"nanorft: mode bench, task {cfg.task}, engine {cfg.engine}, {len(paths)} model(s), "
        f"{k} samples per task"
    )
    rows = []
    for path in paths:
        engine = make_engine(cfg, path, engine_seed(cfg))
        try:
            t0 = time.perf_counter()
            correct = correct_counts(
                Explorer(cfg, engine, [], held_out, dataset, print, explorer_parts(cfg)).rollout(
                    held_out, n=k
                )
            )
            r = sampled_eval(correct, k, k, cfg.group_size)
            rows.append(
                {
                    "model": path,
                    "task": cfg.task,
                    "tasks": len(correct),
                    "k": k,
                    "correct": correct,
                    f"avg@{k}": r["eval/avg_at_k"],
                    f"pass@{k}": r[f"eval/pass_at_{k}"],
                    "pass@1": r["eval/pass_at_1"],
                    "group_size": cfg.group_size,
                    "learnable_groups": r.get("eval/learnable_groups"),
                    "seconds": time.perf_counter() - t0,
                }
            )
        finally:
            engine.close()
    print(
        f"task {cfg.task}: {len(held_out)} held-out tasks, {k} samples each at temperature "
        f"{cfg.temperature}"
    )
    g = f"learnable groups of {cfg.group_size}"  # metrics.learnable_groups: rewards that differ
    print(f"{'model':<50} {'tasks':>5} {f'avg@{k}':>8} {f'pass@{k}':>8} {'pass@1':>8} {g:>24}")
    for r in rows:
        f = r["learnable_groups"]
        print(
            f"{r['model'][-50:]:<50} {r['tasks']:>5} {r[f'avg@{k}']:>8.3f} "
            f"{r[f'pass@{k}']:>8.3f} {r['pass@1']:>8.3f} "
            f"{'-' if f is None else f'{f:.0%}':>24}"
            + (
                f" (below {LEARNABLE_MIN:.0%}: most groups would give no advantage)"
                if f is not None and f < LEARNABLE_MIN
                else ""
            )
        )
    out = Path(cfg.run_dir) / "bench.json"
    out.write_text(json.dumps(rows, indent=2))
    print(f"saved {out}")
    return rows
