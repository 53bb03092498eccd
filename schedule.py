"""When the explorer may generate and when the trainer publishes: the sync schedule of every
mode (Trinity-RFT semantics, arXiv:2505.17826 sec. 2.2), and the pacing protocol `Pace` that
the explorer's loop (`run.explorer_loop`) follows. A module of its own because both sides
follow it: the trainer's loop (run.rl_loop) asks `publishes_after`, the explorer asks its
`Pace`.

Mode both, sync_interval k = 2, sync_offset m = 0 (the default job). Explorer batch e is
generated with weight version required_version(e) = k * floor(max(0, e - m) / k); the
trainer trains batch t at step t and publishes version t + 1 after every step with
(t + 1) % k == 0:

    explorer | b0 (v0) | b1 (v0) |   wait   | b2 (v2) | b3 (v2) |   wait   | b4 (v4) | ...
    trainer  |  wait   |   t0    | t1 -> v2 |  wait   |   t2    | t3 -> v4 |  wait   | ...

(tN: the step that trains batch bN; "-> v2": then publishes version 2.) The explorer
evaluates after the last batch of a version, while it waits.

sync_interval 1, offset 0 is strict on-policy (every batch waits for the step before it);
offset 1 lets the explorer run one batch ahead (one-step off-policy); sync_interval k lets
it generate k batches per version while the trainer works. In-flight updates (PipelineRL,
--inflight) never pause generation: `Pace.inflight` runs between decode steps and takes a
published version at once, and since every token records its behaviour log-prob the loss
stays exact for sequences that span two versions. Fully asynchronous launches (--mode
explore beside --mode train) pace by the buffer instead (mode explore's Backpressure):
two waiting batches stop the explorer, new weights are taken when published.
"""

from typing import Protocol

import sync


def required_version(batch: int, sync_interval: int, sync_offset: int) -> int:
    """Weight version explorer batch `batch` must be generated with:
    k * floor(max(0, e - m) / k)."""
    return sync_interval * (max(0, batch - sync_offset) // sync_interval)


def staleness_bound(cfg) -> int | None:
    """The most versions an experience of `cfg`'s schedule can lag the trainer when trained:
    in mode both sync_offset + sync_interval - 1 (batch e waits for required_version(e), and is
    trained at step e), else --max-staleness; None: no bound (-1, mode train)."""
    if cfg.mode == "both":
        return cfg.sync_offset + cfg.sync_interval - 1
    return cfg.max_staleness if cfg.max_staleness >= 0 else None


def staleness_warning(cfg, trust_region: bool) -> str | None:
    """The staleness guard: a warning line for a policy loss without a trust region
    (losses.PolicyLoss.trust_region) and no rollout correction, in a schedule that can train
    on experiences 2 or more versions old, where nothing bounds its step (tinker-cookbook PR
    #822: an unclipped importance-sampled loss destabilised at staleness 3 where PPO stayed
    stable); else None."""
    bound = staleness_bound(cfg)
    if trust_region or cfg.rollout_correction != "none" or (bound is not None and bound < 2):
        return None
    versions = "any number of" if bound is None else str(bound)
    return (
        f"warning: --policy-loss {cfg.policy_loss} has no trust region and no cap, and this "
        f"schedule trains on experiences up to {versions} versions old: use a clipped loss "
        "(ppo_clip), --rollout-correction tis-token with --old-logprobs recompute, or a "
        "schedule at most 1 version behind (sync_offset + sync_interval <= 2)"
    )


def publishes_after(step: int, sync_interval: int, total_steps: int) -> bool:
    """True if the trainer publishes weights (version step + 1) after 0-based `step`."""
    return (step + 1) % sync_interval == 0 or step == total_steps - 1


class Pace(Protocol):
    """What `run.explorer_loop` asks of its pace, in this order."""

    def join(self) -> None:
        """Before the first batch: join the weight sync (and load the start weights)."""

    def before_batch(self, batch: int) -> bool:
        """Wait until batch `batch` may be generated (its weights loaded); False: stop exploring."""

    def inflight(self) -> None:
        """Between decode steps (--inflight): take a version published meanwhile, if any."""

    def final(self) -> None:
        """After the last batch: take the last weights, for the final evaluation."""


class Schedule:
    """Mode both's `Pace`: batch e waits for required_version(e), the final evaluation for
    `last` (the version of the last step: the trainer publishes after it whatever the
    interval). The receiver (sync.Receiver) loads each version into the engine."""

    def __init__(self, cfg, receiver: sync.Receiver, last: int):
        self.cfg = cfg
        self.receiver = receiver
        self.last = last

    def join(self) -> None:
        # checkpoint sync: the start weights are loaded, the trainer may go on
        if self.receiver.port is None:
            self.receiver.log({"explorer/ready": True})
        self.receiver.join()

    def before_batch(self, batch: int) -> bool:
        self.receiver.until(required_version(batch, self.cfg.sync_interval, self.cfg.sync_offset))
        return True

    def inflight(self) -> None:
        if self.receiver.newest() > self.receiver.engine.version:
            self.receiver.receive()

    def final(self) -> None:
        self.receiver.until(self.last)
