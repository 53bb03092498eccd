"""Placement of trainer ranks and explorer on GPUs (unit tests on CPU), and the CUDA paths,
which run only where a GPU is visible (skipped with a reason elsewhere). On a GPU machine
`python benchmarks/gpu_check.py` runs this file as its first stage."""

import json

import pytest
import torch

import launch
import run
from conftest import run_py

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible here)"
)


@pytest.fixture
def tasks(tmp_path) -> str:
    """A JSONL file of 64 sums, scored by exact match: the GPU machine has no reasoning-gym."""
    path = tmp_path / "tasks.jsonl"
    path.write_text(
        "".join(
            json.dumps({"question": f"What is {a} + {b}?", "answer": str(a + b)}) + "\n"
            for a in range(8)
            for b in range(8)
        )
    )
    return str(path)


@pytest.mark.parametrize(
    "gpus,ranks,mode,trainer,explorer,colocated,sync_device,unused",
    [
        (0, 1, "both", ("cpu",), "cpu", False, "cpu", 0),  # CPU machine: gloo
        (0, 2, "train", ("cpu", "cpu"), "", False, "cpu", 0),
        (
            1,
            1,
            "both",
            ("cuda:0",),
            "cuda:0",
            True,
            "cpu",
            0,
        ),  # one GPU: colocated, staged over gloo
        (2, 1, "both", ("cuda:0",), "cuda:1", False, "cuda", 0),  # a GPU of its own: NCCL
        (8, 4, "both", tuple(f"cuda:{i}" for i in range(4)), "cuda:4", False, "cuda", 3),
        (8, 8, "both", tuple(f"cuda:{i}" for i in range(8)), "cuda:0", True, "cpu", 0),
        (4, 2, "train", ("cuda:0", "cuda:1"), "", False, "cuda", 2),
    ],
)
def test_placement(gpus, ranks, mode, trainer, explorer, colocated, sync_device, unused):
    layout = launch.place(gpus, ranks, mode)
    assert (
        layout.trainer,
        layout.explorer,
        layout.colocated,
        layout.sync_device,
        layout.unused_gpus,
    ) == (trainer, explorer, colocated, sync_device, unused)
    # NCCL never gets two ranks of the weight-sync group on one device
    assert not (layout.sync_device == "cuda" and layout.explorer in layout.trainer)


def test_placement_that_cannot_work_is_one_line():
    with pytest.raises(ValueError, match=r"2 trainer ranks need 2 GPUs, 1 visible"):
        launch.place(1, 2, "both")
    assert "colocated with trainer rank 0" in launch.place(1, 1, "both").describe()


def test_placement_is_recorded_in_config_json(tiny_model, tasks, tmp_path):
    cfg = run.parse_config(
        [
            "--config",
            "configs/tiny.toml",
            "--model",
            tiny_model,
            "--task",
            tasks,
            "--run-dir",
            str(tmp_path / "r"),
        ]
    )
    run.prepare(cfg, 0)
    saved = json.loads((tmp_path / "r" / "config.json").read_text())
    expected = launch.place(launch.gpu_count(), 1, "both")  # this machine's layout, CPU or GPU
    assert saved["placement"] == json.loads(json.dumps(run.dataclasses.asdict(expected)))
    if not torch.cuda.is_available():
        assert saved["placement"] == {
            "trainer": ["cpu"],
            "explorer": "cpu",
            "colocated": False,
            "sync_device": "cpu",
            "unused_gpus": 0,
        }


@needs_cuda
@pytest.mark.parametrize("method,shown", [("auto", "ipc"), ("broadcast", "gloo")])
def test_colocated_mode_both_on_one_gpu(tiny_model, tasks, tmp_path, monkeypatch, method, shown):
    # trainer rank 0 and the HF explorer share cuda:0; weights go by CUDA IPC (auto's choice) or over gloo through
    # host memory; after every sync the explorer's weights equal the trainer's (checksums)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    res = run_py(
        "--config",
        "configs/tiny.toml",
        "--model",
        tiny_model,
        "--task",
        tasks,
        "--run-dir",
        tmp_path / "r",
        "--engine",
        "hf",
        "--steps",
        4,
        "--sync-interval",
        2,
        "--sync-checksum",
        "--sync-method",
        method,
        nproc=1,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"colocated with trainer rank 0); weight sync {shown}" in res.stdout
    records = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    sent = {
        r["version"]: r["sync/trainer_checksum"] for r in records if "sync/trainer_checksum" in r
    }
    got = {
        r["explorer/received_version"]: r["sync/explorer_checksum"]
        for r in records
        if "sync/explorer_checksum" in r
    }
    assert sent and set(got) == set(sent)
    assert all(got[v] == pytest.approx(sent[v], rel=1e-6) for v in sent)
    steps = [r for r in records if "loss/grad_norm" in r]
    assert all(
        0 < r["memory/peak_allocated_gib"] < 80 for r in steps
    )  # torch.cuda figures in the metrics


@pytest.mark.parametrize(
    "device,dtype,graphs",
    [
        ("cpu", torch.float32, False),
        pytest.param("cuda:0", torch.float32, False, marks=needs_cuda),
        pytest.param(
            "cuda:0", torch.bfloat16, False, marks=needs_cuda
        ),  # as colocated on one GPU: the engine holds bf16
        pytest.param(
            "cuda:0", torch.bfloat16, True, marks=needs_cuda
        ),  # decode steps replayed as CUDA graphs
    ],
    ids=["cpu-float32", "cuda-float32", "cuda-bf16", "cuda-bf16-graphs"],
)
def test_hf_engine_follows_a_perturbed_sync(tiny_model, device, dtype, graphs):
    # the explorer's log-probs follow the trainer's new weights: deliberately perturbed weights published over the
    # weight-sync group (gloo, staged through host memory, as on one GPU) reach the HF engine on `device`, which then
    # samples from exactly the perturbed model (its recomputation, as the trainer computes it) and no longer the old
    import threading

    from transformers import AutoModelForCausalLM

    import sync
    from conftest import PROMPTS, rollouts
    from cuda_graphs import Graphs
    from engines import HFEngine, Sampling
    from packing import pack, response_logprobs

    bf16 = dtype == torch.bfloat16
    engine = HFEngine(
        tiny_model,
        max_batch=16,
        seed=0,
        bf16=bf16,
        device=device,
        dtype=dtype,
        graphs=Graphs if graphs else None,
    )
    engine.checksum = True
    if graphs:  # the graph is captured on the old weights: the sync must reach it in place
        rollouts(engine, PROMPTS, 4, Sampling(max_tokens=12, temperature=1.0))
        assert len(engine.graphs.steps) == 1
    old, new = (
        AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).to(device)
        for _ in range(2)
    )
    torch.manual_seed(0)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ws = sync.WeightSync(0, 2, port=0, timeout_s=120, checksum=True)
    joiner = threading.Thread(target=ws.connect)
    joiner.start()
    engine.join_weight_sync("127.0.0.1", ws.port, 120, lambda: True)
    joiner.join()
    assert ws.wire_dtype == dtype  # the engine declared the dtype it holds
    sent = ws.send(7, [[p for _, p in new.named_parameters()]])
    version, got = engine.receive_weights(lambda: True)
    ws.wait()
    assert version == 7 and got == pytest.approx(sent, rel=1e-9)

    exps = rollouts(engine, PROMPTS, 4, Sampling(max_tokens=12, temperature=1.0))
    batch = {k: v if v is None else v.to(device) for k, v in pack(exps, engine.pad).items()}

    def gap(
        model,
    ) -> float:  # max |engine's log-prob - the model's recomputation| over the sampled tokens
        with (
            torch.no_grad(),
            torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=bf16),
        ):
            lp, _ = response_logprobs(model.to(dtype), batch, 1.0)  # [B, R]
        return ((lp.float() - batch["behaviour_logprobs"]).abs() * batch["mask"]).max().item()

    after, before = gap(new), gap(old)
    assert after < (5e-2 if bf16 else 1e-3), after
    assert before > 20 * max(after, 1e-5), (
        before,
        after,
    )  # the old weights are far off: the sync took effect


def test_activation_checkpointing_gives_the_same_step(tiny_model):
    # recomputing the activations in the backward pass changes memory, not the numbers; and it does recompute
    # (it once did not: transformers recomputes only blocks in training mode, and the model stayed in eval mode)
    import torch.distributed as dist

    from buffer import Experience
    from trainer import Trainer

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    group = [
        Experience(
            [5, 6, 7] + [20 + i, 30, 31 + i],
            3,
            [-2.0, -1.5, -1.0],
            [1, 1, 1],
            float(i % 2),
            "g",
            "t",
            0,
        )
        for i in range(4)
    ]
    out = []
    for on in (False, True):
        flag = "--activation-checkpointing" if on else "--no-activation-checkpointing"
        cfg = run.parse_config(["--config", "configs/tiny.toml", "--dtype", "float32", flag])
        trainer = Trainer(cfg, tiny_model, torch.device("cpu"))
        assert trainer.model.is_gradient_checkpointing == on
        calls = []
        blocks = [
            m for m in trainer.model.modules() if type(m).__name__.endswith("LlamaDecoderLayer")
        ]
        hooks = [b.register_forward_pre_hook(lambda *a: calls.append(1)) for b in blocks]
        m = trainer.step([list(group)])
        for h in hooks:
            h.remove()
        assert len(calls) == len(blocks) * m["train/micro_batches"] * (
            2 if on else 1
        )  # forward, + recompute
        assert not any(x.training for b in blocks for x in b.modules() if x is not b)  # no dropout
        out.append(
            (
                m["loss/policy"],
                m["loss/grad_norm"],
                [p.detach().clone() for p in trainer.full_parameters()],
            )
        )
    assert out[0][0] == pytest.approx(out[1][0], abs=1e-6) and out[0][1] == pytest.approx(
        out[1][1], rel=1e-5
    )
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(out[0][2], out[1][2]))
    assert out[0][1] > 0


def test_cores_lent_in_the_middle_of_a_step_are_taken_at_the_next_block(tiny_model):
    # with one micro-batch per step, taking lent cores only before a micro-batch left them idle until the next step
    import multiprocessing as mp

    import torch.distributed as dist

    import perf
    from buffer import Experience
    from trainer import Trainer

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    before = torch.get_num_threads()
    cfg = run.parse_config(["--config", "configs/tiny.toml", "--dtype", "float32"])
    trainer = Trainer(cfg, tiny_model, torch.device("cpu"))
    flags = mp.get_context("spawn").Array("i", 2)
    cores, explorer = perf.CoreShare(flags, 0, 1, 1), perf.CoreShare(flags, 1, 1, 1)
    perf.lend_threads(trainer.model, cores)
    blocks = [m for m in trainer.model.modules() if type(m).__name__.endswith("LlamaDecoderLayer")]
    seen = []
    blocks[0].register_forward_pre_hook(
        lambda *a: explorer.busy(False)
    )  # the explorer goes idle during block 0
    blocks[-1].register_forward_pre_hook(lambda *a: seen.append(torch.get_num_threads()))
    group = [
        Experience([5, 6, 7, 20 + i, 30], 3, [-2.0, -1.5], [1, 1], float(i % 2), "g", "t", 0)
        for i in range(4)
    ]
    try:
        explorer.busy(True)
        cores.busy(True)
        m = trainer.step([group])
    finally:
        torch.set_num_threads(before)
    assert (
        m["train/micro_batches"] == 1 and seen and seen[0] == 2
    )  # the last block already runs on both cores


def bf16_engine_receiver(model, port, q):
    from engines import HFEngine

    engine = HFEngine(model, dtype=torch.bfloat16, device="cpu")
    engine.checksum = True
    engine.join_weight_sync("127.0.0.1", port, 60, lambda: True, "cpu")
    version, digest = engine.receive_weights(lambda: True)
    q.put((version, digest, [p.float().tolist() for p in engine.parameters()]))


@pytest.mark.slow
def test_an_engine_holding_bf16_weights_receives_the_trainers_float32(tiny_model):
    # the colocated HF engine holds bf16 weights; the trainer holds float32: the engine declares bf16, the
    # trainer casts on the wire, and the engine receives exactly the bf16 rounding of the trainer's weights
    import multiprocessing as mp

    from transformers import AutoModelForCausalLM

    import sync
    from sync import checksum

    sent = [
        p.detach() + 0.01 for p in AutoModelForCausalLM.from_pretrained(tiny_model).parameters()
    ]
    ws = sync.WeightSync(0, 2, port=0, timeout_s=60, checksum=True)
    q = mp.get_context("spawn").Queue()
    proc = mp.get_context("spawn").Process(
        target=bf16_engine_receiver, args=(tiny_model, ws.port, q)
    )
    proc.start()
    ws.connect(proc.is_alive)
    assert ws.wire_dtype == torch.bfloat16
    sent_digest = ws.send(3, [sent], proc.is_alive)
    version, digest, got = q.get(timeout=120)
    ws.wait(proc.is_alive)
    proc.join(60)
    assert version == 3 and digest == pytest.approx(sent_digest, rel=1e-12)
    assert sent_digest == pytest.approx(checksum(s.to(torch.bfloat16) for s in sent), rel=1e-12)
    assert all(
        torch.equal(torch.tensor(g), s.to(torch.bfloat16).float()) for g, s in zip(got, sent)
    )


@needs_cuda
@pytest.mark.parametrize("lever", [True, False])
def test_the_fused_adamw_lever_decides_on_one_gpu(tiny_model, lever):
    # the lever once had no effect on one unsharded GPU: fused AdamW whatever it said
    import torch.distributed as dist

    import trainer

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    flag = "--fused-adamw" if lever else "--no-fused-adamw"
    cfg = run.parse_config(["--config", "configs/tiny.toml", "--no-compile-layers", flag])
    t = trainer.Trainer(cfg, tiny_model, torch.device("cuda", 0))
    assert bool(t.opt.defaults["fused"]) == lever


@needs_cuda
def test_a_train_step_waits_for_the_gpu_no_more_often_with_more_micro_batches(tiny_model):
    # each .to(device) of a pageable CPU tensor waits for the stream: the micro-batch's index,
    # rewards and group index once cost a host sync per micro-batch. A step's own syncs (the
    # micro-batch count, the gradient norm, the metrics' all-reduce) stay: as many with 6
    # micro-batches as with 1
    import warnings
    from collections import Counter

    import torch.distributed as dist

    from buffer import Experience
    from trainer import Trainer

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    groups = [
        [
            Experience(
                [5, 6, 7, 8 + g, 20 + i, 30, 31 + i, 40],
                4,
                [-2.0, -1.5, -1.0, -0.5],
                [1] * 4,
                float(i % 2),
                f"g{g}",
                f"t{g}",
                0,
            )
            for i in range(4)
        ]
        for g in range(4)
    ]
    syncs = {}
    for budget in (256, 16):  # 1 and 6 micro-batches
        flags = ["--config", "configs/tiny.toml", "--no-compile-layers"]
        cfg = run.parse_config(flags + ["--token-budget", str(budget)])
        trainer = Trainer(cfg, tiny_model, torch.device("cuda", 0))
        trainer.step(groups)  # first allocations (pinned memory included)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                m = trainer.step(groups)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        # where each wait was asked for (the Python line that called the operation)
        waits = [f"{w.filename}:{w.lineno}" for w in seen if "synchronizing" in str(w.message)]
        syncs[int(m["train/micro_batches"])] = Counter(waits)
    assert sorted(syncs) == [1, 6]
    assert syncs[6] == syncs[1], syncs
