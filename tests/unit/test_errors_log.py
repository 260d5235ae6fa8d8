"""Exception hierarchy and rank-aware logging."""

from __future__ import annotations

import logging

import pytest

from hpcml import errors, log


def test_hierarchy_subclasses_builtins():
    assert issubclass(errors.GridError, errors.ConfigError)
    for cls, builtin in [(errors.ConfigError, ValueError), (errors.GridError, ValueError),
                         (errors.LaunchError, RuntimeError), (errors.MissingFeatureError, RuntimeError)]:
        assert issubclass(cls, errors.HpcmlError) and issubclass(cls, builtin)


def _emit(rank: int, monkeypatch, capsys, **envvars) -> str:
    for k, v in envvars.items():
        monkeypatch.setenv(k, v)
    log.configure(rank)
    logger = log.get_logger("hpcml.test")
    logger.debug("dbg")
    logger.info("hello")
    logger.warning("careful")
    return capsys.readouterr().err


@pytest.fixture(autouse=True)
def _reset_logging(monkeypatch):
    monkeypatch.delenv("HPCML_LOG_LEVEL", raising=False)
    monkeypatch.delenv("HPCML_LOG_ALL_RANKS", raising=False)
    yield
    log.configure(0)


def test_rank0_info_other_ranks_warnings(monkeypatch, capsys):
    assert _emit(0, monkeypatch, capsys).splitlines() == [
        "[rank 0] INFO hpcml.test: hello", "[rank 0] WARNING hpcml.test: careful"]
    assert _emit(3, monkeypatch, capsys).splitlines() == ["[rank 3] WARNING hpcml.test: careful"]


def test_env_asks_for_all_ranks_and_debug(monkeypatch, capsys):
    lines = _emit(5, monkeypatch, capsys, HPCML_LOG_ALL_RANKS="1", HPCML_LOG_LEVEL="debug").splitlines()
    assert lines == ["[rank 5] DEBUG hpcml.test: dbg", "[rank 5] INFO hpcml.test: hello",
                     "[rank 5] WARNING hpcml.test: careful"]
    assert logging.getLogger("hpcml").propagate is False
