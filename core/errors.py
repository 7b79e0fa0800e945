"""Errors that reach the user as one clear line (the CLI prints them, no traceback)."""

import difflib
from collections.abc import Iterable


class I3Error(Exception):
    """An error caused by input (a config, a plugin, a request): shown as one line."""

    exit_code = 1


class PluginError(I3Error):
    """A plugin is broken: it fails to import, misnames a hook or clashes with another."""


class HookFailed(PluginError):
    """A plugin's event hook raised (the core calls them through :meth:`i3core.manager.Plugins.call`): the line
    names the plugin and the hook; ``__cause__`` is what the plugin raised."""

    def __init__(self, message: str, hook: str):
        super().__init__(message)
        self.hook = hook


class ServerError(I3Error):
    """An inference server answered with an error or could not be reached."""


class RequestRefused(ServerError):
    """An inference server refused one request as malformed (a 4xx: a prompt longer than its context, a field out
    of bounds). The request's fault, not the server's: the rollout that asked is counted as failed and the server
    is not marked down (a :class:`ServerError` still, for callers that do not tell them apart)."""


class SequenceFailed(I3Error):
    """One generation failed alone on its server (non-finite logits, a sampler error); the server goes on.

    Not a :class:`ServerError`: the server is not marked down; the rollout that asked is counted as failed.
    """


class EngineFailed(I3Error):
    """An inference engine broke (not one request's fault) and cannot go on: every caller waiting on it gets
    this at once. The in-process ``local`` source's run fails with it; a server process exits non-zero and its
    supervisor restarts it."""


class RolloutMasked(I3Error):
    """A rollout that must not be trained on, for a reason worth counting (a sandbox died mid-rollout, ...).

    An environment raises it from ``rollout``; the orchestrator counts the
    rollout as masked under ``reason`` and keeps the rest of its group.
    """

    def __init__(self, reason: str, detail: str = ""):
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}" if detail else reason)


class SandboxError(I3Error):
    """A sandbox itself failed (it could not start, died, or its agent stopped answering).

    Not raised for a command that fails inside a healthy sandbox: that is an
    :class:`~i3core.types.ExecResult`. A rollout whose sandbox fails is masked.
    """


class SandboxFileError(I3Error):
    """A ``read_file``/``write_file`` path was refused: outside the work directory, through a symlink,
    missing, or too large. The sandbox is still healthy."""


class SandboxFileNotFound(SandboxFileError):
    """A ``read_file`` path names nothing (the sandbox agent answers 404 for it, 400 for other refusals)."""


class ConfigError(I3Error):
    """A plugins.toml has problems; ``problems`` holds every one of them."""

    exit_code = 2

    def __init__(self, problems: list["Problem"]):
        self.problems = problems
        super().__init__("\n".join(str(p) for p in problems))


class Problem:
    """One config problem: where (a TOML path such as ``loss.mask_lo``) and what."""

    def __init__(self, path: str, message: str):
        self.path = path
        self.message = message

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message

    def __repr__(self) -> str:
        return f"Problem({self.path!r}, {self.message!r})"


def exception_line(exc: BaseException) -> str:
    """``exc`` in one line for an error message: ``KeyError: 'x'`` (its first line), or its type alone."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest choice, or an empty string."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""
