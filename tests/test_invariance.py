"""The gradient of a step does not depend on how the batch is cut: micro-batches (token budget)
or trainer ranks. The loss is normalised by global token and sequence totals (losses.aggregate);
these tests check the whole trainer, KL and entropy terms on, a group filtered out."""

import pytest
import torch
import torch.multiprocessing as mp

AGGREGATIONS = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]


def batch() -> list[list]:
    """Three groups of mixed lengths; the last one's rewards are equal (zero_advantage drops it)."""
    from buffer import Experience

    groups = []
    for g, rewards in enumerate(([1.0, 0.0, 0.0, 1.0], [0.0, 1.0, 1.0, 1.0], [1.0] * 4)):
        group = []
        for i, reward in enumerate(rewards):
            response = [20 + g + j for j in range(2 + 5 * i + g)]  # 2 .. 19 tokens
            prompt = [5, 6, 7 + g, 8][: 2 + g]
            behaviour = [-10.8 - 0.02 * j for j in range(len(response))]  # near the policy's
            tokens = prompt + response
            group.append(
                Experience(
                    tokens, len(prompt), behaviour, [1] * len(response), reward, f"g{g}", "t", 0
                )
            )
        groups.append(group)
    return groups


def gradients(model_path: str, flags: list[str]) -> list[torch.Tensor]:
    """The full gradient of each published parameter after one step on `batch()` (every rank
    takes part; the process group is initialised)."""
    import components
    import run

    cfg = run.parse_config(["--config", "configs/tiny.toml", "--lr", "0", *flags])
    trainer = components.make_trainer(cfg, model_path, torch.device("cpu"))
    got = []
    step = trainer.optimizer_step

    def record_then_step() -> float:
        for _, p in trainer.named_trained_parameters():
            g = p.grad
            g = g.full_tensor() if hasattr(g, "full_tensor") else g
            got.append(g.to_dense().clone() if g.is_sparse else g.clone())
        return step()

    trainer.optimizer_step = record_then_step
    m = trainer.step(batch())
    assert m["filter/zero_advantage"] == 4  # the constant group
    return got


def rank_main(rank: int, world: int, port: int, model_path: str, flags: list[str], q) -> None:
    import os

    import torch.distributed as dist

    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world)})
    init = f"tcp://127.0.0.1:{port}"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        grads = {agg: gradients(model_path, [*flags, "--loss-agg", agg]) for agg in AGGREGATIONS}
        if rank == 0:
            q.put({agg: [g.tolist() for g in got] for agg, got in grads.items()})
    finally:
        dist.destroy_process_group()


def in_ranks(world: int, model_path: str, flags: list[str]) -> dict[str, list[torch.Tensor]]:
    """`gradients` of each aggregation in `world` spawned gloo ranks (FSDP2 shards the model
    when world > 1)."""
    import launch

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = launch.free_port()
    procs = [
        ctx.Process(target=rank_main, args=(r, world, port, model_path, flags, q))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    import queue

    try:
        while True:  # until rank 0 has put the gradients, or every rank has ended without
            try:
                got = q.get(timeout=1)
                break
            except queue.Empty:
                assert any(p.is_alive() for p in procs), [p.exitcode for p in procs]
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs)
    return {agg: [torch.tensor(g) for g in grads] for agg, grads in got.items()}


@pytest.mark.slow
def test_the_gradient_is_the_same_for_any_token_budget_and_any_number_of_ranks(tiny_model):
    flags = [
        "--kl-loss-coef",
        "0.1",
        "--kl-estimator",
        "k3",
        "--entropy-coef",
        "0.01",
        "--filters",
        '{"zero_advantage": {}}',
        "--no-activation-checkpointing",
    ]
    whole = in_ranks(1, tiny_model, [*flags, "--token-budget", "4096"])
    cut = in_ranks(1, tiny_model, [*flags, "--token-budget", "64"])
    ranks = in_ranks(2, tiny_model, [*flags, "--token-budget", "4096"])
    for agg in AGGREGATIONS:
        assert any(g.abs().max() > 1e-2 for g in whole[agg]), agg
        for a, b, c in zip(whole[agg], cut[agg], ranks[agg]):
            assert torch.allclose(a, b, atol=1e-6), (agg, (a - b).abs().max())
            assert torch.allclose(a, c, atol=1e-6), (agg, (a - c).abs().max())
