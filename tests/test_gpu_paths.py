"""Code paths that matter on a GPU, checked on the CPU with stand-ins: FSDP's device mesh where
an accelerator is visible, the trainer's attention implementation, the gathered weights, and
vLLM's worker extension and engine (fake vLLM objects: vLLM itself is not needed)."""

import json
import shutil
import sys
import types

import pytest
import torch
import torch.distributed as dist
from test_sync import gone_within

import run
from trainer import Trainer


def trainer_on_cpu(model: str) -> Trainer:
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    cfg = run.parse_config(["--config", "configs/tiny.toml", "--dtype", "float32"])
    return Trainer(cfg, model, torch.device("cpu"))


def test_a_trainer_on_the_cpu_stays_there_where_an_accelerator_is_visible(tiny_model, monkeypatch):
    # FSDP2's default mesh is the accelerator's: on a GPU machine a Trainer asked for the CPU (tests, benchmarks)
    # got CUDA parameters. Here torch is told a CUDA accelerator is present (none is: CUDA would fail)
    monkeypatch.setattr(torch._C, "_get_accelerator", lambda: torch.device("cuda"))
    trainer = trainer_on_cpu(tiny_model)
    assert {p.device.type for p in trainer.model.parameters()} == {"cpu"}


def test_the_trainer_attends_with_packed_sdpa_whatever_the_checkpoint_asks(tiny_model, tmp_path):
    # pack's layout (flat tokens, rows under a [N, 1, L, L] boolean mask) is packed_sdpa's; flex attention misreads it
    from packing import packed_sdpa

    model = tmp_path / "flex"
    shutil.copytree(tiny_model, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(
        json.dumps({**config, "attn_implementation": "flex_attention"})
    )
    assert trainer_on_cpu(str(model)).model.config._attn_implementation == packed_sdpa()


def test_gathered_weights_carry_no_autograd_graph(tiny_model):
    # with several ranks every parameter is gathered (DTensor.full_tensor); that gather must not be recorded
    # for autograd. One rank takes the same path when told the world is larger (its gathers are copies)
    trainer = trainer_on_cpu(tiny_model)
    trainer.world = 2
    gathered = next(trainer.parameter_buckets(0))
    assert len(gathered) == len(list(trainer.model.parameters()))
    assert not any(t.requires_grad or t.grad_fn is not None for t in gathered)


def fake_vllm_reload(monkeypatch, calls: list) -> None:
    """vllm.model_executor.model_loader.reload with recording stand-ins of its two helpers."""
    reload = types.ModuleType("vllm.model_executor.model_loader.reload")
    reload.initialize_layerwise_reload = lambda model: calls.append(("initialize", model))
    reload.finalize_layerwise_reload = lambda model, config: calls.append(("finalize", model))
    for name in ("vllm", "vllm.model_executor", "vllm.model_executor.model_loader"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, reload.__name__, reload)


class FakeModel:
    def __init__(self):
        self.loaded = []

    def load_weights(self, weights):
        self.loaded += [(n, t.dtype) for n, t in weights]


def test_the_vllm_worker_loads_into_the_model_not_its_cuda_graph_wrapper(monkeypatch):
    # on CUDA, model_runner.model is vLLM's CUDAGraphWrapper; get_model() is the model (vLLM's own reload uses it)
    from extras.vllm_engine import VLLMWeightReceiver

    calls = []
    fake_vllm_reload(monkeypatch, calls)
    model = FakeModel()
    config = types.SimpleNamespace(
        dtype=torch.bfloat16, hf_config=types.SimpleNamespace(tie_word_embeddings=False)
    )
    worker = VLLMWeightReceiver()
    worker.vllm_config = types.SimpleNamespace(model_config=config)
    worker.model_runner = types.SimpleNamespace(
        model=object(), get_model=lambda: model
    )  # .model: the wrapper
    worker._nanorft_load([("w", torch.ones(2)), ("ids", torch.arange(2))])
    assert calls == [("initialize", model), ("finalize", model)]
    assert model.loaded == [("w", torch.bfloat16), ("ids", torch.int64)]


class FakeLLM:
    def __init__(self):
        self.resets = 0

    def collective_rpc(self, name, args=()):
        return [(3, 1.5) if name == "nanorft_receive" else 2.5]

    def reset_prefix_cache(self):
        self.resets += 1
        return True


@pytest.mark.parametrize("inflight", [False, True])
def test_vllm_keeps_its_prefix_cache_only_in_flight(tiny_model, inflight):
    # in flight, requests are running when weights arrive: vLLM refuses the reset (a warning on every publish),
    # and prefix caching is off there anyway
    from extras.vllm_engine import VLLMEngine

    engine = VLLMEngine.__new__(VLLMEngine)
    engine.model_path = tiny_model
    engine.checkpoint_order = None
    engine.llm, engine.inflight, engine.version, engine.lora, engine.checksum = (
        FakeLLM(),
        inflight,
        0,
        None,
        True,
    )
    assert engine.receive_weights(lambda: True) == (3, 1.5)
    assert engine.load_checkpoint("ckpt", 4) == 2.5 and engine.version == 4
    assert engine.llm.resets == (0 if inflight else 2)


def publishing_trainer(model: str, q) -> None:
    """Trainer rank 0 of a weight-sync group with one receiver: publish `model`'s weights + 1 as
    version 3, report (port, checksum) on `q`, then stay until killed."""
    import time

    from transformers import AutoModelForCausalLM

    import sync

    ws = sync.WeightSync(0, 2, port=0, timeout_s=60, checksum=True)
    q.put(ws.port)
    ws.connect()
    q.put(
        ws.send(
            3, [[p.detach() + 1 for p in AutoModelForCausalLM.from_pretrained(model).parameters()]]
        )
    )
    ws.wait()
    time.sleep(600)


@pytest.mark.slow
def test_the_vllm_worker_watches_the_trainers_store_in_every_receive(tiny_model, monkeypatch):
    # vLLM's worker is no child of the trainer (nor, in mode explore, is the explorer): it watches the trainer's
    # store while it joins and while it receives; a receive without it waited for the group's timeout (1 h)
    import multiprocessing as mp

    import sync
    from extras.vllm_engine import VLLMWeightReceiver

    fake_vllm_reload(monkeypatch, [])
    model = FakeModel()
    config = types.SimpleNamespace(
        dtype=torch.float32, hf_config=types.SimpleNamespace(tie_word_embeddings=True)
    )
    worker = VLLMWeightReceiver()
    worker.vllm_config, worker.device = (
        types.SimpleNamespace(model_config=config),
        torch.device("cpu"),
    )
    worker.model_runner = types.SimpleNamespace(get_model=lambda: model)
    watched = []
    recv = sync.WeightSync.recv
    monkeypatch.setattr(
        sync.WeightSync,
        "recv",
        lambda self, params, alive=None: watched.append(alive) or recv(self, params, alive),
    )
    q = mp.get_context("spawn").Queue()
    trainer = mp.get_context("spawn").Process(target=publishing_trainer, args=(tiny_model, q))
    trainer.start()
    try:
        worker.nanorft_join(tiny_model, "127.0.0.1", q.get(timeout=60), 60, "cpu")
        version, digest = worker.nanorft_receive(checksum=True)
        assert (version, digest) == (3, pytest.approx(q.get(timeout=60), rel=1e-12))
        assert len(model.loaded) == len(worker.nanorft_named) > 0
        assert watched == [worker.nanorft_alive] and worker.nanorft_alive()
    finally:
        trainer.kill()
        trainer.join()
    assert gone_within(worker.nanorft_alive, 2)
