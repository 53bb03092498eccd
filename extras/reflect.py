"""`--workflow reflect`: experience synthesis by reflection."""

import asyncio

from buffer import Experience
from workflows import MathWorkflow, Task, chat_ids


class ReflectWorkflow(MathWorkflow):
    """n rollouts; each wrong one answered again after "incorrect", the first correct one kept
    (arXiv:2505.17826)."""

    async def run(self, task: Task, engine, n: int) -> list[Experience]:
        group = await super().run(task, engine, n)
        wrong = [e for e in group if e.reward != 1.0]
        base = self.system() + [{"role": "user", "content": task.question}]
        prompts = [
            chat_ids(
                self.tokenizer,
                base
                + [
                    {"role": "assistant", "content": e.info["response"]},
                    {
                        "role": "user",
                        "content": "That answer is incorrect. Check your work and give the "
                        "final answer again.",
                    },
                ],
                True,
            )
            for e in wrong
        ]
        outs = await asyncio.gather(*(engine.generate(p, 1, self.sampling) for p in prompts))
        for e, p, (out,) in zip(wrong, prompts, outs):
            text = self.tokenizer.decode(out.tokens, skip_special_tokens=True)
            reward, _ = await self.score(task, text)
            if reward == 1.0:
                info = {
                    "reflection": True,
                    "response": text,
                    "answer": task.answer,
                    "versions": list(out.versions),
                    "finish_reason": out.finish_reason,
                }
                group.append(
                    Experience(
                        p + out.tokens,
                        len(p),
                        out.behaviour_logprobs,
                        [1] * len(out.tokens),
                        1.0,
                        e.group_id,
                        task.task_id,
                        out.versions[0],
                        info,
                    )
                )
                break
        return group
