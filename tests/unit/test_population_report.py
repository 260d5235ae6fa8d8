"""The PBT history and its picture (issue 45): rounds read back, a hostile history refused in one line."""

from __future__ import annotations

import json

import pytest

from hpcml.errors import ConfigError
from hpcml.train.population_report import plot, read_history


def _round(r: int, copied: dict[int, int]) -> str:
    return json.dumps({"round": r, "step": 10 * r, "members": [
        {"member": m, "score": 3.0 - 0.1 * r + m, "copied": copied.get(m), "lr": 1e-3 * (1 + m), "weight_decay": 0.1}
        for m in range(4)]}) + "\n"


def test_history_read_back_and_drawn(tmp_path):
    h = tmp_path / "pbt.jsonl"
    h.write_text(_round(1, {3: 0}) + _round(2, {}) + _round(3, {2: 1}) + '{"round": 4, "ste')  # a torn last line
    rounds = read_history(h)
    assert [r["round"] for r in rounds] == [1, 2, 3]
    assert rounds[0]["members"][3]["copied"] == 0
    out = plot(h, tmp_path / "pbt.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


@pytest.mark.parametrize("line,expect", [
    ("[" * 5000 + "\n", r"line 1: .*nested"),
    ('{"round": "1", "members": []}\n', r"line 1: expected a PBT round"),
    ('{"round": 1, "members": [{"member": "x"}]}\n', r"line 1: expected a PBT round"),
    ("not json\n", r"line 1"),
])
def test_a_hostile_history_is_one_line(tmp_path, line, expect):
    h = tmp_path / "pbt.jsonl"
    h.write_text(line)
    with pytest.raises(ConfigError, match=expect):
        read_history(h)


def test_an_empty_history_has_nothing_to_plot(tmp_path):
    with pytest.raises(ConfigError, match="no PBT round recorded"):
        plot(tmp_path / "missing.jsonl", tmp_path / "x.png")
