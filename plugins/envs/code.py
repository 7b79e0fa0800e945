"""``code``: the model writes a Python function; its tests run in the rollout's sandbox; reward = pass rate.

The dataset is :data:`~i3core.plugins.envs.code_problems.PROBLEMS` (small
problems written for i3core, each with tests and a reference solution, the
SFT demonstration). The program is the last fenced code block of the
model's last turn (or the whole turn if it has none). ``solution.py`` and a
test harness are written into the sandbox and run with ``python3``; each
test expression is evaluated in the solution's namespace and reported on its
own line as it finishes, so a program that hangs or dies mid-way still gets
credit for the tests before.

Threat model: the model's program runs only inside the sandbox (see
:mod:`~i3core.plugins.envs.sandbox`). The harness marks its result lines
with a per-rollout random nonce that it reads from a file and deletes
before importing the solution, so a program cannot print a fake pass line by
reading the nonce from the environment or the work directory. Not covered:
a program that inspects the harness's memory (its frames or the garbage
collector) can find the nonce and forge results. Reward hacking of that kind
is logged as a pass; audit high-reward programs if it matters.
"""

import json
import random
import re
import secrets

from pydantic import Field

from i3core.plugins.envs.code_problems import PROBLEMS, Problem
from i3core.plugins.envs.rubric import Rubric
from i3core.plugins.envs.sandbox import SandboxConfig, SandboxEnv
from i3core.types import Example

CODE_BLOCK = re.compile(r"```(?:python|py)?[^\n]*\n(.*?)(?:```|$)", re.DOTALL)
THINK = re.compile(r"<think>.*?(</think>|$)", re.DOTALL)
SYSTEM_PROMPT = "Write the Python function. Reply with code only."
MARK = "I3CORE_TEST"

HARNESS = '''\
import json, os, sys
with open("nonce") as f:
    nonce = f.read()
os.remove("nonce")
tests = json.loads(open("tests.json").read())
os.remove("tests.json")
def report(i, ok, error=""):
    print(f"{MARK} {nonce} {i} {int(ok)} {error[:200]!r}", flush=True)
try:
    import solution
    namespace = dict(vars(solution))
except BaseException as e:
    print(f"{MARK} {nonce} import 0 {type(e).__name__}: {e}"[:300], flush=True)
    sys.exit(0)
for i, test in enumerate(tests):
    try:
        ok = bool(eval(test, dict(namespace)))
        report(i, ok)
    except BaseException as e:
        report(i, False, f"{type(e).__name__}: {e}")
'''.replace("{MARK}", MARK)


def extract_program(text: str) -> str:
    """The last fenced code block of ``text`` (reasoning in ``<think>`` ignored), else the text itself."""
    text = THINK.sub("", text)
    blocks = CODE_BLOCK.findall(text)
    return (blocks[-1] if blocks else text).strip() + "\n"


def parse_results(stdout: str, nonce: str, total: int) -> tuple[list[bool], str | None]:
    """Each test's outcome (tests without a line failed) and the import error, from the harness's output."""
    passed = [False] * total
    import_error = None
    prefix = f"{MARK} {nonce} "
    for line in stdout.splitlines():
        if not line.startswith(prefix):
            continue
        index, _, rest = line[len(prefix):].partition(" ")
        if index == "import":
            import_error = rest[2:]
        elif index.isdigit() and int(index) < total:
            passed[int(index)] = rest.startswith("1")
    return passed, import_error


def problem_example(problem: Problem) -> Example:
    prompt = f"def {problem.signature}: {problem.task}"
    return Example(id=f"code-{problem.name}", prompt=[{"role": "user", "content": prompt}],
                   answer=list(problem.tests), info={"name": problem.name, "solution": problem.solution})


class CodeEnv(SandboxEnv):
    """Write a Python function; reward = the share of its tests that pass in the sandbox."""

    class Config(SandboxConfig):
        max_turns: int = Field(1, ge=1, description="Model turns (more make sense with shell_tool).")
        max_tokens: int = Field(160, ge=1, description="Tokens per model turn.")
        max_total_tokens: int = Field(384, ge=8, description="Prompt + every turn, in tokens.")
        system_prompt: str | None = Field(SYSTEM_PROMPT, description="Prepended as a system message.")
        test_timeout_s: float = Field(10.0, gt=0, description="Limit of the whole test run of one program.")
        num_examples: int | None = Field(None, ge=1, description="Use the first N problems (None: all).")

    def load_examples(self) -> list[Example]:
        examples = [problem_example(p) for p in PROBLEMS]
        random.Random(self.config.seed).shuffle(examples)
        return examples[: self.config.num_examples]

    def demonstration(self, example: Example) -> str:
        return f"```python\n{example.info['solution']}```"

    def build_rubric(self) -> Rubric:
        async def pass_rate(state: dict) -> float:
            return await self.run_tests(state)

        return Rubric([pass_rate])

    async def run_tests(self, state: dict) -> float:
        """Run the program of the last assistant turn against the example's tests; the share that pass."""
        tests = state["example"].answer
        reply = next((m.get("content") or "" for m in reversed(state["completion"]) if m["role"] == "assistant"), "")
        nonce = secrets.token_hex(16)
        sandbox = state["sandbox"]
        await sandbox.write_file("solution.py", extract_program(reply))
        await sandbox.write_file("tests.json", json.dumps(tests))
        await sandbox.write_file("nonce", nonce)
        await sandbox.write_file("harness.py", HARNESS)
        result = await sandbox.exec(["python3", "harness.py"], timeout=self.config.test_timeout_s)
        passed, import_error = parse_results(result.stdout, nonce, len(tests))
        state["metrics"]["compiled"] = float(import_error is None and any(line.startswith(f"{MARK} {nonce} ")
                                                                         for line in result.stdout.splitlines()))
        state["metrics"]["tests_timed_out"] = float(result.timed_out)
        return sum(passed) / len(tests)
