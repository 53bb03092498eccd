"""Seconds per step and its split, next to raw PyTorch/transformers loops on the same batch,
in float32 and in bf16 on this machine.

    python benchmarks/bench_step.py                      # default model and task
    python benchmarks/bench_step.py --model DIR --steps 4 --threads 1 [run.py flags...]
    python benchmarks/bench_step.py --steps 0 --dtypes float32   # components only, one precision
    python benchmarks/bench_step.py --kv-cache-ab --dtypes float32 --threads 2 [run.py flags]
    python benchmarks/bench_step.py --drop-ended-ab --model RUN/final --dtypes float32 --threads 2
    python benchmarks/bench_step.py --decode-split --dtypes bfloat16 --threads 1 --engine hf
    python benchmarks/bench_step.py --trainer-weights-ab --threads 1 --rounds 5 --engine hf
    python benchmarks/bench_step.py --head-grad-ab --threads 2 --rounds 6 --engine hf
    python benchmarks/bench_step.py --max-batch-ab --dtypes bfloat16 --threads 1 --rounds 3 --engine hf
    python benchmarks/bench_step.py --packed-linear-ab batch --dtypes bfloat16 --threads 1 --rounds 5 --engine hf

It first prints the CPU capability and the precision `--dtype auto` picks here (and why),
then the machine's limit: matrix-product GFLOP/s and memory bandwidth for 1 .. all cores.
Part 1 runs `run.py --mode both` for a few steps (precision auto) and prints the mean
seconds per step and where they went (explore / train / sync / trainer waiting), the peak
RSS of each process, the CPU utilisation of the job, the model FLOPs of one step and the
MFU of trainer, explorer and job, from metrics.jsonl.
Part 2 times, in this process with the same thread count and interleaved (this machine is
shared and noisy), nanorft's explorer on one batch vs raw `model.generate` on the same
prompts, and nanorft's trainer step vs a raw forward/backward/AdamW loop on the same
sequences, in each precision of --dtypes; it prints tokens/s, the ratios nanorft / raw and,
side by side, bf16 / float32 for each.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import models  # noqa: E402
import run  # noqa: E402
from components import explorer_parts, load_tasks, make_trainer, resolve_model  # noqa: E402
from engines import HFEngine  # noqa: E402
from explorer import Explorer  # noqa: E402
from models import choose_dtype  # noqa: E402
from packing import left_pad  # noqa: E402
from perf import PackedLinear, cpu_model, measure_matmul, pack_linear_weights  # noqa: E402


def pipeline(args, extra):
    with tempfile.TemporaryDirectory() as d:
        cmd = (
            [
                sys.executable,
                "run.py",
                "--run-dir",
                d,
                "--overwrite",
                "--steps",
                str(args.steps),
                "--eval-size",
                "0",
                "--explorer-threads",
                str(args.threads),
                "--trainer-threads",
                str(args.threads),
            ]
            + (["--model", args.model] if args.model else [])
            + extra
        )
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        recs = [json.loads(x) for x in (Path(d) / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "reward/mean" in r][1:]  # drop the first step (start-up)
    mean = lambda k: sum(r.get(k, 0.0) for r in steps) / len(steps)  # noqa: E731
    peak = lambda k: max(r.get(k, 0.0) for r in steps)  # noqa: E731
    per_step = (steps[-1]["time/elapsed_s"] - steps[0]["time/elapsed_s"]) / max(1, len(steps) - 1)
    print(f"pipeline ({args.steps} steps, {args.threads} thread(s) each for explorer and trainer):")
    print(f"  seconds per step            {per_step:8.1f}")
    for k in ("time/explore_s", "time/train_s", "time/sync_s", "time/wait_s"):
        print(
            f"  {k:<28}{mean(k):8.1f}   (explorer runs concurrently with the trainer)"
            if k == "time/explore_s"
            else f"  {k:<28}{mean(k):8.1f}"
        )
    print(f"  trainer peak RSS            {peak('memory/trainer_peak_rss_gib'):8.2f} GiB")
    print(f"  explorer peak RSS           {peak('memory/explorer_peak_rss_gib'):8.2f} GiB")
    print(
        f"  CPU utilisation             {mean('cpu/utilisation_pct'):8.0f} %   (both processes; 100 % = one core)"
    )
    flops = mean("perf/trainer_model_flops") + mean("perf/explorer_model_flops")
    print(
        f"  model FLOPs per step        {flops / 1e12:8.3f} T   (trainer {mean('perf/trainer_model_flops') / 1e12:.3f}, "
        f"explorer {mean('perf/explorer_model_flops') / 1e12:.3f}; 6N per trained token, 2N per prefilled or sampled)"
    )
    for k in ("perf/trainer_mfu", "perf/explorer_mfu", "perf/job_mfu"):
        print(f"  {k:<28}{mean(k):8.3f}")


def limit(max_threads: int) -> None:
    """The machine's limit: matrix-product FLOP/s per thread count (float32; bf16 where
    native) and memory bandwidth (a copy of 256 MiB)."""
    print("the limit:")
    dtypes = [torch.float32] + ([torch.bfloat16] if models.native_bf16("cpu") else [])
    before = torch.get_num_threads()
    for threads in range(1, max_threads + 1):
        torch.set_num_threads(threads)
        rates = ", ".join(
            f"{str(d).split('.')[1]} {measure_matmul(torch.device('cpu'), d, 1024) / 1e9:6.1f}"
            for d in dtypes
        )
        print(f"  {threads} thread(s): matrix products (1024 x 1024) GFLOP/s: {rates}")
        a = torch.empty(2**26)
        b = torch.empty_like(a)
        b.copy_(a)
        t = time.perf_counter()
        for _ in range(5):
            b.copy_(a)
        print(
            f"  {threads} thread(s): memory bandwidth (copy of 256 MiB) {2 * 5 * a.nbytes / (time.perf_counter() - t) / 1e9:6.1f} GB/s"
        )
    torch.set_num_threads(before)


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
    plan = ex.plan_batch(rnd, sink)
    ex.write_batch(plan, ex.rollout(plan.tasks), sink)
    return sum(len(e.behaviour_logprobs) for g in sink.groups for e in g) / (
        time.perf_counter() - t
    ), sink.groups


def raw_generate(model, prompts, n, max_tokens, pad, bf16):
    seqs = [p for p in prompts for _ in range(n)]
    P = max(map(len, seqs))
    ids = torch.tensor([[pad] * (P - len(p)) + p for p in seqs])
    attn = (torch.arange(P)[None, :] >= torch.tensor([P - len(p) for p in seqs])[:, None]).long()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        out = model.generate(
            input_ids=ids,
            attention_mask=attn,
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_new_tokens=max_tokens,
            pad_token_id=pad,
        )
    gen = out[:, P:]  # [B, R], padded with pad after the end token
    after_end = (gen == pad).long().cumsum(1) - (
        gen == pad
    ).long() > 0  # positions past the first end token
    return int((~after_end).sum())  # generated tokens, the end token included


def raw_train(model, opt, exps, token_budget, pad, bf16):
    """The plain way: every sequence padded in full (prompt included), HF's loss on the responses."""
    per_mb = max(1, token_budget // max(len(e.tokens) for e in exps))
    for i in range(0, len(exps), per_mb):
        mb = exps[i : i + per_mb]
        ids, attn, pos = left_pad([e.tokens for e in mb], pad)  # [B, L]
        labels = ids.masked_fill(attn == 0, -100)
        for b, e in enumerate(mb):  # prompts are not trained on
            labels[b, : ids.shape[1] - len(e.tokens) + e.prompt_length] = -100
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=ids, attention_mask=attn, position_ids=pos, labels=labels).loss
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


def setup(args, extra, dtype: str) -> dict:
    """nanorft's explorer and trainer and a raw model + AdamW, all in `dtype`."""
    from transformers import AutoModelForCausalLM

    cfg = run.parse_config(
        extra
        + ["--run-dir", tempfile.mkdtemp(), "--dtype", dtype]
        + (["--model", args.model] if args.model else [])
    )
    path = resolve_model(cfg.model)
    train, held, ds = load_tasks(cfg.task, cfg.task_kwargs, cfg.train_size, cfg.eval_size, cfg.seed)
    # the engine a run of these settings makes (bf16 weights for --dtype bfloat16)
    engine = HFEngine(path, **HFEngine.settings(cfg, cfg.seed, "cpu"))
    pack_linear_weights(engine.model)  # as components.make_engine does
    raw = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return {
        "cfg": cfg,
        "ex": Explorer(cfg, engine, train, held, ds, print, explorer_parts(cfg)),
        "pad": engine.pad,
        "trainer": make_trainer(cfg, path, torch.device("cpu")),
        "raw": raw,
        "raw_opt": torch.optim.AdamW(raw.parameters(), lr=0.0),
    }


def components(args, extra):
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    dtypes = args.dtypes.split(",")
    setups = {d: setup(args, extra, d) for d in dtypes}
    rows = {(d, k): [] for d in dtypes for k in ("explore", "generate", "train", "fwd_bwd")}
    for rnd in range(args.rounds):
        for d, s in setups.items():  # the precisions interleaved, round by round
            cfg, bf16 = s["cfg"], d == "bfloat16"
            rate, groups = explore_rate(s["ex"], rnd)
            rows[d, "explore"].append(rate)
            prompts = [g[0].tokens[: g[0].prompt_length] for g in groups]  # the tasks just explored
            t = time.perf_counter()
            n_tok = raw_generate(s["raw"], prompts, cfg.group_size, cfg.max_tokens, s["pad"], bf16)
            rows[d, "generate"].append(n_tok / (time.perf_counter() - t))
            exps = [e for g in groups for e in g]
            tokens = sum(len(e.tokens) for e in exps)
            t = time.perf_counter()
            s["trainer"].step(groups)
            rows[d, "train"].append(tokens / (time.perf_counter() - t))
            t = time.perf_counter()
            raw_train(s["raw"], s["raw_opt"], exps, cfg.token_budget, s["trainer"].pad, bf16)
            rows[d, "fwd_bwd"].append(tokens / (time.perf_counter() - t))
    med = {k: sorted(v)[len(v) // 2] for k, v in rows.items()}
    cfg = setups[dtypes[0]]["cfg"]
    print(
        f"components ({args.threads} thread(s), batch {cfg.batch_size} tasks x {cfg.group_size} rollouts, "
        f"median of {args.rounds} interleaved rounds):"
    )
    for d in dtypes:
        print(
            f"  {d:<9} nanorft explorer   {med[d, 'explore']:7.1f} generated tokens/s | raw model.generate "
            f"{med[d, 'generate']:7.1f} | ratio {med[d, 'explore'] / med[d, 'generate']:.2f}"
        )
        print(
            f"  {d:<9} nanorft train step {med[d, 'train']:7.1f} tokens/s           | raw fwd/bwd+AdamW  "
            f"{med[d, 'fwd_bwd']:7.1f} | ratio {med[d, 'train'] / med[d, 'fwd_bwd']:.2f}"
        )
    if len(dtypes) == 2:
        a, b = dtypes
        for k, name in (
            ("explore", "nanorft explorer"),
            ("train", "nanorft train step"),
            ("generate", "raw model.generate"),
            ("fwd_bwd", "raw fwd/bwd+AdamW"),
        ):
            print(f"  {b} / {a} speed, {name:<19} {med[b, k] / med[a, k]:5.2f}")


def concat_cache():
    """The HF engine's KV cache as transformers makes it: each decode step concatenates (the
    lever's "off": `reserve` does nothing)."""
    from transformers.cache_utils import Cache, DynamicLayer

    class ConcatLayer(DynamicLayer):
        def reserve(self, capacity: int) -> None:
            pass

        def keep(self, rows: torch.Tensor) -> None:
            self.reorder_cache(rows)

    return Cache(layer_class_to_replicate=ConcatLayer)


def lever_ab(args, extra, name: str, variants: dict, work) -> None:
    """Time `work(explorer, rnd)` -> (seconds, outputs) with each of `variants` (name -> a
    function that switches the lever on or off), interleaved round by round from the same
    sampler seed; prints the medians and whether the outputs were the same."""
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    dtype = args.dtypes.split(",")[0]
    ex = setup(args, extra, dtype)["ex"]
    seed, rows = ex.engine.generator.initial_seed(), {}
    for rnd in range(args.rounds):
        for key, switch in variants.items():
            switch(ex.engine)
            ex.engine.generator.manual_seed(seed + rnd)
            rows.setdefault(key, []).append(work(ex, rnd))
    (a, ra), (b, rb) = rows.items()
    same = all(x[1] == y[1] for x, y in zip(ra, rb))
    med = {k: sorted(t for t, _ in v)[len(v) // 2] for k, v in rows.items()}
    print(
        f"{name} ({args.threads} thread(s), {dtype}, median of {args.rounds} interleaved rounds): {a} "
        f"{med[a]:.2f} s, {b} {med[b]:.2f} s, ratio {med[b] / med[a]:.2f}; the same outputs: {same}"
    )


def explorer_batch(ex, rnd: int) -> tuple[float, list]:
    """`lever_ab`'s work: one explorer batch -> (seconds, the sampled sequences' tokens)."""
    t = time.perf_counter()
    _, groups = explore_rate(ex, rnd)
    return time.perf_counter() - t, [e.tokens for g in groups for e in g]


def kv_cache_ab(args, extra):
    """--kv-cache-ab: one explorer batch with the engine's KV cache writing into reserved room
    (engines.decode_cache) and with concatenation, the same sampled tokens."""
    import engines

    reserved = engines.decode_cache
    lever_ab(
        args,
        extra,
        "KV cache of the HF engine, one explorer batch",
        {
            "concatenated": lambda e: setattr(engines, "decode_cache", concat_cache),
            "reserved": lambda e: setattr(engines, "decode_cache", reserved),
        },
        explorer_batch,
    )


def evaluation(ex, rnd: int) -> tuple[float, tuple]:
    """`lever_ab`'s work: one held-out evaluation (greedy, then --eval-k samples per task) ->
    (seconds, (the greedy accuracy, the mean reply length))."""
    t = time.perf_counter()
    r = ex.evaluate(1)
    return time.perf_counter() - t, (r["eval/accuracy"], r["eval/response_len"])


def drop_ended_ab(args, extra):
    """--drop-ended-ab: one held-out evaluation with the rows that have ended kept in the decode
    batch and dropped from it; the greedy replies must be the same (the samples differ: fewer
    rows draw fewer random numbers)."""
    lever_ab(
        args,
        extra,
        "ended rows in the HF engine's decode batch, one evaluation",
        {
            "kept": lambda e: setattr(e, "drop_ended", 2.0),
            "dropped": lambda e: setattr(e, "drop_ended", 0.25),
        },
        evaluation,
    )


def max_batch_ab(args, extra):
    """--max-batch-ab: one held-out evaluation (400 sampled rollouts at the default --eval-k) with
    the HF engine decoding at most 128 rows at a time and at most 256; the greedy replies (100 rows
    either way) must be the same."""
    lever_ab(
        args,
        extra,
        "rows per decode batch of the HF engine, one evaluation",
        {
            "128": lambda e: setattr(e, "max_batch", 128),
            "256": lambda e: setattr(e, "max_batch", 256),
        },
        evaluation,
    )


def plain_linears(model) -> None:
    """Each perf.PackedLinear of `model` back to a torch.nn.Linear of the same parameters."""
    for name, m in list(model.named_modules()):
        if isinstance(m, PackedLinear):
            out_features, in_features = m.weight.shape
            linear = torch.nn.Linear(in_features, out_features, bias=False, device="meta")
            linear.weight = m.weight
            linear.bias = m.bias
            model.set_submodule(name, linear)


def packed_linear_ab(args, extra):
    """--packed-linear-ab batch|evaluation: one explorer batch, or one held-out evaluation, with
    the HF engine's bf16 linear layers on F.linear (the weight reordered by oneDNN at each call)
    and on weights reordered once (perf.pack_linear_weights); the same outputs."""
    lever_ab(
        args,
        extra,
        f"linear layers of the HF engine, one {'explorer batch' if args.packed_linear_ab == 'batch' else 'evaluation'}",
        {
            "F.linear": lambda e: plain_linears(e.model),
            "packed": lambda e: pack_linear_weights(e.model),
        },
        explorer_batch if args.packed_linear_ab == "batch" else evaluation,
    )


def attention_ab(args, extra):
    """--attention-ab: one explorer batch with each decode step's grouped-query heads as the query rows of one
    attention per key-value head (packing.grouped_decode_attention) and with transformers' sdpa attention (its
    keys and values repeated per query head under a mask); the same sampled tokens unless roundings differ."""
    from packing import packed_sdpa

    lever_ab(
        args,
        extra,
        "decode attention of the HF engine, one explorer batch",
        {
            "repeated": lambda e: e.model.set_attn_implementation("sdpa"),
            "grouped": lambda e: e.model.set_attn_implementation(packed_sdpa()),
        },
        explorer_batch,
    )


# operator families of a decode step's self CPU time (torch.profiler names)
DECODE_FAMILIES = {
    "linear layers": ("aten::mm", "aten::addmm", "mkldnn::_linear_pointwise"),
    "attention": ("aten::_scaled_dot_product",),
}


def linear_ms(rows: int, k: int, n: int, dtype: torch.dtype, calls: int = 200) -> float:
    """Milliseconds of one [rows, k] x [k, n] linear layer as the engine computes it (bf16 on
    packed weights where oneDNN computes bf16), best of 3 runs of `calls`."""
    x = torch.randn(rows, k, dtype=dtype)
    layer = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False, dtype=dtype))
    pack_linear_weights(layer)
    best = float("inf")
    with torch.no_grad():
        for _ in range(3):
            t = time.perf_counter()
            for _ in range(calls):
                layer(x)
            best = min(best, (time.perf_counter() - t) / calls)
    return best * 1e3


def decode_split(args, extra):
    """--decode-split: where one explorer batch's time goes (torch.profiler's self CPU time by
    operator family), against the floor of its linear layers' FLOPs at this process's matrix-
    product peak (perf.peak_flops); then one MLP projection's cost at the batch's rows and at
    twice as many (two batches of one weight version decoded together)."""
    from torch.profiler import ProfilerActivity, profile

    from perf import generate_flops, matmul_params, peak_flops

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    dtype = args.dtypes.split(",")[0]
    ex = setup(args, extra, dtype)["ex"]
    engine = ex.engine
    explorer_batch(ex, 0)  # warm-up
    before = engine.prefilled_tokens, engine.sampled_tokens
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        seconds, seqs = explorer_batch(ex, 1)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events) / 1e6
    prefilled = engine.prefilled_tokens - before[0]
    sampled = engine.sampled_tokens - before[1]
    linear_flops = generate_flops(*matmul_params(engine.loaded_from), prefilled, sampled)
    peak = peak_flops("cpu", dtype, args.threads)
    print(
        f"one explorer batch ({len(seqs)} rollouts, {dtype}, {args.threads} thread(s)): {seconds:.2f} s, "
        f"{total:.2f} s of operator time"
    )
    named = 0.0
    for family, prefixes in DECODE_FAMILIES.items():
        t = sum(e.self_cpu_time_total for e in events if e.key.startswith(prefixes)) / 1e6
        named += t
        print(f"  {family:<14} {t:6.2f} s ({t / total:.0%})")
    print(f"  {'the rest':<14} {total - named:6.2f} s ({(total - named) / total:.0%}), of which:")
    families = tuple(x for prefixes in DECODE_FAMILIES.values() for x in prefixes)
    rest = sorted(
        (e for e in events if not e.key.startswith(families)), key=lambda e: -e.self_cpu_time_total
    )
    for e in rest[:8]:
        print(f"    {e.key:<32} {e.self_cpu_time_total / 1e6:6.2f} s, {e.count} calls")
    print(
        f"  floor of the linear layers: {linear_flops / 1e9:.0f} GFLOP (the model's) at {peak / 1e12:.2f} TFLOP/s = "
        f"{linear_flops / peak:.2f} s"
    )
    H = engine.model.config.hidden_size
    inter = engine.model.config.intermediate_size
    dt = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    rows = len(seqs)
    one, two = linear_ms(rows, H, inter, dt), linear_ms(2 * rows, H, inter, dt)
    print(
        f"  an MLP projection [{rows}, {H}] x [{H}, {inter}]: {one:.3f} ms; at {2 * rows} rows "
        f"{two:.3f} ms ({two / one:.2f}x the time for 2x the rows)"
    )


def trainer_ab(args, s: dict, name: str, arms: dict) -> None:
    """The explorer's batches (`s`: `setup`'s), each trained on by every arm (name -> a step
    function of the groups, returning its metrics) in turn, the order alternating, round 0 a
    warm-up; the medians, each step's policy loss printed beside its time."""
    rows = {k: [] for k in arms}
    for rnd in range(args.rounds + 1):
        _, groups = explore_rate(s["ex"], rnd)
        order = list(arms.items()) if rnd % 2 else list(arms.items())[::-1]
        for arm, step in order:
            t = time.perf_counter()
            m = step(groups)
            if rnd:
                rows[arm].append(time.perf_counter() - t)
            print(
                f"round {rnd} {arm}: {time.perf_counter() - t:.2f} s, loss/policy {m['loss/policy']:.4f}",
                flush=True,
            )
    med = {k: sorted(v)[len(v) // 2] for k, v in rows.items()}
    (a, ta), (b, tb) = med.items()
    print(
        f"{name} ({args.threads} thread(s), median of {args.rounds} interleaved rounds): {a} "
        f"{ta:.2f} s, {b} {tb:.2f} s per step, ratio {tb / ta:.3f}"
    )


def trainer_weights_ab(args, extra):
    """A trainer step as a run takes it in bf16 (float32 weights, each cast to bf16 by autocast
    at every use, the recomputation's included, and each gradient cast back) against one on the
    same trainer's weights held in bf16 (no casts): the upper bound of keeping bf16 weights with a
    float32 copy for AdamW, which this arm leaves out (its AdamW updates the bf16 weights, which a
    run could not use: updates below bf16's resolution are lost). `trainer_ab`'s comparison."""
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    s = setup(args, extra, "bfloat16")
    cfg = s["cfg"]
    # float32 settings: no autocast; the weights then go to bf16
    plain = run.parse_config(extra + ["--run-dir", cfg.run_dir, "--dtype", "float32"])
    held = make_trainer(plain, resolve_model(cfg.model), torch.device("cpu"))
    held.model.to(torch.bfloat16)
    arms = {"float32 weights, autocast": s["trainer"].step, "bf16 weights": held.step}
    trainer_ab(args, s, "trainer weights", arms)


def compile_ab(args, extra):
    """A trainer step (bf16) with its decoder blocks run eagerly against one with them compiled
    (`perf.compiled`: one graph for every packed length, as a run on a bf16 CPU with a C++
    compiler has them); round 0, the warm-up, compiles. `trainer_ab`'s comparison."""
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    s = setup(args, extra + ["--no-compile-layers"], "bfloat16")
    cfg = s["cfg"]
    settings = run.parse_config(extra + ["--run-dir", cfg.run_dir, "--dtype", "bfloat16"])
    compiled = make_trainer(settings, resolve_model(cfg.model), torch.device("cpu"))
    arms = {"eager blocks": s["trainer"].step, "compiled blocks": compiled.step}
    trainer_ab(args, s, "trainer's decoder blocks", arms)


def head_grad_ab(args, extra):
    """A trainer step (bf16) with the LM head's weight gradient taken in one [V, H] product per
    chunk against one per `packing.HEAD_GRAD_CHUNKS["cpu"]` chunks: the same trainer, `trainer_ab`'s
    comparison."""
    import packing

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    s = setup(args, extra, "bfloat16")
    chunks = packing.HEAD_GRAD_CHUNKS["cpu"]

    def with_chunks(n: int):
        def step(groups):
            packing.HEAD_GRAD_CHUNKS["cpu"] = n
            return s["trainer"].step(groups)

        return step

    arms = {"1 chunk per product": with_chunks(1), f"{chunks} chunks": with_chunks(chunks)}
    trainer_ab(args, s, "LM head's weight gradient", arms)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model directory (default: the run.py default)")
    p.add_argument("--steps", type=int, default=5, help="pipeline steps (0 skips the pipeline)")
    p.add_argument(
        "--rounds", type=int, default=3, help="interleaved rounds of the component timing"
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument(
        "--dtypes",
        default="float32,bfloat16",
        help="precisions of the component timing, comma-separated",
    )
    p.add_argument(
        "--kv-cache-ab",
        action="store_true",
        help="only time one explorer batch with the KV cache written in place vs concatenated",
    )
    p.add_argument(
        "--drop-ended-ab",
        action="store_true",
        help="only time one held-out evaluation with ended rows kept in vs dropped from the decode batch "
        "(give a trained --model: the base model's replies run to the budget)",
    )
    p.add_argument(
        "--attention-ab",
        action="store_true",
        help="only time one explorer batch with grouped-query decode attention vs transformers' sdpa (repeat_kv)",
    )
    p.add_argument(
        "--decode-split",
        action="store_true",
        help="only profile one explorer batch: linear layers, attention and the rest against the floor",
    )
    p.add_argument(
        "--max-batch-ab",
        action="store_true",
        help="only time one held-out evaluation with the HF engine decoding at most 128 vs 256 rows at a time",
    )
    p.add_argument(
        "--packed-linear-ab",
        choices=("batch", "evaluation"),
        help="only time one explorer batch or one evaluation with the HF engine's linear layers on F.linear vs packed weights",
    )
    p.add_argument(
        "--head-grad-ab",
        action="store_true",
        help="only time trainer steps with the LM head's weight gradient in one product per chunk vs per span",
    )
    p.add_argument(
        "--trainer-weights-ab",
        action="store_true",
        help="only time trainer steps on float32 weights under bf16 autocast vs on bf16 weights",
    )
    p.add_argument(
        "--compile-ab",
        action="store_true",
        help="only time trainer steps with the decoder blocks run eagerly vs compiled",
    )
    args, extra = p.parse_known_args()
    if args.compile_ab:
        return compile_ab(args, extra)
    if args.trainer_weights_ab:
        return trainer_weights_ab(args, extra)
    if args.head_grad_ab:
        return head_grad_ab(args, extra)
    if args.max_batch_ab:
        return max_batch_ab(args, extra)
    if args.packed_linear_ab:
        return packed_linear_ab(args, extra)
    if args.decode_split:
        return decode_split(args, extra)
    if args.attention_ab:
        return attention_ab(args, extra)
    if args.kv_cache_ab:
        return kv_cache_ab(args, extra)
    if args.drop_ended_ab:
        return drop_ended_ab(args, extra)
    if set(args.dtypes.split(",")) - {"float32", "bfloat16"}:
        p.error(f"--dtypes {args.dtypes}: float32 and/or bfloat16")
    dtype, why = choose_dtype("auto", "cpu")
    print(
        f"CPU: {cpu_model()}; torch capability {torch.backends.cpu.get_cpu_capability()}, oneDNN native bf16 "
        f"{torch.ops.mkldnn._is_mkldnn_bf16_supported()}; --dtype auto picks {dtype} ({why})"
    )
    limit(len(os.sched_getaffinity(0)))
    if args.steps:
        pipeline(args, extra)
    components(args, extra)


if __name__ == "__main__":
    main()
