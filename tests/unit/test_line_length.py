"""No line of a tracked Python file is over 120 characters: setup.cfg's flake8 max-line-length (issue 44).

The files are those ``git ls-files '*.py'`` lists; outside a git checkout (or without git), the Python
files under the project's source, test, benchmark and script folders.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 120
FOLDERS = ("hpcml", "kernels", "workflows", "benchmarks", "tests", "scripts", "site_configs")


def _python_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z", "*.py"], cwd=ROOT, capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        out = None
    if out is not None and out.returncode == 0:
        return [ROOT / name for name in out.stdout.decode().split("\0") if name]
    return sorted(p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py"))


def test_no_python_line_is_over_the_limit():
    files = _python_files()
    assert files, f"no Python files found under {ROOT}"
    over = []
    for path in files:
        if not path.is_file():  # listed by git but deleted in the work tree
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if len(line) > LIMIT:
                over.append(f"{path.relative_to(ROOT)}:{n}: {len(line)}")
    assert not over, f"{len(over)} line(s) over {LIMIT} characters (setup.cfg):\n" + "\n".join(over)
