"""What a run keeps of its rollouts for a person to read: ``rollouts/step_N.jsonl`` in the run directory.

The orchestrator writes one file per step when it cuts that step's batch: one JSON object per rollout accounted
since the previous step's batch (the batch's own first, then the others in the order they were accounted), with
at least

- ``prompt``: the prompt as text (the prompt ids decoded, special tokens kept; the example's prompt where the
  rollout never got ids), ``completion``: the text the env scored (a chat env's messages after the prompt);
- ``reward``, ``advantage``, ``finish_reason`` (``stop``, ``length``, ... of the last model turn; None where
  nothing was generated), ``env`` (the example's task, or the ``[env]`` name), ``example`` (its id);
- ``prompt_ids``, ``completion_ids``, ``loss_mask``, ``versions`` (one per completion token, -1 on env tokens);
- ``outcome``: the rollout's ledger bucket, ``trained``, ``dropped`` (stale), ``masked: <reason>`` or
  ``failed`` (with ``error``).

``[run] keep_rollouts = false`` writes none; ``[run] rollouts_max_mb`` caps the folder (the oldest step files
are deleted first, with one warning). ``i3core rollouts RUN_DIR [--step N]`` prints a step's file. Rollouts
accounted after the last batch of a run are in no file.

Imports the contract and :mod:`i3core.loop.paths` only.
"""

import json
import math
from pathlib import Path
from typing import Any

import structlog

from i3core.errors import I3Error
from i3core.files import atomic_write_bytes
from i3core.loop.paths import RunPaths

log = structlog.get_logger("i3core.rollouts")

TRAINED, DROPPED, FAILED = "trained", "dropped", "failed"
MASKED = "masked: {reason}"
"""The ledger outcome of a masked rollout, with its reason."""


def _finite(value: float | None) -> float | None:
    """JSON has no NaN or infinity: those are written as null."""
    return value if value is None or math.isfinite(value) else None


def _prompt_text(example, prompt_ids: list[int], tokenizer) -> Any:
    if tokenizer is not None and prompt_ids:
        return tokenizer.decode(prompt_ids, skip_special_tokens=False)
    return example.prompt


def record(rollout, outcome: str, env: str, tokenizer=None) -> dict:
    """The line of ``rollout`` (a :class:`~i3core.types.Rollout`) with its ledger ``outcome``."""
    example = rollout.example
    completion = rollout.completion_text or rollout.state.get("completion") or ""
    return {
        "example": example.id, "env": example.task or env, "outcome": outcome,
        "prompt": _prompt_text(example, rollout.prompt_ids, tokenizer), "completion": completion,
        "reward": _finite(rollout.reward), "advantage": _finite(rollout.advantage),
        "finish_reason": rollout.finish_reason,
        "prompt_ids": list(rollout.prompt_ids), "completion_ids": list(rollout.completion_ids),
        "loss_mask": [bool(m) for m in rollout.completion_mask], "versions": list(rollout.completion_versions),
        **({} if rollout.completion_advantages is None else
           {"advantages": [_finite(a) for a in rollout.completion_advantages]}),
    }  # fmt: skip


def unscored(example, outcome: str, env: str, error: str | None = None) -> dict:
    """The line of a rollout that ended without a :class:`~i3core.types.Rollout` (masked or failed in the env)."""
    return {
        "example": example.id, "env": example.task or env, "outcome": outcome, "prompt": example.prompt,
        "completion": None, "reward": None, "advantage": None, "finish_reason": None, "prompt_ids": [],
        "completion_ids": [], "loss_mask": [], "versions": [], **({} if error is None else {"error": error}),
    }  # fmt: skip


class RolloutLog:
    """The lines accounted since the last step's file, written as ``rollouts/step_N.jsonl`` by :meth:`write`."""

    def __init__(self, out: Path, keep: bool, max_bytes: int):
        self.folder = RunPaths(out).rollouts
        self.keep, self.max_bytes = keep, max_bytes
        self.pending: list[dict] = []
        self._warned = False
        self._sizes: dict[int, int] | None = None
        """``{step: bytes}`` of the files in the folder, read once (a resumed run's too), then kept up to date."""

    def add(self, line: dict) -> None:
        if self.keep:
            self.pending.append(line)

    def write(self, step: int) -> list[dict]:
        """Write the pending lines as ``step``'s file (trained ones first); the lines written."""
        lines = sorted(self.pending, key=lambda line: line["outcome"] != TRAINED)
        self.pending = []
        if not self.keep:
            return lines
        self.folder.mkdir(parents=True, exist_ok=True)
        data = "".join(json.dumps(line, default=str) + "\n" for line in lines).encode()
        if self._sizes is None:
            self._sizes = {n: path.stat().st_size for n, path in step_files(self.folder).items()}
        atomic_write_bytes(self.folder / f"step_{step}.jsonl", data)
        self._sizes[step] = len(data)
        self._cap()
        return lines

    def _cap(self) -> None:
        """Delete the oldest step files while the folder is over ``max_bytes`` (the newest one always stays)."""
        total = sum(self._sizes.values())
        while total > self.max_bytes and len(self._sizes) > 1:
            oldest = min(self._sizes)
            total -= self._sizes.pop(oldest)
            (self.folder / f"step_{oldest}.jsonl").unlink(missing_ok=True)
            if not self._warned:
                self._warned = True
                log.warning("rollouts/ is over [run] rollouts_max_mb: deleting the oldest step files",
                            max_mb=self.max_bytes / 2**20)


def step_files(folder: Path) -> dict[int, Path]:
    """``{step: rollouts/step_N.jsonl}`` of a run's rollouts folder."""
    found = {}
    for path in folder.glob("step_*.jsonl"):
        try:
            found[int(path.stem.removeprefix("step_"))] = path
        except ValueError:
            continue
    return found


def read(run_dir: Path, step: int | None = None) -> tuple[int, list[dict]]:
    """``(step, lines)`` of ``step``'s file (default: the newest); an :class:`I3Error` for a bad dir or step, or a
    file without one readable line. Malformed lines (a file edited or damaged) are skipped with one warning that
    counts them and gives their numbers."""
    folder = RunPaths(run_dir).rollouts
    if not run_dir.is_dir():
        raise I3Error(f"{run_dir} is not a directory")
    files = step_files(folder)
    if not files:
        raise I3Error(f"{run_dir} has no rollouts (no {folder.name}/step_N.jsonl: not a run directory, a run "
                      "before its first step, or [run] keep_rollouts = false)")
    if step is None:
        step = max(files)
    if step not in files:
        raise I3Error(f"{run_dir} has no rollouts of step {step} (steps {min(files)}-{max(files)} are kept)")
    try:
        text = files[step].read_text(encoding="utf-8")
    except (OSError, ValueError) as exc:
        raise I3Error(f"{files[step]} cannot be read: {exc}") from None
    lines, malformed = [], []
    for number, raw in enumerate(text.splitlines(), 1):
        if raw.strip():
            line = _parsed(raw)
            (lines if line is not None else malformed).append(line if line is not None else number)
    if malformed:
        if not lines:
            raise I3Error(f"{files[step]} has no readable rollout: its {len(malformed)} lines are not rollout objects")
        log.warning("malformed lines skipped", file=str(files[step]), count=len(malformed), lines=malformed[:10])
    return step, lines


_TOKEN_LISTS = ("prompt_ids", "completion_ids", "loss_mask", "versions")


def _parsed(raw: str) -> dict | None:
    """The rollout of one line, or None if it is not one :func:`render` can show (not JSON, not an object, a token
    list that is not a list, a version that is not a whole number)."""
    try:
        line = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(line, dict) or not all(isinstance(line.get(k, []), list) for k in _TOKEN_LISTS):
        return None
    return line if all(isinstance(v, int) for v in line.get("versions", [])) else None


def _text(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(m, dict) and "role" in m for m in value):  # chat messages
        return "\n".join(f"[{m['role']}] {m.get('content') or ''}" for m in value)
    return json.dumps(value, default=str)


def _number(value) -> str:
    return "-" if value is None else f"{value:+.4f}" if isinstance(value, float) else str(value)


def render(step: int, lines: list[dict]) -> str:
    """``lines`` of ``step`` for a person: one header per rollout, then its prompt and completion, indented as
    they are (the completion's end shown with ``⏎`` where it ends in a newline)."""
    out = [f"step {step}: {len(lines)} rollouts\n"]
    for index, line in enumerate(lines, 1):
        model = [v for v, m in zip(line.get("versions", []), line.get("loss_mask", [])) if m]
        versions = "-" if not model else f"{min(model)}" if min(model) == max(model) else f"{min(model)}-{max(model)}"
        out.append(f"\n#{index} {line.get('env') or '-'} {line.get('example', '')}  {line.get('outcome') or '-'}  "
                   f"reward {_number(line.get('reward'))}  advantage {_number(line.get('advantage'))}  "
                   f"finish {line.get('finish_reason') or '-'}  tokens {len(line.get('prompt_ids', []))}+"
                   f"{len(line.get('completion_ids', []))} (trained {sum(map(bool, line.get('loss_mask', [])))})  "
                   f"versions {versions}\n")
        if line.get("error"):
            out.append(f"  error: {line['error']}\n")
        for label in ("prompt", "completion"):
            text = _text(line.get(label))
            if label == "completion" and text.endswith("\n"):
                text = text[:-1] + "⏎"
            body = "\n".join("    " + row for row in text.split("\n"))
            out.append(f"  {label}:\n{body}\n")
    return "".join(out)
