"""The agent path against plain rollouts: generated tokens/s of one HF engine on the same
tasks, explorer batches interleaved round by round (docs/agents.md).

    python benchmarks/bench_agent.py [--model smollm2-135m] [--threads 2] [--rounds 3] [run.py flags]

Three explorers share one engine and the calculator task (configs/calculator.toml; run.py
flags after the options change it, e.g. --dtype float32 --batch-size 8):

    plain        --workflow math: the question, one reply (the default job's workflow)
    plain+tools  --workflow math with the agent's system message (its instructions and the
                 tool schemas, as the endpoint renders them): prompts as long as the agent's
    agent        --workflow agent:extras.calculator_agent.calculator_agent: each episode
                 a call, the tool's result, a second call, through the OpenAI-compatible
                 endpoint with the official openai client

Each round generates one batch (batch_size tasks x group_size rollouts) with each, the same
tasks for all three. Printed per workflow: generated tokens/s (the tokens the policy
sampled, action_mask 1: an agent's tool results and turn markers not counted), prefilled
tokens per generated token, model calls; then the agent's tokens/s over each plain one's,
median over rounds.
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from bench_step import Sink  # noqa: E402

import components  # noqa: E402
import models  # noqa: E402
from components import load_tasks  # noqa: E402
from config import parse_config  # noqa: E402
from engines import HFEngine  # noqa: E402
from explorer import Explorer  # noqa: E402
from extras.calculator_agent import SYSTEM, TOOLS  # noqa: E402
from extras.chat_tools import hermes_messages  # noqa: E402
from perf import cpu_model  # noqa: E402

AGENT = "agent:extras.calculator_agent.calculator_agent"


def explorers(args, extra) -> tuple[dict, HFEngine]:
    """The three explorers on one engine."""
    tools_system = hermes_messages([{"role": "system", "content": SYSTEM}], TOOLS)[0]["content"]
    flags = {
        "plain": ["--workflow", "math"],
        "plain+tools": ["--workflow", "math", "--system-prompt", tools_system],
        "agent": ["--workflow", AGENT],
    }
    base = ["--config", str(ROOT / "configs" / "calculator.toml"), "--run-dir", tempfile.mkdtemp()]
    base += (["--model", args.model] if args.model else []) + extra
    cfgs = {k: parse_config(base + v) for k, v in flags.items()}
    cfg = cfgs["agent"]
    dtype, _ = models.choose_dtype(cfg.dtype, "cpu")
    train, held, ds = load_tasks(cfg.task, cfg.task_kwargs, cfg.train_size, 1, cfg.seed)
    engine = HFEngine(
        components.resolve_model(cfg.model),
        max_batch=cfg.explorer_max_batch,
        seed=cfg.seed,
        bf16=dtype == "bfloat16",
    )
    explorers = {
        k: Explorer(c, engine, train, held, ds, print, components.explorer_parts(c))
        for k, c in cfgs.items()
    }
    return explorers, engine


def one_batch(ex: Explorer, rnd: int, engine: HFEngine) -> dict:
    """Batch `rnd` of explorer `ex`: generated tokens, seconds, prefilled tokens, calls."""
    calls, batch = [], engine.generate_batch

    def count(prompts, ns, sampling):  # what reached the engine
        calls.append((len(set(map(tuple, prompts))), sum(map(len, set(map(tuple, prompts))))))
        return batch(prompts, ns, sampling)

    engine.generate_batch = count
    sink = Sink()
    ex.selector.cursor = rnd * ex.cfg.batch_size  # the same tasks for every workflow
    t = time.perf_counter()
    try:
        plan = ex.plan_batch(rnd, sink)
        ex.write_batch(plan, ex.rollout(plan.tasks), sink)
    finally:
        del engine.generate_batch
    seconds = time.perf_counter() - t
    exps = [e for g in sink.groups for e in g]
    return {
        "generated": sum(sum(e.action_mask) for e in exps),
        "seconds": seconds,
        "prefilled": sum(p for _, p in calls),
        "engine_calls": len(calls),
        "reward": sum(e.reward or 0.0 for e in exps) / len(exps),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="", help="model (default: the config's, smollm2-135m)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the engine")
    ap.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="interleaved rounds (one batch of each workflow per round)",
    )
    args, extra = ap.parse_known_args()
    torch.set_num_threads(args.threads)
    exs, engine = explorers(args, extra)
    cfg = exs["agent"].cfg
    print(
        f"bench_agent: {cpu_model()}, {args.threads} thread(s), dtype {cfg.dtype}, "
        f"{cfg.batch_size} tasks x {cfg.group_size} rollouts per batch, max_tokens {cfg.max_tokens}"
    )
    rows = {k: [] for k in exs}
    for rnd in range(args.rounds):
        for k, ex in exs.items():
            rows[k].append(one_batch(ex, rnd, engine))
            r = rows[k][-1]
            print(
                f"  round {rnd} {k:<12} {r['generated'] / r['seconds']:7.1f} tokens/s  ({r['generated']} tokens "
                f"in {r['seconds']:.1f} s, reward {r['reward']:.2f})"
            )
    rate = {k: statistics.median(r["generated"] / r["seconds"] for r in v) for k, v in rows.items()}
    print(f"\n{'workflow':<13}{'tokens/s':>10}{'prefilled/generated':>21}{'engine calls':>14}")
    for k, v in rows.items():
        print(
            f"{k:<13}{rate[k]:>10.1f}{sum(r['prefilled'] for r in v) / sum(r['generated'] for r in v):>21.2f}"
            f"{statistics.median(r['engine_calls'] for r in v):>14.0f}"
        )
    for k in ("plain", "plain+tools"):
        print(f"agent / {k}: {rate['agent'] / rate[k]:.2f}  (median over {args.rounds} rounds)")
    engine.close()


if __name__ == "__main__":
    main()
