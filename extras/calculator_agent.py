"""The example agent of `--workflow agent:...` (docs/agents.md, configs/calculator.toml): one tool,
`calculate`.
python run.py --workflow agent:extras.calculator_agent.calculator_agent --max-tokens 64
python -m extras.calculator_agent runs/calculator_demos.jsonl --n 300 --config configs/calculator.toml"""  # noqa: E501 (a command to copy whole)

import ast
import json
import operator
from pathlib import Path

from workflows import last_number

SYSTEM = (
    "You can use the calculate tool to evaluate arithmetic. When you know the result, "
    "reply with only the final answer, as a number."
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculate",
            "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]
MAX_TURNS = 3

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def calculate(expression: str) -> str:
    """The value of an arithmetic expression (numbers, + - * /, parentheses) as text, or
    "error: ..."."""

    def value(node):
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, (int, float))
            and not isinstance(node.value, bool)
        ):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError("only numbers, + - * / and parentheses")

    try:
        if len(expression) > 200:
            raise ValueError("expression too long")
        x = value(ast.parse(expression, mode="eval").body)
        return str(int(x)) if float(x).is_integer() else f"{x:.6g}"
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, RecursionError) as e:
        return f"error: {e}"


def run_tool(name: str, arguments: str) -> str:
    """A tool call's result: `calculate` with its JSON arguments, or an error text."""
    try:
        args = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return "error: arguments are not JSON"
    if name != "calculate" or not isinstance(args, dict):
        return f"error: no tool {name!r}"
    return calculate(str(args.get("expression", "")))


async def calculator_agent(client, task) -> dict:
    """One episode of up to MAX_TURNS model calls: the reward and the metrics used_tool, tool_calls,
    tool_errors."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task.question}]
    content, calls, errors = "", 0, 0
    for _ in range(MAX_TURNS):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        content = message.content or ""
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            result = run_tool(call.function.name, call.function.arguments)
            calls, errors = calls + 1, errors + result.startswith("error")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    answer = last_number(content)
    return {
        "reward": float(answer is not None and answer == last_number(task.answer)),
        "used_tool": float(calls > 0),
        "tool_calls": calls,
        "tool_errors": errors,
    }


def demonstration(task) -> dict:
    """{"messages": a perfect episode (one `calculate` call) on a reasoning-gym arithmetic `task`}
    as the endpoint renders it without template tools, for `--policy-loss sft`. ValueError: no
    expression, another answer."""
    from extras.chat_tools import hermes_messages

    expression = (task.entry.get("metadata") or {}).get("expression")
    if not isinstance(expression, str):
        raise ValueError(
            f"task {task.task_id}: no metadata.expression (a reasoning-gym arithmetic task has one)"
        )
    result = calculate(expression)
    if last_number(result) != last_number(task.answer):
        raise ValueError(
            f"task {task.task_id}: its expression {expression!r} is {result}, "
            f"its answer {task.answer} "
            "(reasoning-gym's basic_arithmetic without allow_parentheses evaluates * left to right)"
        )
    call = {
        "id": "call_0",
        "type": "function",
        "function": {"name": "calculate", "arguments": json.dumps({"expression": expression})},
    }
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": task.question},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": result},
        {"role": "assistant", "content": result},
    ]
    return {"messages": hermes_messages(messages, TOOLS)}


def main(argv: list[str] | None = None) -> None:
    """`python -m extras.calculator_agent OUT.jsonl --n 300 [run.py flags]`: the demonstrations of
    the first n training tasks of the run those flags describe."""
    import argparse

    from config import parse_config
    from extras.task_sources import load_tasks

    ap = argparse.ArgumentParser(prog="python -m extras.calculator_agent", description=main.__doc__)
    ap.add_argument("out", help="the JSONL file to write")
    ap.add_argument(
        "--n", type=int, default=300, help="number of transcripts (the first n training tasks)"
    )
    args, rest = ap.parse_known_args(argv)
    cfg = parse_config(rest)
    train, _, _ = load_tasks(
        cfg.task, cfg.task_kwargs, max(cfg.train_size, args.n), cfg.eval_size, cfg.seed
    )
    try:
        rows = [demonstration(t) for t in train[: args.n]]
    except ValueError as e:
        raise SystemExit(f"extras.calculator_agent: {e}") from None
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)  # runs/ of a fresh clone
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{len(rows)} demonstrations of {cfg.task} -> {args.out}")


if __name__ == "__main__":
    main()
