"""A small tool-using agent written only against the `openai` package, bundled as the
example of `--workflow agent:...` (docs/agents.md):

    python run.py --workflow agent:extras.calculator_agent.calculator_agent --max-tokens 64

It offers the model one tool, `calculate`, runs the model's tool calls, sends the results
back, and returns reward 1 when the final answer's last number is the task's answer (0
otherwise). Any task with a numeric answer works (the default basic_arithmetic).
"""
from __future__ import annotations

import ast
import json
import operator

from workflows import last_number

SYSTEM = ("You can use the calculate tool to evaluate arithmetic. When you know the result, "
          "reply with only the final answer, as a number.")
TOOLS = [{"type": "function", "function": {
    "name": "calculate", "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
MAX_TURNS = 3

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(expression: str) -> str:
    """The value of an arithmetic expression (numbers, + - * /, parentheses) as text, or
    "error: ..." for anything else; never raises, never evaluates other Python."""
    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
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


async def calculator_agent(client, task) -> float:
    """One episode: up to MAX_TURNS model calls, each tool call answered; reward 1 when the
    final reply's last number equals the task's answer."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task.question}]
    content = ""
    for _ in range(MAX_TURNS):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        content = message.content or ""
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": run_tool(call.function.name, call.function.arguments)})
    answer = last_number(content)
    return float(answer is not None and answer == last_number(task.answer))
