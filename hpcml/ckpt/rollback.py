"""Signed checkpoints that cannot be rolled back or swapped in from another run.

A signature proves a manifest was written by a holder of the key, not that it is the newest
of *this* directory: anyone who can write the directory could point ``latest`` back at an
older signed step, or copy in a signed step of another run under the same key. With a key,
each checkpoint directory has an id (made at its first signed save) that every signed
manifest carries (``root``, under the signature), and ``signed_state.json`` beside the steps
records, itself signed, the id and the newest signed step saved there. A reader with the key
refuses a step of another directory's id, and -- when it follows ``latest`` -- a step older
than the newest signed one (a step named explicitly may be older: evaluating an earlier
checkpoint is no attack). The limit: whoever can delete ``signed_state.json`` too resets
what is known; state that the group cannot write (the user's home) would close that.
"""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path

from hpcml import safeio
from hpcml.ckpt.keys import Keyring
from hpcml.errors import CheckpointError

STATE = "signed_state.json"
_ID = re.compile(r"[0-9a-f]{32}")


def _body(rec: dict) -> bytes:
    return json.dumps({k: rec[k] for k in ("root", "step", "save_id")}, sort_keys=True,
                      separators=(",", ":")).encode()


def read(root: Path, keys: Keyring) -> dict | None:
    """The directory's signed state, checked with ``keys``; None when there is none.
    CheckpointError when it is not one a holder of the key wrote."""
    where = root / STATE
    try:
        rec = safeio.read_json(where, 1 << 16)
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    if rec is None:
        return None
    if not (isinstance(rec.get("root"), str) and _ID.fullmatch(rec["root"]) and type(rec.get("step")) is int
            and rec["step"] >= 0 and isinstance(rec.get("save_id"), str)):
        raise CheckpointError(f"{where}: not a signed state of hpcml's (root, step, save_id)")
    keys.check(rec.get("signature"), _body(rec), str(where))
    return rec


def root_id(state: dict | None) -> str:
    """The directory's id: its signed ``state``'s (:func:`read`), or a new one for its first signed save."""
    return state["root"] if state else uuid.uuid4().hex


def record(root: Path, manifest: dict, keys: Keyring, state: dict | None) -> None:
    """After a signed save of ``manifest`` committed: the state names it when it is the newest
    (``state``: the directory's before the save, as :func:`read` gave it)."""
    if state is not None and state["step"] > manifest["step"]:
        return  # an older step saved again (a re-save): the newest stays the newest
    rec = {"root": manifest["root"], "step": manifest["step"], "save_id": manifest["save_id"]}
    rec["signature"] = keys.sign(_body(rec))
    safeio.replace(root / STATE, json.dumps(rec) + "\n", fsync=True)


def check(root: Path, step_dir: Path, manifest: dict, keys: Keyring, *, via_latest: bool) -> None:
    """Refuse (one line) a signed step of another directory, or -- ``via_latest`` -- older than
    the newest signed one recorded in ``root``."""
    state = read(root, keys)
    if state is None:
        return
    if manifest.get("root") != state["root"]:
        raise CheckpointError(f"{step_dir} was saved in checkpoint directory {str(manifest.get('root'))[:32]}, not "
                              f"in this one ({state['root']}, {STATE}): a step of another run copied in: refused")
    if via_latest and manifest["step"] < state["step"]:
        raise CheckpointError(f"{root}/latest names step {manifest['step']}, but step {state['step']} was saved and "
                              f"signed here ({STATE}): rolled back, refused -- name an older step explicitly to "
                              f"read it")
