"""Bad input from a user: the broken configs of tests/bad_configs/ through the real CLI.

Each file's ``# expect:`` comments name its problems in order; ``i3core check``
and ``i3core run`` must print exactly one ``error:`` line per problem (each
containing its expectation) and a one-line count, exit 2, show no traceback
and write nothing.
"""

from pathlib import Path

import pytest

from .conftest import run_cli

BAD_CONFIGS = sorted((Path(__file__).parent / "bad_configs").glob("*.toml"))


def expectations(path: Path) -> list[str]:
    return [line.removeprefix("# expect:").strip() for line in path.read_text().splitlines()
            if line.startswith("# expect:")]


def test_the_corpus_covers_every_kind_of_problem():
    names = {p.stem for p in BAD_CONFIGS}
    assert {"wrong_types", "unknown_keys", "unknown_components", "missing_use", "toml_syntax", "unknown_sections",
            "batch_not_divisible", "keep_not_above_lag", "broadcast_with_lag", "max_tokens_over_max_len"} <= names
    assert all(expectations(p) for p in BAD_CONFIGS)


@pytest.mark.parametrize("command", ["check", "run"])
@pytest.mark.parametrize("path", BAD_CONFIGS, ids=lambda p: p.stem)
def test_bad_config_is_exit_2_with_one_line_per_problem(tmp_path, path, command):
    result = run_cli(command, str(path), cwd=tmp_path)
    expected = expectations(path)
    lines = result.stderr.splitlines()
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == len(expected), "\n".join(lines)
    for line, expect in zip(errors, expected):
        assert expect in line, f"{expect!r} not in {line!r}"
    plural = "s" if len(expected) != 1 else ""
    assert lines == [*errors, f"{len(expected)} problem{plural} in {path}"]
    assert list(tmp_path.iterdir()) == []  # no run directory, no logs
