"""Task selectors besides workflows.Shuffle (extras/pipelines.py's SELECTORS): sequential,
random, easy2hard, BOTS."""

import math

import numpy as np

from workflows import Selector, Task

NEEDS_DIFFICULTY = (
    "selector easy2hard needs a difficulty for every task: add metadata_difficulty, "
    "pass_rate_difficulty, model_difficulty or your own operator to task_pipeline"
)


class Sequential(Selector):
    """The task list in its own order (after the task pipeline), cycled."""


class RandomTasks(Selector):
    """k distinct tasks drawn uniformly (Trinity-RFT's RandomSelector; seeded by the count drawn:
    resumes)."""

    def next(self, k: int) -> list[int]:
        out = (
            np.random.default_rng([self.seed, self.cursor])
            .choice(len(self.tasks), min(k, len(self.tasks)), replace=False)
            .tolist()
        )
        self.cursor += k
        return (out * (k // len(out) + 1))[:k]


class Easy2Hard(Selector):
    """The tasks by ascending difficulty, cycled (Trinity-RFT's offline_easy2hard); ValueError
    without."""

    def __init__(self, tasks: list[Task], seed: int):
        super().__init__(tasks, seed)
        if any(t.difficulty is None for t in tasks):
            raise ValueError(NEEDS_DIFFICULTY)
        self.order = sorted(range(len(tasks)), key=lambda i: tasks[i].difficulty)

    @staticmethod
    def check_config(cfg) -> None:
        """ValueError without a task pipeline (the difficulties come from it)."""
        if not cfg.task_pipeline:
            raise ValueError(NEEDS_DIFFICULTY)


class DiffBased(Selector):
    """Difficulty-targeted selection (BOTS, Trinity-RFT `diff_based`:
    trinity/buffer/selector/selector.py @ 3e9eb605 DiffBasedSelector, diff_estimator.py @ 607f1dbd
    InterpolationBetaPREstimator). Task i has a Beta(alpha_i, beta_i) belief over its pass rate;
    after a batch with pass rates pr_j:
        cap  <- (mean pr - mean f0_j) / (mean f1_j - mean f0_j + 1e-6)   (EMA, discount 0.9)
        p~_i  = clip((f1_i - f0_i) * cap + f0_i, 0, 1), and p~_j = pr_j
        alpha <- (1 - lamb) alpha + lamb + (1 - rho) s_bar + rho m p~
        beta  <- (1 - lamb) beta  + lamb + (1 - rho) f_bar + rho m (1 - p~)
    with s_bar_j = m pr_j, f_bar_j = m (1 - pr_j) (0 if not selected), f0 = 0, f1 = 1 - difficulty
    (min-max normalised; 0.5 without). Score -|target - p|, p the Beta mean (a draw with do_sample);
    tau 0: the top k, else k from softmax(score / tau)."""

    @staticmethod
    def check_config(cfg) -> None:
        """ValueError with task pools (pool_easy / pool_hard) set: it targets a difficulty
        itself."""
        if math.isfinite(cfg.pool_easy) or math.isfinite(cfg.pool_hard):
            raise ValueError(
                "selector diff_based already targets a difficulty: "
                "leave pool_easy / pool_hard unset"
            )

    def __init__(
        self,
        tasks: list[Task],
        seed: int,
        target: float = 0.5,
        tau: float = 0.0,
        do_sample: bool = True,
        m: int = 16,
        lamb: float = 0.2,
        rho: float = 0.2,
        adaptive_rho: bool = False,
    ):
        super().__init__(tasks, seed)
        self.target, self.tau, self.do_sample, self.m, self.lamb, self.rho = (
            target,
            tau,
            do_sample,
            m,
            lamb,
            rho,
        )
        self.adaptive_rho, self.cap, self.picked_pass_rate = adaptive_rho, None, None
        d = np.array(
            [0.5 if t.difficulty is None else t.difficulty for t in tasks], dtype=float
        )  # [n]
        span = d.max() - d.min() if len(d) else 0.0
        prior = 1 - (d - d.min()) / span if span > 0 else np.full(len(d), 0.5)  # [n]
        self.features = np.stack([np.zeros(len(d)), prior], 1)  # [n, 2] (f0, f1)
        self.alphas, self.betas = np.ones(len(d)), np.ones(len(d))  # [n]
        self.rng = np.random.default_rng(seed)
        self.index = {t.task_id: i for i, t in enumerate(tasks)}

    def next(self, k: int) -> list[int]:
        k = min(k, len(self.tasks))
        predicted = (
            self.rng.beta(self.alphas, self.betas)
            if self.do_sample  # [n]
            else self.alphas / (self.alphas + self.betas)
        )
        scores = -np.abs(self.target - predicted)  # [n]
        self.cursor += k
        if self.tau == 0:
            out = np.argsort(-scores, kind="stable")[:k].tolist()
        else:
            p = np.exp((scores - scores.max()) / self.tau)
            out = self.rng.choice(len(scores), k, replace=False, p=p / p.sum()).tolist()
        self.picked_pass_rate = float(predicted[out].mean()) if out else None
        return out

    def metrics(self) -> dict:
        """selector/predicted_pass_rate: the mean predicted pass rate of the latest picks."""
        return (
            {}
            if self.picked_pass_rate is None
            else {"selector/predicted_pass_rate": self.picked_pass_rate}
        )

    def update(self, pass_rates: dict[str, float]) -> None:
        idx = [self.index[t] for t in pass_rates if t in self.index]
        if not idx:
            return
        pr = np.array([pass_rates[self.tasks[i].task_id] for i in idx])  # [k]
        anchor = self.features[idx].mean(0)  # [2]
        cap = (pr.mean() - anchor[0]) / (anchor[1] - anchor[0] + 1e-6)
        self.cap = cap if self.cap is None else 0.9 * self.cap + 0.1 * cap
        s_bar, f_bar = np.zeros(len(self.tasks)), np.zeros(len(self.tasks))  # [n]
        s_bar[idx], f_bar[idx] = pr * self.m, (1 - pr) * self.m
        p_tilde = np.clip(
            (self.features[:, 1] - self.features[:, 0]) * self.cap + self.features[:, 0], 0, 1
        )
        if self.adaptive_rho and np.abs(p_tilde[idx] - pr).mean() >= 0.25:
            self.rho *= 0.5
        p_tilde[idx] = pr
        self.alphas = (
            (1 - self.lamb) * self.alphas
            + self.lamb
            + (1 - self.rho) * s_bar
            + self.rho * p_tilde * self.m
        )
        self.betas = (
            (1 - self.lamb) * self.betas
            + self.lamb
            + (1 - self.rho) * f_bar
            + self.rho * (1 - p_tilde) * self.m
        )

    def state(self) -> dict:
        return {
            "cursor": self.cursor,
            "alphas": self.alphas.tolist(),
            "betas": self.betas.tolist(),
            "cap": self.cap,
            "rho": self.rho,
            "rng": self.rng.bit_generator.state,
        }

    def restore(self, state: dict) -> None:
        self.cursor, self.cap, self.rho = state["cursor"], state["cap"], state["rho"]
        self.alphas, self.betas = np.array(state["alphas"]), np.array(state["betas"])
        self.rng.bit_generator.state = state["rng"]
