"""The experience operators of `--experience-pipeline` (pipelines.EXPERIENCE_OPS; Trinity-RFT report
3.4.2)."""

from buffer import Experience
from extras.filters import repetition_filter
from extras.judge import RATINGS, expected_rating
from extras.pipelines import ExperienceContext, response_text, shape

_EMBEDDERS: dict = {}


def quality_reward(
    groups: list[list[Experience]],
    ctx: ExperienceContext,
    model: str = "",
    url: str = "",
    weight: float = 1.0,
    timeout_s: float = 60.0,
) -> list[list[Experience]]:
    """Add weight * (s - 3) / 4 to each reward, s = 1..5 a judge's rating (Data-Juicer's
    llm_quality_score_filter)."""
    from extras.judge import ask_judge

    ratings = []
    for g in groups:
        question = ctx.tokenizer.decode(g[0].tokens[: g[0].prompt_length], skip_special_tokens=True)
        for e in g:
            msgs = [
                {
                    "role": "user",
                    "content": f"Rate the quality of this answer from 1 (bad) to 5 (excellent). "
                    f"Reply with one digit.\n{question}\nAnswer: {response_text(e, ctx.tokenizer)}",
                }
            ]
            ratings.append(expected_rating(ask_judge(msgs, RATINGS, model, url, timeout_s)))
            shape(e, "quality", weight * (ratings[-1] - 3) / 4)
    ctx.metrics.update(
        {
            "pipeline/quality_reward/shaped": len(ratings),
            "pipeline/quality_reward/rating_mean": sum(ratings) / max(1, len(ratings)),
            "pipeline/quality_reward/bonus_mean": weight
            * (sum(ratings) / max(1, len(ratings)) - 3)
            / 4,
        }
    )
    return groups


def embed(texts: list[str], model: str):
    """Unit-length embeddings [N, H] (float32) of `texts`: the mean last hidden state of local model
    `model`."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    if model not in _EMBEDDERS:
        tok = AutoTokenizer.from_pretrained(model)
        tok.pad_token = tok.pad_token or tok.eos_token
        _EMBEDDERS[model] = tok, AutoModel.from_pretrained(model, dtype=torch.float32).eval()
    tok, lm = _EMBEDDERS[model]
    batch = tok([t or " " for t in texts], return_tensors="pt", padding=True)
    with torch.no_grad():
        hidden = lm(**batch).last_hidden_state  # [N, T, H]
    mask = batch["attention_mask"].unsqueeze(-1).float()  # [N, T, 1]
    mean = (hidden * mask).sum(1) / mask.sum(1)  # [N, H]
    return torch.nn.functional.normalize(mean, dim=-1)


def diversity_reward(
    groups: list[list[Experience]],
    ctx: ExperienceContext,
    model: str = "",
    weight: float = 0.5,
    final_weight: float | None = None,
    decay_steps: int = 0,
) -> list[list[Experience]]:
    """Add w_t * (max_j sim_j - sim_i) / (max_j sim_j - min_j sim_j), sim_i the cosine similarity to
    the group's mean embedding, w_t from `weight` to `final_weight` over `decay_steps`
    (Data-Juicer's group_diversity_filter)."""
    import torch

    w = (
        weight
        if final_weight is None or decay_steps <= 0
        else (weight + (final_weight - weight) * min(1.0, ctx.step / decay_steps))
    )
    sims, bonuses = [], []
    for g in groups:
        emb = embed([response_text(e, ctx.tokenizer) for e in g], model or ctx.model)  # [G, H]
        sim = emb @ torch.nn.functional.normalize(emb.mean(0), dim=0)  # [G]
        span = float(sim.max() - sim.min())
        for e, s in zip(g, sim.tolist()):
            bonus = w * (float(sim.max()) - s) / span if span > 1e-6 else 0.0
            shape(e, "diversity", bonus)
            bonuses.append(bonus)
        sims += sim.tolist()
    ctx.metrics.update(
        {
            "pipeline/diversity_reward/weight": w,
            "pipeline/diversity_reward/similarity_mean": sum(sims) / max(1, len(sims)),
            "pipeline/diversity_reward/bonus_mean": sum(bonuses) / max(1, len(bonuses)),
        }
    )
    return groups


def clean(
    groups: list[list[Experience]],
    ctx: ExperienceContext,
    max_tokens: int = 0,
    ngram: int = 0,
    max_repeat_frac: float = 0.5,
    dedup: bool = False,
) -> list[list[Experience]]:
    """Drop rollouts over `max_tokens` policy tokens, with repeating `ngram`-grams, and `dedup`
    repeats (0: off)."""
    counts, out = dict.fromkeys(("length", "repetition", "duplicate"), 0), []
    for g in groups:
        kept, seen = [], set()
        for e in g:
            text = response_text(e, ctx.tokenizer) if dedup else None
            why = (
                "length"
                if max_tokens and sum(e.action_mask) > max_tokens
                else "repetition"
                if ngram
                and not repetition_filter(
                    e.tokens,
                    e.behaviour_logprobs,
                    0.0,
                    e.action_mask,
                    ngram=ngram,
                    max_repeat_frac=max_repeat_frac,
                )
                else "duplicate"
                if dedup and text in seen
                else None
            )
            if why:
                counts[why] += 1
            else:
                kept.append(e)
                seen.add(text)
        out.append(kept)
    ctx.metrics.update({f"pipeline/clean/dropped_{k}": v for k, v in counts.items()})
    return out
