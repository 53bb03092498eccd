"""Seconds per step and its split, next to raw PyTorch/transformers loops on the same batch.

    python benchmarks/bench_step.py                      # default model and task
    python benchmarks/bench_step.py --model DIR --steps 4 --threads 1 [run.py flags...]

Part 1 runs `run.py --mode both` for a few steps and prints the mean seconds per step and
where they went (explore / train / sync / trainer waiting), from metrics.jsonl.
Part 2 times, in this process with the same thread count and interleaved (this machine is
shared and noisy), nanorft's explorer on one batch vs raw `model.generate` on the same
prompts, and nanorft's trainer step vs a raw forward/backward/AdamW loop on the same
sequences; it prints tokens/s and the ratios nanorft / raw.
"""
import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import run  # noqa: E402
from explorer import Explorer, HFEngine  # noqa: E402
from losses import left_pad  # noqa: E402
from trainer import Trainer  # noqa: E402
from workflows import load_tasks  # noqa: E402


def pipeline(args, extra):
    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, "run.py", "--run-dir", d, "--overwrite", "--steps", str(args.steps),
               "--eval-size", "0", "--explorer-threads", str(args.threads), "--trainer-threads",
               str(args.threads)] + (["--model", args.model] if args.model else []) + extra
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        recs = [json.loads(x) for x in (Path(d) / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "reward/mean" in r][1:]  # drop the first step (start-up)
    mean = lambda k: sum(r.get(k, 0.0) for r in steps) / len(steps)  # noqa: E731
    per_step = (steps[-1]["time/elapsed_s"] - steps[0]["time/elapsed_s"]) / max(1, len(steps) - 1)
    print(f"pipeline ({args.steps} steps, {args.threads} thread(s) each for explorer and trainer):")
    print(f"  seconds per step            {per_step:8.1f}")
    for k in ("time/explore_s", "time/train_s", "time/sync_s", "time/wait_s"):
        print(f"  {k:<28}{mean(k):8.1f}   (explorer runs concurrently with the trainer)"
              if k == "time/explore_s" else f"  {k:<28}{mean(k):8.1f}")


class Sink:
    """A buffer stand-in that keeps the groups in memory."""

    def __init__(self):
        self.groups = []

    def write_batch(self, groups, explorer=None, state=None, pools=()):
        self.groups += groups

    def retired(self):
        return {}


def explore_rate(ex, rnd):
    """Explore batch `rnd` with Explorer `ex`; returns (generated tokens/s, groups)."""
    sink = Sink()
    ex.selector.cursor = rnd * ex.cfg.batch_size  # the tasks of batch rnd
    t = time.perf_counter()
    ex.rollout_batch(rnd, sink)
    return sum(len(e.logprobs) for g in sink.groups for e in g) / (time.perf_counter() - t), sink.groups


def raw_generate(model, prompts, n, max_tokens, pad, bf16):
    seqs = [p for p in prompts for _ in range(n)]
    P = max(map(len, seqs))
    ids = torch.tensor([[pad] * (P - len(p)) + p for p in seqs])
    attn = (torch.arange(P)[None, :] >= torch.tensor([P - len(p) for p in seqs])[:, None]).long()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        out = model.generate(input_ids=ids, attention_mask=attn, do_sample=True, temperature=1.0, top_p=1.0,
                             top_k=0, max_new_tokens=max_tokens, pad_token_id=pad)
    gen = out[:, P:]                                        # [B, R], padded with pad after the end token
    after_end = (gen == pad).long().cumsum(1) - (gen == pad).long() > 0  # positions past the first end token
    return int((~after_end).sum())  # generated tokens, the end token included


def raw_train(model, opt, exps, token_budget, pad, bf16):
    """The plain way: every sequence padded in full (prompt included), HF's loss on the responses."""
    per_mb = max(1, token_budget // max(len(e.tokens) for e in exps))
    for i in range(0, len(exps), per_mb):
        mb = exps[i:i + per_mb]
        ids, attn, pos = left_pad([e.tokens for e in mb], pad)                     # [B, L]
        labels = ids.masked_fill(attn == 0, -100)
        for b, e in enumerate(mb):  # prompts are not trained on
            labels[b, : ids.shape[1] - len(e.tokens) + e.prompt_length] = -100
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=ids, attention_mask=attn, position_ids=pos, labels=labels).loss
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


def components(args, extra):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    cfg = run.parse_config(extra + ["--run-dir", tempfile.mkdtemp()] + (["--model", args.model] if args.model else []))
    path = run.resolve_model(cfg.model)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    train, held, ds = load_tasks(cfg.task, cfg.task_kwargs, cfg.train_size, 1, cfg.seed)
    engine = HFEngine(path, max_batch=cfg.explorer_max_batch, seed=cfg.seed, bf16=cfg.dtype == "bfloat16")
    ex = Explorer(cfg, engine, train, held, ds, print)
    trainer = Trainer(cfg, path, torch.device("cpu"))
    raw = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    raw_opt = torch.optim.AdamW(raw.parameters(), lr=0.0)
    prompts = [ex.workflow.prompt_ids(t) for t in ex.next_tasks(cfg.batch_size, {})]
    rows = {"explore": [], "generate": [], "train": [], "fwd_bwd": []}

    for rnd in range(args.rounds):
        rate, groups = explore_rate(ex, rnd)
        rows["explore"].append(rate)
        t = time.perf_counter()
        n_tok = raw_generate(raw, prompts, cfg.group_size, cfg.max_tokens, engine.pad, cfg.dtype == "bfloat16")
        rows["generate"].append(n_tok / (time.perf_counter() - t))
        exps = [e for g in groups for e in g]
        tokens = sum(len(e.tokens) for e in exps)
        t = time.perf_counter()
        trainer.step(groups)
        rows["train"].append(tokens / (time.perf_counter() - t))
        t = time.perf_counter()
        raw_train(raw, raw_opt, exps, cfg.token_budget, trainer.pad, cfg.dtype == "bfloat16")
        rows["fwd_bwd"].append(tokens / (time.perf_counter() - t))
    med = {k: sorted(v)[len(v) // 2] for k, v in rows.items()}
    print(f"components ({args.threads} thread(s), batch {cfg.batch_size} tasks x {cfg.group_size} rollouts, "
          f"median of {args.rounds} interleaved rounds):")
    print(f"  nanorft explorer   {med['explore']:7.1f} generated tokens/s | raw model.generate {med['generate']:7.1f}"
          f" | ratio {med['explore'] / med['generate']:.2f}")
    print(f"  nanorft train step {med['train']:7.1f} tokens/s           | raw fwd/bwd+AdamW  {med['fwd_bwd']:7.1f}"
          f" | ratio {med['train'] / med['fwd_bwd']:.2f}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model directory (default: the run.py default)")
    p.add_argument("--steps", type=int, default=5, help="pipeline steps (0 skips the pipeline)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the component timing")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    args, extra = p.parse_known_args()
    if args.steps:
        pipeline(args, extra)
    components(args, extra)


if __name__ == "__main__":
    main()
