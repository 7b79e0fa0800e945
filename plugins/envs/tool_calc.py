"""``tool-calc``: arithmetic word problems solved with a calculator tool, over several turns.

The model may call ``calculate(expression)`` as often as it likes (within
``max_turns``) and ends with ``Answer: N``. Reward 1 for the exact answer in
the last turn; the metric ``used_calculator`` says whether it called the tool.
"""

import ast
import operator
import random
import re

from pydantic import Field

from i3core.plugins.envs.rubric import Rubric
from i3core.plugins.envs.tools import ToolConfig, ToolEnv
from i3core.types import Example

SYSTEM_PROMPT = "Use the calculator. End with: Answer: N"
ANSWER = re.compile(r"Answer:\s*(-?\d+)")
MAX_EXPRESSION_CHARS = 200
"""Longer expressions are refused (a model could ask for 9**9**9)."""
MAX_POWER = 64
MAX_RESULT_BITS = 4096
"""A power whose result would be wider than this is refused before it is computed (nested powers such as
((9**64)**64)**64 would otherwise take seconds to hours, and memory)."""
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
        ast.Mod: operator.mod, ast.Pow: operator.pow, ast.Div: operator.truediv}


def calculate(expression: str) -> str:
    """Evaluate arithmetic (+ - * / // % ** and parentheses).

    :param expression: the expression, e.g. "(3 + 4) * 12"
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    value = _eval(ast.parse(expression, mode="eval").body)
    return str(int(value) if isinstance(value, float) and value.is_integer() else value)


def _eval(node):
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _eval(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            if abs(right) > MAX_POWER:
                raise ValueError(f"exponent above {MAX_POWER}")
            wide = isinstance(left, int) and isinstance(right, int) and abs(left).bit_length() * abs(right)
            if wide and wide > MAX_RESULT_BITS:
                raise ValueError(f"result wider than {MAX_RESULT_BITS} bits")
        return _OPS[type(node.op)](left, right)
    raise ValueError(f"unsupported expression element: {type(node).__name__}")


def final_answer(completion: list[dict]) -> str | None:
    """The ``Answer: N`` of the last assistant message, or None."""
    for message in reversed(completion):
        if message["role"] == "assistant":
            found = ANSWER.findall(message.get("content") or "")
            return found[-1] if found else None
    return None


class ToolCalc(ToolEnv):
    """Compute ``a op b op c`` with a calculator tool; reward 1 for the exact integer answer."""

    class Config(ToolConfig):
        num_examples: int = Field(1000, ge=1, description="Size of the generated dataset.")
        max_operand: int = Field(99, ge=2, description="Operands are drawn from 2..max_operand.")
        terms: int = Field(3, ge=2, le=5, description="Numbers in each problem.")
        system_prompt: str | None = Field(SYSTEM_PROMPT, description="Prepended as a system message.")

    tools = (calculate,)

    def load_examples(self) -> list[Example]:
        rng = random.Random(self.config.seed)
        rows = []
        for i in range(self.config.num_examples):
            numbers = [rng.randint(2, self.config.max_operand) for _ in range(self.config.terms)]
            ops = [rng.choice("+-*") for _ in range(self.config.terms - 1)]
            expression = str(numbers[0]) + "".join(f"{op}{n}" for op, n in zip(ops, numbers[1:]))
            rows.append(Example(id=f"tool-calc-{i}", prompt=[{"role": "user", "content": expression}],
                                answer=calculate(expression)))
        return rows

    def build_rubric(self) -> Rubric:
        def correct(completion: list[dict], answer: str) -> float:
            return 1.0 if final_answer(completion) == answer else 0.0

        def used_calculator(state: dict) -> float:
            return float(state["metrics"].get("tool_calls", 0) > 0)

        rubric = Rubric([correct])
        rubric.add_metric(used_calculator)
        return rubric
