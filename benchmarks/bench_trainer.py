"""nanorft's trainer step (`trainer.Trainer.step`, the real one) at realistic lengths next to a raw PyTorch loop on the
same sequences, in one process on one device.

    python benchmarks/bench_trainer.py --device cuda --json bench_trainer.json     # Qwen3-0.6B shape, ~2 min on an H100
    python benchmarks/bench_trainer.py --device cpu --shape tiny --lengths 64,128 --levers activation_checkpointing

Model: a Qwen3Config of `--shape` with random weights (nothing is downloaded), saved in bf16 with the SmolLM2 tokenizer
that benchmarks/gpu_check_files carries (the trainer reads only its pad id). One step's batch: one group of
max(2, --tokens-per-step / length) rollouts of `length` tokens each, the first 10% a prompt the group shares, the rest
a reply trained on in full, random rewards (GRPO advantages nonzero); token_budget = length, so each rollout fills one
row of `length` tokens, without padding, in nanorft and in the raw loop alike.
Raw loop: per rollout the HF model's forward (float32 parameters under bf16 autocast on CUDA, float32 on a CPU; sdpa,
causal, no mask), full logits, float32 log-softmax and gather of the taken tokens, a policy-gradient loss, backward;
then gradient clipping and AdamW (fused on CUDA); no activation checkpointing; peft adapters of the same LoRA config.
Timing: one warm-up step of each arm, then `--rounds` interleaved timed steps between CUDA synchronisations; medians.
The raw loop under torch.compile of the whole model (raw_compiled) is timed after the other two: its first step, which
compiles, starts only while `--compile-budget-s` is not spent (timed, `compile_s` in the JSON), else it is skipped.
`--json` is written after each arm's figures, so that a run cut short keeps what it measured.
tokens/s: sequence tokens trained per second. MFU: model FLOPs (6 x matmul parameters x tokens + 6 x LM head x reply
tokens + attention 12 x layers x heads x head_dim x length^2 per rollout, PaLM's count (arXiv:2204.02311 appendix B)
without a causal discount; no recomputation) over the nominal
dense bf16 peak of perf.CUDA_PEAKS (989 TFLOP/s for an H100), or a measured bf16 matmul on other GPUs; none on a CPU.
Peak memory: torch.cuda.max_memory_allocated over a timed step.
Levers (`--levers`): each is timed flipped from nanorft's default at the longest length with full fine-tuning:
causal_rows, fused_adamw, one_gpu_fsdp, checkpoint_if_needed, head_chunk_elems (0, i.e. 2**28 on a GPU -> 2**22),
activation_checkpointing, compile_layers: each a Config field, set in the arm's Config. Variants
that would start past `--budget-s` (counted from the model build) are skipped with a SKIP line.
"""

import argparse
import gc
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import components  # noqa: E402
import packing  # noqa: E402
from buffer import Experience  # noqa: E402
from config import Config, check_values  # noqa: E402

SHAPES = {  # Qwen3Config fields besides the vocabulary
    "qwen3-0.6b": dict(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rope_theta=1_000_000.0,
        tie_word_embeddings=True,
    ),
    "tiny": dict(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    ),
}
LEVERS = (
    "causal_rows",
    "head_chunk_elems",
    "fused_adamw",
    "one_gpu_fsdp",
    "checkpoint_if_needed",
    "activation_checkpointing",
    "compile_layers",
)
TOKENIZER = ROOT / "benchmarks" / "gpu_check_files" / "tokenizer"


def build_model(path: Path, shape: str) -> dict:
    """Save a random-weight Qwen3 of `shape` (bf16) and the carried tokenizer at `path`; its config fields."""
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    fields = SHAPES[shape]
    torch.manual_seed(0)
    with torch.device(
        "cuda" if torch.cuda.is_available() else "cpu"
    ):  # random init on the GPU where there is one
        model = Qwen3ForCausalLM(Qwen3Config(**fields, dtype="bfloat16")).to(torch.bfloat16)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(TOKENIZER).save_pretrained(path)
    del model
    return fields


def experiences(length: int, n: int, vocab: int, seed: int) -> list[Experience]:
    """One group of `n` rollouts of `length` random tokens: a shared prompt (10%) and replies; random rewards."""
    g = torch.Generator().manual_seed(seed)
    P = max(1, length // 10)
    prompt = torch.randint(vocab, (P,), generator=g).tolist()
    rewards = torch.rand(n, generator=g).tolist()
    return [
        Experience(
            prompt + torch.randint(vocab, (length - P,), generator=g).tolist(),
            P,
            [-math.log(vocab)] * (length - P),
            [1] * (length - P),
            rewards[i],
            f"g{seed}",
            f"t{seed}",
            0,
        )
        for i in range(n)
    ]


class RawLoop:
    """The plain loop (module docstring) on its own copy of the model; `compiled`: its forward under
    torch.compile (the whole model, as a user compiles it)."""

    def __init__(self, path: str, device: torch.device, cfg: Config, compiled: bool = False):
        from transformers import AutoModelForCausalLM

        self.device, self.bf16 = device, cfg.dtype == "bfloat16"
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="sdpa"
        ).to(device)
        if cfg.lora_rank:
            from peft import get_peft_model

            from extras.lora import lora_config

            model = get_peft_model(model, lora_config(cfg, path))
        self.model = model
        self.forward = torch.compile(model) if compiled else model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(
            self.params, lr=cfg.lr, betas=(0.9, 0.99), fused=device.type == "cuda" or None
        )

    def step(self, groups: list[list[Experience]]) -> None:
        exps = [e for g in groups for e in g]
        rewards = torch.tensor([e.reward for e in exps])
        adv = ((rewards - rewards.mean()) / (rewards.std() + 1e-6)).tolist()  # GRPO, one group
        total = sum(len(e.tokens) - e.prompt_length for e in exps)
        for e, a in zip(exps, adv):
            ids = torch.tensor(e.tokens, device=self.device)[None]  # [1, L]
            behaviour = torch.tensor(e.behaviour_logprobs, device=self.device)[None]  # [1, R]
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
                logits = self.forward(input_ids=ids, use_cache=False).logits[
                    :, e.prompt_length - 1 : -1
                ]  # [1, R, V]
            lp = (
                logits.float()
                .log_softmax(-1)
                .gather(-1, ids[:, e.prompt_length :, None])
                .squeeze(-1)
            )  # [1, R]
            ratio = (lp - behaviour).exp()  # [1, R]
            (-(ratio.clamp(0.8, 1.2) * a).sum() / total).backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def timed(device: torch.device, fn) -> tuple[float, float | None]:
    """(seconds, peak GiB allocated or None on a CPU) of fn()."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    t = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize(device)
    return time.perf_counter() - t, torch.cuda.max_memory_allocated(
        device
    ) / 2**30 if cuda else None


def model_flops(fields: dict, body: int, length: int, n: int) -> float:
    """Model FLOPs of training on `n` rollouts of `length` tokens: PaLM's count (arXiv:2204.02311
    appendix B), 6 per matmul parameter and token plus 12 x layers x heads x head_dim x length
    per token for attention, with no discount for the causal mask (module docstring)."""
    P = max(1, length // 10)
    layers = fields["num_hidden_layers"]
    heads = fields["num_attention_heads"]
    attention = 12 * layers * heads * fields["head_dim"] * length**2  # per rollout
    return n * (
        6 * body * length
        + 6 * fields["vocab_size"] * fields["hidden_size"] * (length - P)
        + attention
    )


class Bench:
    def __init__(self, args, device: torch.device, path: str, fields: dict):
        from models import choose_dtype
        from perf import matmul_params, peak_flops

        self.args, self.device, self.path, self.fields = args, device, path, fields
        self.dtype = choose_dtype("auto", device.type)[0]
        self.body = matmul_params(path)[0]
        self.peak = peak_flops("cuda", "bfloat16") if device.type == "cuda" else 0.0
        self.rows, self.skipped, self.start = [], [], time.perf_counter()
        self.compiles: list[dict] = []  # each compiling first step: arm, rank, length, seconds

    def over_budget(self, what: str) -> bool:
        spent = time.perf_counter() - self.start
        if spent > self.args.budget_s:
            print(
                f"SKIP {what}: {spent:.0f} s spent of --budget-s {self.args.budget_s:.0f}",
                flush=True,
            )
            self.skipped.append(what)
        return spent > self.args.budget_s

    def config(self, rank: int, length: int, **overrides) -> Config:
        cfg = Config(
            model=self.path,
            dtype=self.dtype,
            lora_rank=rank,
            token_budget=length,
            lr=1e-6,
            lr_warmup_steps=0,
            group_size=2,
            **overrides,
        )
        check_values(cfg)
        return cfg

    def measure(self, arms: dict, rank: int, length: int, lever: str) -> None:
        """Warm-up and interleaved timed rounds of `arms` (name -> step(groups)) at `length`; one row per arm."""
        n = max(2, self.args.tokens_per_step // length)
        groups = [
            [experiences(length, n, self.fields["vocab_size"], seed)]
            for seed in range(self.args.rounds + 1)
        ]
        times: dict = {a: [] for a in arms}
        peaks: dict = dict.fromkeys(arms, None)
        for r, g in enumerate(groups):  # round 0 warms up (kernels, allocator, compilation)
            for a, step in arms.items():
                s, peak = timed(self.device, lambda: step(g))
                if r:
                    times[a].append(s)
                    peaks[a] = peak if peaks[a] is None else max(peaks[a], peak)
        flops = model_flops(self.fields, self.body, length, n)
        for a in arms:
            s = statistics.median(times[a])
            row = {
                "arm": a,
                "lora_rank": rank,
                "length": length,
                "lever": lever,
                "rollouts": n,
                "tokens_per_step": n * length,
                "step_s": s,
                "tokens_per_s": n * length / s,
                "mfu": flops / s / self.peak if self.peak else None,
                "peak_gib": peaks[a],
            }
            self.rows.append(row)
            mfu = f"{row['mfu']:6.1%}" if row["mfu"] is not None else "     -"
            mem = f"{row['peak_gib']:6.1f}" if row["peak_gib"] is not None else "     -"
            print(
                f"{a:12} r{rank:<3} {length:6} {lever:26} {row['tokens_per_s']:10,.0f} {mfu} {mem} "
                f"{s:7.3f}",
                flush=True,
            )

    def compiled(self, step, rank: int, length: int) -> bool:
        """Run raw_compiled's first, compiling, step at `length` if --compile-budget-s is not spent
        (a SKIP line else); whether it ran."""
        spent = sum(c["seconds"] for c in self.compiles)
        what = f"raw_compiled lora_rank {rank} length {length}"
        if spent >= self.args.compile_budget_s:
            print(
                f"SKIP {what}: {spent:.0f} s compiled of --compile-budget-s "
                f"{self.args.compile_budget_s:.0f}",
                flush=True,
            )
            self.skipped.append(what)
            return False
        n = max(2, self.args.tokens_per_step // length)
        group = [experiences(length, n, self.fields["vocab_size"], 0)]
        seconds, _ = timed(self.device, lambda: step(group))
        self.compiles.append(
            {"arm": "raw_compiled", "lora_rank": rank, "length": length, "seconds": seconds}
        )
        print(f"compiled {what} in {seconds:.1f} s", flush=True)
        return True

    def results(self) -> dict:
        """The JSON record of what was measured so far."""
        device = self.device
        out = {
            "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "shape": self.args.shape,
            "matmul_params": self.body,
            "dtype": self.dtype,
            "peak_flops": self.peak,
            "peak_source": "perf.CUDA_PEAKS nominal (or measured)" if self.peak else None,
            "defaults": {lever: getattr(Config, lever) for lever in LEVERS},
            "head_chunk_elems_by_device": packing.HEAD_CHUNK_ELEMS,
            "rows": self.rows,
            "skipped": self.skipped,
            "compile_s": self.compiles,
            "seconds": time.perf_counter() - self.start,
        }
        # nanorft's tokens/s over each raw loop's, with the default settings
        speed = {
            (r["arm"], r["lora_rank"], r["length"]): r["tokens_per_s"]
            for r in self.rows
            if r["lever"] == "default"
        }
        for (arm, rank, length), tokens_per_s in speed.items():
            ours = speed.get(("nanorft", rank, length))
            if arm != "nanorft" and ours is not None:
                out.setdefault(f"nanorft_vs_{arm}", {})[f"r{rank}_{length}"] = ours / tokens_per_s
        return out

    def save(self) -> None:
        """--json: the results so far (written whole, then renamed: never half a file)."""
        if self.args.json:
            partial = Path(self.args.json + ".partial")
            partial.write_text(json.dumps(self.results(), indent=2))
            partial.replace(self.args.json)

    def trainer(self, cfg: Config):
        return components.make_trainer(cfg, self.path, self.device)

    def free(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def flip(lever: str) -> dict:
    """The Config overrides that set lever `lever` (a Config field) away from its default."""
    if lever == "head_chunk_elems":
        return {lever: 2**22}
    return {lever: not getattr(Config, lever)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--shape", default="qwen3-0.6b", choices=tuple(SHAPES))
    p.add_argument(
        "--lengths", default="2048,8192", help="sequence lengths (tokens), comma-separated"
    )
    p.add_argument("--lora-ranks", default="0,16", help="0 = full fine-tuning, comma-separated")
    p.add_argument(
        "--levers",
        default="compile_layers,checkpoint_if_needed,causal_rows,head_chunk,one_gpu_fsdp",
        help=f"levers to time flipped, of {', '.join(LEVERS)}",
    )
    p.add_argument("--tokens-per-step", type=int, default=16384)
    p.add_argument(
        "--rounds", type=int, default=3, help="timed steps per arm after one warm-up step"
    )
    p.add_argument(
        "--budget-s", type=float, default=150.0, help="variants after this many seconds are skipped"
    )
    p.add_argument(
        "--compile-budget-s",
        type=float,
        default=math.inf,
        help="raw_compiled's compiling first step starts only while fewer seconds were compiled",
    )
    p.add_argument("--json", default="", help="write the results here (after each arm)")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_trainer: no CUDA device (use --device cpu --shape tiny)", file=sys.stderr)
        return 2
    lengths = [int(x) for x in args.lengths.split(",")]
    ranks = [int(x) for x in args.lora_ranks.split(",")]
    levers = [x for x in args.levers.split(",") if x]
    if unknown := set(levers) - set(LEVERS):
        p.error(f"unknown levers {sorted(unknown)}; known: {', '.join(LEVERS)}")
    if args.device == "cuda":
        import launch

        _, _, device = launch.init_distributed()
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    with tempfile.TemporaryDirectory(prefix="bench_trainer_") as d:
        t0 = time.perf_counter()
        fields = build_model(Path(d) / "model", args.shape)
        bench = Bench(args, device, str(Path(d) / "model"), fields)
        bench.start = t0
        print(
            f"model {args.shape}: {bench.body / 1e6:.0f}M matmul parameters, built in {time.perf_counter() - t0:.1f} s;"
            f" {device} {torch.cuda.get_device_name(device) if device.type == 'cuda' else ''} {bench.dtype}; "
            f"peak {bench.peak / 1e12:.0f} TFLOP/s"
            + (" (nominal)" if device.type == "cuda" else ""),
            flush=True,
        )
        print(
            "MFU: PaLM's model FLOPs (arXiv:2204.02311 app. B: 6N + 12 L H Q T per token, no causal discount)"
        )
        print(
            f"{'arm':12} {'rank':4} {'length':>6} {'lever':26} {'tokens/s':>10} {'MFU':>6} {'GiB':>6} {'step_s':>7}"
        )
        for rank in ranks:  # nanorft and the raw loop with nanorft's defaults
            if bench.over_budget(f"lora_rank {rank}"):
                continue
            cfg = bench.config(rank, lengths[0])
            tr = bench.trainer(cfg)
            raw = RawLoop(bench.path, device, cfg)
            raw_compiled = RawLoop(bench.path, device, cfg, compiled=True)
            arms = {"nanorft": tr.step, "raw": raw.step}
            for length in lengths:
                if bench.over_budget(f"lora_rank {rank} length {length}"):
                    continue
                tr.cfg.token_budget = length
                bench.measure(arms, rank, length, "default")
                bench.save()
                if bench.compiled(raw_compiled.step, rank, length):
                    bench.measure({"raw_compiled": raw_compiled.step}, rank, length, "default")
                    bench.save()
            del tr, raw, raw_compiled, arms
            bench.free()
        length = max(lengths)
        for (
            lever
        ) in levers:  # each lever flipped from the default, full fine-tuning at the longest length
            if bench.over_budget(f"lever {lever}"):
                continue
            (value,) = flip(lever).values()
            shown = ("on" if value else "off") if isinstance(value, bool) else value
            tr = bench.trainer(bench.config(0, length, **flip(lever)))
            try:
                bench.measure({"nanorft": tr.step}, 0, length, f"{lever}={shown}")
                bench.save()
            finally:
                del tr
                bench.free()
    out = bench.results()
    for arm in ("raw", "raw_compiled"):
        for cell, ratio in out.get(f"nanorft_vs_{arm}", {}).items():
            print(f"nanorft / {arm}  {cell}: {ratio:.2f}x")
    print(f"total {out['seconds']:.0f} s")
    bench.save()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
