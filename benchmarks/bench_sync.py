"""Weight sync: nanorft's publish vs a raw broadcast of the same bytes, side by side.

    python benchmarks/bench_sync.py [--model smollm2-135m] [--rounds 5] [--device cpu|cuda|colocated] [--bucket-mb 64]

Two processes join one weight-sync group (sync.WeightSync: gloo on CPU, NCCL between two
GPUs; `colocated`: both on cuda:0, gloo through host memory, as launch.place lays out one GPU).
Each round, interleaved: (1) nanorft: rank 0 `send` of every parameter of the model (random
weights of its architecture, float32) and rank 1 `recv` into its parameters; (2) raw: one
broadcast of a preallocated flat buffer of the same bytes (colocated: with the copies from the sender's GPU
to host memory and back to the receiver's GPU that such a publish needs); (3) bucketed: the publish of (1)
over a second group with --sync-bucket-mb's buckets (gathered lazily, sent one at a time); on one
device (cpu, colocated) also (4) ipc: the same buckets written into one staging tensor the receiver maps once,
one acknowledgement per publish (--sync-method ipc: CUDA IPC on the GPU, shared memory on the CPU;
ipc_sync.py).
The time of a publish runs from
rank 0 starting it to rank 1 holding the weights (time.monotonic, one clock for both
processes). Prints the medians, their ratio (raw / nanorft: 1.0 = no overhead), GB/s, and
writes benchmarks/results/sync_<device>.json.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import models  # noqa: E402
import sync  # noqa: E402
from ipc_sync import IpcSync  # noqa: E402
from sync import checksum  # noqa: E402


def shapes(model_dir: str) -> list[torch.Size]:
    """Parameter shapes of the model's architecture, in named_parameters() order."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(model_dir), dtype=torch.float32
        )
    return [p.shape for p in model.parameters()]


def raw_broadcast(
    ws: sync.WeightSync, flat: torch.Tensor, on_device: torch.Tensor | None = None
) -> None:
    """One broadcast of `flat` (on the group's device); with `on_device` (colocated: a buffer of the same bytes on
    the weights' GPU) the copies a publish through host memory needs: device -> host before on the sender, host ->
    device after on a receiver."""
    if on_device is not None and ws.rank == 0:
        flat.copy_(on_device)
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    ws.group.broadcast([flat], opts).wait()
    if on_device is not None and ws.rank != 0:
        on_device.copy_(flat)


def receiver(ports: dict, sizes: list, device: str, sync_device: str, rounds: int, q) -> None:
    if device.startswith(
        "cuda"
    ):  # the weight-sync group's "cuda" is the current device: this side's own GPU
        torch.cuda.set_device(torch.device(device))
    groups = {
        kind: (IpcSync if kind == "ipc" else sync.WeightSync)(
            None, port=port, device=sync_device, timeout_s=600
        ).connect()
        for kind, port in ports.items()
    }
    ws, params = groups["nanorft"], [torch.empty(s, device=device) for s in sizes]
    flat = torch.empty(sum(p.numel() for p in params), device=sync_device)
    on_device = torch.empty_like(flat, device=device) if device != sync_device else None
    for _ in range(rounds):
        for kind in (
            "nanorft",
            "raw",
            *[k for k in groups if k != "nanorft"],
        ):  # the sender's order
            group = groups.get(kind)
            if group is None:
                raw_broadcast(ws, flat, on_device)
            else:
                group.recv(params)
            if device.startswith("cuda") or sync_device == "cuda":
                torch.cuda.synchronize()
            q.put((kind, time.monotonic(), checksum(params) if group else None))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--model",
        default=models.BUILTIN_MODEL,
        help="architecture to publish (a --model name of run.py)",
    )
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda", "colocated"])
    p.add_argument(
        "--bucket-mb",
        type=float,
        default=64.0,
        help="bucket of the bucketed publish (MiB of float32)",
    )
    args = p.parse_args()
    if args.device != "cpu" and not torch.cuda.is_available():
        sys.exit(f"bench_sync.py: --device {args.device} needs a CUDA GPU")
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        sys.exit(
            "bench_sync.py: --device cuda needs 2 GPUs (one each side); use --device colocated on one"
        )
    sender_dev, receiver_dev, sync_device = {
        "cpu": ("cpu", "cpu", "cpu"),
        "cuda": ("cuda:0", "cuda:1", "cuda"),
        "colocated": ("cuda:0", "cuda:0", "cpu"),
    }[args.device]
    sizes = shapes(models.resolve_model(args.model))
    params = [torch.randn(s, device=sender_dev) for s in sizes]
    nbytes = sum(x.numel() * x.element_size() for x in params)
    on_device = torch.cat([x.reshape(-1) for x in params])
    flat = on_device.to(sync_device)
    if sender_dev == sync_device:
        on_device = None
    elems = int(args.bucket_mb * 2**20) // 4
    groups = {
        "nanorft": sync.WeightSync(0, 2, port=0, device=sync_device, timeout_s=600),
        "bucketed": sync.WeightSync(
            0, 2, port=0, device=sync_device, timeout_s=600, bucket_elems=elems
        ),
    }
    if args.device != "cuda":  # one device on both sides
        groups["ipc"] = IpcSync(0, 2, port=0, device=sync_device, timeout_s=600, bucket_elems=elems)
    ws = groups["nanorft"]
    q = mp.get_context("spawn").Queue()
    proc = mp.get_context("spawn").Process(
        target=receiver,
        args=(
            {k: g.port for k, g in groups.items()},
            sizes,
            receiver_dev,
            sync_device,
            args.rounds,
            q,
        ),
    )
    proc.start()
    for group in groups.values():
        group.connect(proc.is_alive)
    times: dict[str, list[float]] = {
        "nanorft": [],
        "raw": [],
        **{k: [] for k in groups if k != "nanorft"},
    }
    for r in range(args.rounds):
        with torch.no_grad():
            params[0].add_(1.0)  # a new version each round
        for kind in times:
            t0 = time.monotonic()
            if kind == "raw":
                raw_broadcast(ws, flat, on_device)
            else:
                group = groups[kind]
                group.send(
                    r,
                    (
                        [params[i] for i in b]
                        for b in sync.bucket_ranges([x.numel() for x in params], group.bucket_elems)
                    ),
                    proc.is_alive,
                )
            got, t1, digest = q.get(timeout=600)
            if kind != "raw":
                group.wait(proc.is_alive)
                assert got == kind and digest == checksum(params), (
                    "the receiver holds other weights"
                )
            times[kind].append(t1 - t0)
    proc.join(60)
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "device": args.device,
        "model": args.model,
        "bytes": nbytes,
        "rounds": args.rounds,
        "bucket_mb": args.bucket_mb,
        "nanorft_s": med["nanorft"],
        "raw_s": med["raw"],
        "bucketed_s": med["bucketed"],
        "ratio_raw_over_nanorft": med["raw"] / med["nanorft"],
        "ratio_raw_over_bucketed": med["raw"] / med["bucketed"],
        "nanorft_gb_per_s": nbytes / med["nanorft"] / 1e9,
        "raw_gb_per_s": nbytes / med["raw"] / 1e9,
        "all_s": times,
    }
    if "ipc" in med:
        result.update(
            ipc_s=med["ipc"],
            ratio_bucketed_over_ipc=med["bucketed"] / med["ipc"],
            ipc_gb_per_s=nbytes / med["ipc"] / 1e9,
        )
    print(
        f"{nbytes / 1e6:.0f} MB per publish ({args.device}, {args.model}, median of {args.rounds}):"
    )
    print(f"  nanorft send/recv  {med['nanorft']:.3f} s  ({result['nanorft_gb_per_s']:.2f} GB/s)")
    print(f"  raw broadcast      {med['raw']:.3f} s  ({result['raw_gb_per_s']:.2f} GB/s)")
    print(f"  bucketed ({args.bucket_mb:g} MiB)  {med['bucketed']:.3f} s")
    print(
        f"  ratio raw / nanorft: {result['ratio_raw_over_nanorft']:.2f}; raw / bucketed: "
        f"{result['ratio_raw_over_bucketed']:.2f}"
    )
    if "ipc" in med:
        print(
            f"  ipc ({args.bucket_mb:g} MiB)       {med['ipc']:.3f} s  ({result['ipc_gb_per_s']:.2f} GB/s; "
            f"bucketed / ipc {result['ratio_bucketed_over_ipc']:.1f})"
        )
    out = ROOT / "benchmarks" / "results" / f"sync_{args.device}.json"
    out.write_text(json.dumps(result, indent=2))
    print(f"saved {out}")


if __name__ == "__main__":
    main()
