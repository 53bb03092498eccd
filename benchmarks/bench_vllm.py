"""vLLM engine: framework overhead vs raw LLM.generate, and vLLM vs HF engine.

    python benchmarks/bench_vllm.py [--model DIR] [--threads 1] [--rounds 3] [--steps 4]

1. nanorft's VLLMEngine (workflows + batching + Experience building) vs raw
   `LLM.generate` on the same prompts, same LLM instance, interleaved rounds:
   generated tokens/s and their ratio (target >= 0.9).
2. The default job's explorer batch through the vLLM engine vs the HF engine, same thread
   count, interleaved rounds: generated tokens/s and their ratio.
3. With --steps > 0: seconds per step of `run.py` with --engine vllm and --engine hf.
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from bench_step import explore_rate, pipeline  # noqa: E402

import components  # noqa: E402
import run  # noqa: E402
from components import load_tasks  # noqa: E402
from engines import HFEngine  # noqa: E402
from explorer import Explorer  # noqa: E402
from extras.vllm_engine import VLLMEngine  # noqa: E402


def raw_rate(llm, prompts, n, cfg):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(
        n=n, temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=cfg.max_tokens, logprobs=0
    )
    t = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    return sum(len(c.token_ids) for o in outs for c in o.outputs) / (time.perf_counter() - t)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=4)
    args, extra = p.parse_known_args()
    torch.set_num_threads(args.threads)
    cfg = run.parse_config(
        extra + ["--run-dir", tempfile.mkdtemp()] + (["--model", args.model] if args.model else [])
    )
    path = components.resolve_model(cfg.model)
    train, held, ds = load_tasks(cfg.task, cfg.task_kwargs, cfg.train_size, 1, cfg.seed)
    vllm_engine = VLLMEngine(
        path, seed=cfg.seed, bf16=cfg.dtype == "bfloat16", threads=args.threads
    )
    hf_engine = HFEngine(
        path, max_batch=cfg.explorer_max_batch, seed=cfg.seed, bf16=cfg.dtype == "bfloat16"
    )
    parts = components.explorer_parts(cfg)
    ex_v = Explorer(cfg, vllm_engine, train, held, ds, print, parts)
    ex_h = Explorer(cfg, hf_engine, train, held, ds, print, parts)
    rows = {"nanorft_vllm": [], "raw_vllm": [], "hf": []}
    for rnd in range(args.rounds):
        ex_v.selector.cursor = rnd * cfg.batch_size
        prompts = [ex_v.workflow.prompt_ids(t) for t in ex_v.next_tasks(cfg.batch_size, {})]
        rows["nanorft_vllm"].append(explore_rate(ex_v, rnd)[0])
        rows["raw_vllm"].append(raw_rate(vllm_engine.llm, prompts, cfg.group_size, cfg))
        rows["hf"].append(explore_rate(ex_h, rnd)[0])
    med = {k: sorted(v)[len(v) // 2] for k, v in rows.items()}
    print(
        f"explorer, {args.threads} thread(s), batch {cfg.batch_size} tasks x {cfg.group_size} rollouts x "
        f"<= {cfg.max_tokens} tokens, median of {args.rounds} interleaved rounds (generated tokens/s):"
    )
    print(
        f"  nanorft vLLM engine {med['nanorft_vllm']:7.1f} | raw LLM.generate {med['raw_vllm']:7.1f} | "
        f"ratio {med['nanorft_vllm'] / med['raw_vllm']:.2f}"
    )
    print(
        f"  nanorft vLLM engine {med['nanorft_vllm']:7.1f} | nanorft HF engine {med['hf']:7.1f} | "
        f"ratio {med['nanorft_vllm'] / med['hf']:.2f}"
    )
    vllm_engine.close()
    if args.steps:
        for engine in ("vllm", "hf"):
            print(f"--engine {engine}:")
            pipeline(
                argparse.Namespace(model=args.model, steps=args.steps, threads=args.threads),
                extra + ["--engine", engine],
            )


if __name__ == "__main__":
    main()
