"""Logging: structlog to the console for people, JSON lines under ``<output_dir>/logs/`` for tools.

Logging is process-wide by nature (one console, one stderr); :func:`configure`
is called by the CLI, never on import.
"""

import json
import logging
import sys
import traceback
from pathlib import Path
from typing import IO, Any

import structlog


class _JsonLinesTee:
    """A structlog processor that also writes each event as one JSON line to a file."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file: IO[str] | None = open(path, "a", encoding="utf-8")

    def __call__(self, logger: Any, method: str, event_dict: dict[str, Any]) -> dict[str, Any]:
        row = dict(event_dict)
        if row.get("exc_info"):
            row["exception"] = "".join(traceback.format_exception(*_exc_tuple(row.pop("exc_info"))))
        if self._file is None:
            return event_dict
        try:
            self._file.write(json.dumps(row, default=str) + "\n")
            self._file.flush()
        except OSError as exc:  # a full disk must not turn every log call into an error: the console goes on
            self.close()
            print(f"warning: {self.path} is no longer written: {exc.strerror or exc}", file=sys.stderr)
        return event_dict

    def close(self) -> None:
        file, self._file = self._file, None
        if file is not None:
            try:
                file.close()
            except OSError:
                pass


_tee: _JsonLinesTee | None = None


def configure(*, level: str = "info", json_path: Path | None = None, stream: IO[str] | None = None) -> None:
    """Set up console logging at ``level``, and JSON lines to ``json_path`` when given.

    :param level: minimum level shown (``debug``, ``info``, ``warning``, ``error``).
    :param json_path: file to append JSON events to, e.g. ``runs/x/logs/run.jsonl``.
    :param stream: console stream, default stderr.
    """
    global _tee
    if _tee is not None:
        _tee.close()
        _tee = None
    stream = stream or sys.stderr
    processors: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if json_path is not None:
        _tee = _JsonLinesTee(json_path)
        processors.append(_tee)
    processors.append(structlog.dev.ConsoleRenderer(colors=stream.isatty(), exception_formatter=_one_line))
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level.upper()]),
        logger_factory=structlog.PrintLoggerFactory(stream),
        cache_logger_on_first_use=False,
    )


def _one_line(stream: IO[str], exc_info: Any) -> None:
    """Console exceptions as one line; the JSON log keeps the whole event."""
    _, exc, _ = exc_info
    stream.write(f"\n  {type(exc).__name__}: {exc}")


def _exc_tuple(exc_info: Any) -> tuple:
    if isinstance(exc_info, BaseException):
        return type(exc_info), exc_info, exc_info.__traceback__
    if isinstance(exc_info, tuple):
        return exc_info
    return sys.exc_info()
