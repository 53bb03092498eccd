"""Placement of trainer ranks and explorer on GPUs (unit tests on CPU), and the CUDA paths,
which run only where a GPU is visible (skipped with a reason elsewhere)."""
import json

import pytest
import torch

import run
from conftest import run_py

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible here)")


@pytest.mark.parametrize("gpus,ranks,mode,trainer,explorer,colocated,sync_device,unused", [
    (0, 1, "both", ("cpu",), "cpu", False, "cpu", 0),                      # CPU machine: gloo
    (0, 2, "train", ("cpu", "cpu"), "", False, "cpu", 0),
    (1, 1, "both", ("cuda:0",), "cuda:0", True, "cpu", 0),                 # one GPU: colocated, staged over gloo
    (2, 1, "both", ("cuda:0",), "cuda:1", False, "cuda", 0),               # a GPU of its own: NCCL
    (8, 4, "both", tuple(f"cuda:{i}" for i in range(4)), "cuda:4", False, "cuda", 3),
    (8, 8, "both", tuple(f"cuda:{i}" for i in range(8)), "cuda:0", True, "cpu", 0),
    (4, 2, "train", ("cuda:0", "cuda:1"), "", False, "cuda", 2),
])
def test_placement(gpus, ranks, mode, trainer, explorer, colocated, sync_device, unused):
    layout = run.place(gpus, ranks, mode)
    assert (layout.trainer, layout.explorer, layout.colocated, layout.sync_device, layout.unused_gpus) == \
        (trainer, explorer, colocated, sync_device, unused)
    # NCCL never gets two ranks of the weight-sync group on one device
    assert not (layout.sync_device == "cuda" and layout.explorer in layout.trainer)


def test_placement_that_cannot_work_is_one_line():
    with pytest.raises(ValueError, match=r"2 trainer ranks need 2 GPUs, 1 visible"):
        run.place(1, 2, "both")
    assert "colocated with trainer rank 0" in run.place(1, 1, "both").describe()


def test_placement_is_recorded_in_config_json(tiny_model, tmp_path):
    cfg = run.parse_config(["--config", "configs/tiny.toml", "--model", tiny_model, "--run-dir", str(tmp_path / "r")])
    run.prepare(cfg, 0)
    saved = json.loads((tmp_path / "r" / "config.json").read_text())
    expected = run.place(run.gpu_count(), 1, "both")  # this machine's layout, CPU or GPU
    assert saved["placement"] == json.loads(json.dumps(run.dataclasses.asdict(expected)))
    if not torch.cuda.is_available():
        assert saved["placement"] == {"trainer": ["cpu"], "explorer": "cpu", "colocated": False, "sync_device": "cpu",
                                      "unused_gpus": 0}


@needs_cuda
def test_colocated_mode_both_on_one_gpu(tiny_model, tmp_path, monkeypatch):
    # trainer rank 0 and the HF explorer share cuda:0; weights go over gloo through host memory;
    # after every sync the explorer's weights equal the trainer's (checksums)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    res = run_py("--config", "configs/tiny.toml", "--model", tiny_model, "--run-dir", tmp_path / "r", "--engine", "hf",
                 "--steps", 4, "--sync-interval", 2, nproc=1)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "colocated with trainer rank 0" in res.stdout
    records = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    sent = {r["version"]: r["sync/trainer_checksum"] for r in records if "sync/trainer_checksum" in r}
    got = {r["explorer/received_version"]: r["sync/explorer_checksum"] for r in records if "sync/explorer_checksum" in r}
    assert sent and set(got) == set(sent)
    assert all(got[v] == pytest.approx(sent[v], rel=1e-6) for v in sent)
    steps = [r for r in records if "loss/grad_norm" in r]
    assert all(0 < r["memory/peak_allocated_gib"] < 80 for r in steps)  # torch.cuda figures in the metrics


def test_activation_checkpointing_gives_the_same_step(tiny_model):
    # recomputing the activations in the backward pass changes memory, not the numbers; and it does recompute
    # (it once did not: transformers recomputes only blocks in training mode, and the model stayed in eval mode)
    import torch.distributed as dist

    from buffer import Experience
    from trainer import Trainer

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    group = [Experience([5, 6, 7] + [20 + i, 30, 31 + i], 3, [-2.0, -1.5, -1.0], [1, 1, 1], float(i % 2), "g", "t", 0)
             for i in range(4)]
    out = []
    for on in (False, True):
        flag = "--activation-checkpointing" if on else "--no-activation-checkpointing"
        cfg = run.parse_config(["--config", "configs/tiny.toml", "--dtype", "float32", flag])
        trainer = Trainer(cfg, tiny_model, torch.device("cpu"))
        assert trainer.model.is_gradient_checkpointing == on
        calls = []
        blocks = [m for m in trainer.model.modules() if type(m).__name__.endswith("LlamaDecoderLayer")]
        hooks = [b.register_forward_pre_hook(lambda *a: calls.append(1)) for b in blocks]
        m = trainer.step([list(group)])
        for h in hooks:
            h.remove()
        assert len(calls) == len(blocks) * m["train/micro_batches"] * (2 if on else 1)  # forward, + recompute
        assert not any(x.training for b in blocks for x in b.modules() if x is not b)  # no dropout
        out.append((m["loss/policy"], m["loss/grad_norm"], [p.detach().clone() for p in trainer.full_parameters()]))
    assert out[0][0] == pytest.approx(out[1][0], abs=1e-6) and out[0][1] == pytest.approx(out[1][1], rel=1e-5)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(out[0][2], out[1][2]))
    assert out[0][1] > 0


def bf16_engine_receiver(model, port, q):
    from explorer import HFEngine

    engine = HFEngine(model, dtype=torch.bfloat16, device="cpu")
    engine.join_weight_sync("127.0.0.1", port, 60, lambda: True, "cpu")
    version, digest = engine.receive_weights(lambda: True)
    q.put((version, digest, [p.float().tolist() for p in engine.parameters()]))


def test_an_engine_holding_bf16_weights_receives_the_trainers_float32(tiny_model):
    # the colocated HF engine holds bf16 weights; the trainer holds float32: the engine declares bf16, the
    # trainer casts on the wire, and the engine receives exactly the bf16 rounding of the trainer's weights
    import multiprocessing as mp

    import sync
    from transformers import AutoModelForCausalLM

    sent = [p.detach() + 0.01 for p in AutoModelForCausalLM.from_pretrained(tiny_model).parameters()]
    ws = sync.WeightSync(0, 2, port=0, timeout_s=60)
    q = mp.get_context("spawn").Queue()
    proc = mp.get_context("spawn").Process(target=bf16_engine_receiver, args=(tiny_model, ws.port, q))
    proc.start()
    ws.connect(proc.is_alive)
    assert ws.wire_dtype == torch.bfloat16
    sent_digest = ws.send(3, [sent], proc.is_alive)
    version, digest, got = q.get(timeout=120)
    ws.wait(proc.is_alive)
    proc.join(60)
    assert version == 3 and digest == pytest.approx(sent_digest, rel=1e-12)
    assert sent_digest == pytest.approx(sync.checksum(s.to(torch.bfloat16) for s in sent), rel=1e-12)
    assert all(torch.equal(torch.tensor(g), s.to(torch.bfloat16).float()) for g, s in zip(got, sent))
