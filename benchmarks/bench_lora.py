"""Full fine-tuning vs LoRA on the default job, side by side in one run.

    python benchmarks/bench_lora.py                          # full vs LoRA rank 8, 16, 64
    python benchmarks/bench_lora.py --ranks 16 --steps 3 [run.py flags...]

Part 1 runs `run.py --mode both --sync-interval 1` (a weight sync after every step) for
--steps steps once per setting, one after the other, and prints from each run's
metrics.jsonl (the first step dropped: start-up) the trainer's seconds per step and
tokens/s (computed tokens), the seconds the trainer spent sending weights, the megabytes a
sync carries (what the trainer publishes, float32: every weight, or the adapters), and the
peak RSS of trainer and explorer; then each ratio LoRA / full.
Part 2 times, in this process and interleaved (this machine is shared and noisy), the HF
engine's generation of one batch with the adapters unmerged (as nanorft's HF engine samples,
so that its log-probs are computed as the trainer's are) vs the same weights merged into the
model (peft merge_and_unload), tokens/s and their ratio.
Results: printed, and written to --out (JSON).
"""

import argparse
import copy
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import models  # noqa: E402
import run  # noqa: E402
from engines import HFEngine, Sampling  # noqa: E402
from extras.lora import LoraHFEngine, lora_config, published_parameters  # noqa: E402
from perf import cpu_model  # noqa: E402


def published_megabytes(model_path: str, rank: int, targets: str) -> float:
    """MiB of float32 that one weight sync carries: every weight (rank 0) or the LoRA adapters."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    if rank:
        cfg = run.parse_config(["--lora-rank", str(rank), "--lora-target-modules", targets])
        from peft import get_peft_model

        model = get_peft_model(model, lora_config(cfg))
    return (
        sum(
            p.numel()
            for _, p in (published_parameters(model) if rank else model.named_parameters())
        )
        * 4
        / 2**20
    )


def job(rank: int, args, extra: list[str]) -> dict:
    """The default job with `rank` (0 = full fine-tuning) for args.steps steps; means of its step records."""
    with tempfile.TemporaryDirectory() as d:
        cmd = [
            sys.executable,
            "run.py",
            "--run-dir",
            d,
            "--steps",
            str(args.steps),
            "--eval-size",
            "0",
            "--sync-interval",
            "1",
            "--lora-rank",
            str(rank),
        ] + extra
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        recs = [json.loads(x) for x in (Path(d) / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "reward/mean" in r][1:]  # the first step is start-up
    mean = lambda k: sum(r[k] for r in steps if k in r) / max(1, sum(k in r for r in steps))  # noqa: E731
    return {
        "rank": rank,
        "train_s_per_step": mean("time/train_s"),
        "train_tokens_per_s": mean("train/tokens_per_s"),
        "sync_s": mean("time/sync_s"),
        "trainer_peak_rss_gib": max(r["memory/trainer_peak_rss_gib"] for r in steps),
        "explorer_peak_rss_gib": max(r["memory/explorer_peak_rss_gib"] for r in steps),
    }


def generation(model_path: str, rank: int, rounds: int, threads: int) -> dict:
    """HF engine tokens/s on one default-job batch (64 sequences x 24 tokens), adapters
    unmerged vs merged, interleaved over `rounds`; the adapters get random B (a trained
    adapter's cost, not a fresh one's zeros)."""
    torch.set_num_threads(threads)
    cfg = run.parse_config(["--lora-rank", str(rank)])
    unmerged = LoraHFEngine(model_path, lora_config(cfg), max_batch=128)
    with torch.no_grad():
        for _, p in published_parameters(unmerged.model):
            p.normal_(0, 0.01)
    merged = HFEngine(model_path, max_batch=128)
    merged.model = copy.deepcopy(unmerged.model).merge_and_unload().eval()
    prompts = [[1, 9690, 198, 28, 1848, 17, 216, 34, 30, 216, 36, 2] + [42] * 20 for _ in range(8)]
    rates = {"unmerged": [], "merged": []}
    for _ in range(rounds):
        for name, engine in (("unmerged", unmerged), ("merged", merged)):
            t = time.perf_counter()
            out = engine.generate_batch(prompts, [8] * 8, Sampling(max_tokens=24))
            rates[name].append(
                sum(len(c.tokens) for cs in out for c in cs) / (time.perf_counter() - t)
            )
    best = {k: max(v) for k, v in rates.items()}
    return {
        "rank": rank,
        "unmerged_tokens_per_s": best["unmerged"],
        "merged_tokens_per_s": best["merged"],
        "unmerged_over_merged": best["unmerged"] / best["merged"],
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", default="8,16,64", help="LoRA ranks to compare with full fine-tuning")
    p.add_argument("--steps", type=int, default=4, help="steps per run (the first is dropped)")
    p.add_argument(
        "--rounds", type=int, default=3, help="interleaved rounds of the generation timing"
    )
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "lora.json"))
    args, extra = p.parse_known_args()
    ranks = [int(r) for r in args.ranks.split(",")]
    model_path = models.resolve_model(run.parse_config(extra).model)
    dtype, why = models.choose_dtype("auto", "cpu")
    print(f"CPU: {cpu_model()}, {torch.get_num_threads()} threads; precision auto: {dtype} ({why})")
    rows = []
    for rank in [0] + ranks:
        r = job(rank, args, extra)
        r["sync_mib"] = published_megabytes(
            model_path, rank, run.parse_config(extra).lora_target_modules
        )
        rows.append(r)
        print(
            f"{'full' if not rank else f'LoRA r={rank}':>10}: train {r['train_s_per_step']:.1f} s/step, "
            f"{r['train_tokens_per_s']:.0f} tokens/s; sync {r['sync_s']:.3f} s, {r['sync_mib']:.1f} MiB; "
            f"peak RSS trainer {r['trainer_peak_rss_gib']:.2f} GiB, explorer {r['explorer_peak_rss_gib']:.2f} GiB",
            flush=True,
        )
    full = rows[0]
    for r in rows[1:]:
        print(
            f"LoRA r={r['rank']} / full: s/step {r['train_s_per_step'] / full['train_s_per_step']:.2f}, "
            f"tokens/s {r['train_tokens_per_s'] / full['train_tokens_per_s']:.2f}, "
            f"sync s {r['sync_s'] / max(full['sync_s'], 1e-9):.3f}, sync MiB {r['sync_mib'] / full['sync_mib']:.4f}, "
            f"trainer peak RSS {r['trainer_peak_rss_gib'] / full['trainer_peak_rss_gib']:.2f}"
        )
    gen = generation(model_path, ranks[len(ranks) // 2], args.rounds, 1)
    print(
        f"HF engine, LoRA r={gen['rank']}, one batch: unmerged {gen['unmerged_tokens_per_s']:.0f} tokens/s, "
        f"merged {gen['merged_tokens_per_s']:.0f} tokens/s, unmerged / merged {gen['unmerged_over_merged']:.2f}"
    )
    Path(args.out).write_text(
        json.dumps(
            {
                "cpu": cpu_model(),
                "precision": dtype,
                "steps": args.steps,
                "jobs": rows,
                "generation": gen,
            },
            indent=2,
        )
    )
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
