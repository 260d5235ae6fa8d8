"""JSON of untrusted files: nesting bounded before parsing, NaN and Infinity refused, records
read bounded and replaced atomically (:mod:`hpcml.safeio`)."""

from __future__ import annotations

import json
import math
import os
import re
from collections import Counter
from collections.abc import Mapping
from typing import Any

from hpcml.safeio.paths import FileRefused
from hpcml.safeio.reading import read_bytes, refused_as
from hpcml.safeio.writing import replace

#: JSON nested deeper than this is refused before it is parsed (hpcml's own records nest 4).
MAX_DEPTH = 64


_STRING = re.compile(rb'"(?:[^"\\]++|\\.|\\\Z)*+(?:"|\Z)', re.S)
"""A JSON string, or an unterminated one to the end: every match from a quote succeeds, so no
input is scanned twice (a string of escaped quotes cut off costs one pass, not one per quote)."""
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")


def json_depth(data: bytes, stop: int | None = None) -> int:
    """How deep ``data``'s arrays and objects nest (strings passed over), without parsing it:
    one pass (``stop``: return once deeper than it)."""
    depth = deepest = 0
    for c in _STRING.sub(b"", data).translate(None, _NOT_BRACKETS):
        if c in (0x5B, 0x7B):
            depth += 1
            if depth > deepest:
                deepest = depth
                if stop is not None and depth > stop:
                    return depth
        else:
            depth -= 1
    return deepest


def parse_json(data: bytes | str, where: str, *, max_depth: int = MAX_DEPTH, constants: bool = False,
               unique: bool = False) -> Any:
    """JSON of untrusted ``data`` from ``where``: FileRefused, naming it, when it is nested past
    ``max_depth`` (checked first), is not UTF-8 JSON, or holds NaN or Infinity (unless
    ``constants``: files of other tools that write them, a Hugging Face config); ``unique``:
    or names a key twice in an object (a hand-written line whose first value JSON would drop)."""
    try:
        raw = data.encode() if isinstance(data, str) else bytes(data)
        text = raw.decode("utf-8")  # strictly: a UTF-16 text would hide brackets from the scan below
    except UnicodeError as e:
        raise FileRefused(f"{where}: not JSON (not UTF-8: {str(e)[:120]})") from None
    if raw.count(b"[") + raw.count(b"{") > max_depth:  # fewer brackets than that cannot nest deeper
        if json_depth(raw, stop=max_depth) > max_depth:
            raise FileRefused(f"{where}: JSON nested more than {max_depth} deep: refused before parsing")
    try:
        return (_LENIENT if constants else _UNIQUE if unique else _STRICT).decode(text)
    except (ValueError, RecursionError) as e:
        raise FileRefused(f"{where}: not JSON ({str(e)[:120]})") from None


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


def _finite_float(text: str) -> float:
    v = float(text)
    if v in (math.inf, -math.inf):  # 1e999: as infinite as Infinity
        raise ValueError(f"{text[:40]} overflows a float")
    return v


_STRICT = json.JSONDecoder(parse_constant=_no_constant, parse_float=_finite_float)
"""One decoder for every file (``json.loads`` with options builds one a call): NaN, Infinity
and a literal past a float's range (1e999) refused."""
_LENIENT = json.JSONDecoder()


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        twice = sorted(k for k, n in Counter(k for k, _ in pairs).items() if n > 1)
        raise ValueError(f"key(s) {twice[:4]} given twice in one object")
    return out


_UNIQUE = json.JSONDecoder(parse_constant=_no_constant, parse_float=_finite_float, object_pairs_hook=_unique_keys)


def read_json(path: str | os.PathLike, max_bytes: int, *, root: str | os.PathLike | None = None,
              max_depth: int = MAX_DEPTH, error: type[Exception] | None = FileRefused, required: bool = False,
              constants: bool = False, expected: str = "a small JSON record") -> dict[str, Any] | None:
    """A JSON object from regular file ``path``, or None if it is not there; ``error`` (the
    caller's class, FileRefused by default; None: a miss) naming the file for anything else --
    size checked before reading, depth before parsing (:func:`read_bytes`, :func:`parse_json`)."""
    return refused_as(error, _read_json, path, max_bytes, root, max_depth, required, constants, expected)


def _read_json(path, max_bytes: int, root, max_depth: int, required: bool, constants: bool,
               expected: str) -> dict[str, Any] | None:
    data = read_bytes(path, max_bytes, expected, root=root, required=required)
    if data is None:
        return None
    rec = parse_json(data, str(path), max_depth=max_depth, constants=constants)
    if not isinstance(rec, dict):
        raise FileRefused(f"{path}: expected a JSON object, got {type(rec).__name__}")
    return rec


def finite(value: Any) -> Any:
    """``value`` with every NaN or infinite float (in dicts, lists, tuples) as None: JSON has no
    such numbers, and this module's readers (and jq's) refuse the tokens Python writes for them."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def write_json(path: str | os.PathLike, data: Mapping[str, Any], *, root: str | os.PathLike | None = None) -> None:
    """A record, atomically (:func:`~hpcml.safeio.writing.replace`): a reader never sees half of
    it, and a link put at ``path`` is replaced, not written through."""
    replace(path, json.dumps(data, indent=1) + "\n", root=root)
