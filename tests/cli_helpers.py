"""What every test of a ``trtkv`` command's user error asserts."""
from __future__ import annotations


def assert_one_line_error(p, needle: str) -> None:
    """``p`` (a finished ``trtkv`` process) failed with exit status 2 and exactly one stderr line,
    ``trtkv: error: ...``, containing ``needle``: no traceback, no second line."""
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 2, f"exit status {p.returncode}:\n{p.stderr}"
    assert len(lines) == 1 and lines[0].startswith("trtkv: error:"), p.stderr
    assert needle in lines[0], f"{needle!r} not in: {lines[0]}"
