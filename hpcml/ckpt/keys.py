"""Keys that sign checkpoints: authenticity on top of the manifest's integrity digests.

The digests in ``manifest.json`` catch corruption and stale or swapped files, but anyone who
can write the directory can recompute them. A key closes that: the save puts an HMAC-SHA256
of the manifest (which binds every file's digest, the step and the save id) in it, and a
reader with a key configured refuses a checkpoint that is unsigned or signed by a key it does
not hold. Signing costs one HMAC over the manifest, not a pass over the data.

Where a key comes from (the first that is set): ``key=`` in the call; ``$HPCML_CKPT_KEY``
(key text); ``$HPCML_CKPT_KEY_FILE`` (a file, one key per line, not readable by others).
Several keys rotate: the first signs, every one verifies. Keys have roles: a campaign's
stream secret is held by every simulation, which the stream treats as possibly hostile, so
it never signs a checkpoint -- a key that is it (the same file, the same text or bytes, one
inside the other) is refused (:func:`check_role`). numpy-free, torch-free.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from hpcml import safeio
from hpcml.errors import CheckpointError, ConfigError

ENV_KEY = "HPCML_CKPT_KEY"
ENV_KEY_FILE = "HPCML_CKPT_KEY_FILE"
MIN_KEY_CHARS = 16
MAX_KEY_FILE_BYTES = 64 << 10
ALG = "hmac-sha256"
_LABEL = b"hpcml-ckpt/manifest-key/v1"


@dataclass(frozen=True)
class Keyring:
    """Derived keys (the first signs) and where they came from, for messages."""

    keys: tuple[bytes, ...]
    source: str

    @property
    def ids(self) -> list[str]:
        return [key_id(k) for k in self.keys]

    def sign(self, body: bytes) -> dict:
        mac = hmac.new(self.keys[0], body, hashlib.sha256).hexdigest()
        return {"alg": ALG, "key_id": key_id(self.keys[0]), "mac": mac}

    def check(self, signature, body: bytes, where: str) -> None:
        """Raise (one line) unless ``signature`` is a MAC of ``body`` by one of the keys."""
        if signature is None:
            raise CheckpointError(f"{where} is not signed, and a checkpoint key is configured ({self.source}): "
                                  f"refused (sign it with `hpcml ckpt sign` if you trust it)")
        if not isinstance(signature, dict) or signature.get("alg") != ALG or not isinstance(signature.get("mac"), str) \
                or not isinstance(signature.get("key_id"), str):
            raise CheckpointError(f"{where}: signature {str(signature)[:80]!r} is not an {ALG} signature")
        for k in self.keys:
            if key_id(k) == signature["key_id"]:
                if hmac.compare_digest(hmac.new(k, body, hashlib.sha256).hexdigest(), signature["mac"]):
                    return
                raise CheckpointError(f"{where}: the signature does not match its content (key {signature['key_id']}): "
                                      f"forged or edited after the save")
        raise CheckpointError(f"{where} is signed by key {signature['key_id'][:16]!r}, which is not among the keys "
                              f"configured ({self.source}: {', '.join(self.ids)})")


def key_id(key: bytes) -> str:
    """A public name of a derived key (not enough to forge with)."""
    return hashlib.sha256(b"hpcml-ckpt/key-id/" + key).hexdigest()[:16]


def derive(text: str | bytes, where: str) -> bytes:
    raw = text.encode() if isinstance(text, str) else bytes(text)
    if len(raw.strip()) < MIN_KEY_CHARS:
        raise ConfigError(f"checkpoint key from {where} has {len(raw.strip())} characters: expected at least "
                          f"{MIN_KEY_CHARS} (e.g. `openssl rand -hex 32`)")
    return hmac.new(raw.strip(), _LABEL, hashlib.sha256).digest()


def from_file(path: str | os.PathLike) -> Keyring:
    """Every non-empty line of key file ``path`` is a key; the first signs."""
    from hpcml.ckpt.shard import open_regular

    path = Path(path)
    try:
        fd = open_regular(path)
    except CheckpointError:
        what = "not a regular file" if path.exists() or path.is_symlink() else "no such file"
        raise ConfigError(f"checkpoint key file {path}: {what} (set by --key or ${ENV_KEY_FILE})") from None
    try:
        st = os.fstat(fd)
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ConfigError(f"checkpoint key file {path} has mode {stat.S_IMODE(st.st_mode):o}: expected no access "
                              f"for group and others (chmod 600 {path})")
        text = safeio.read_fd(fd, f"checkpoint key file {path}", MAX_KEY_FILE_BYTES, "a file of keys",
                              error=ConfigError)
    finally:
        os.close(fd)
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith(b"#")]
    if not lines:
        raise ConfigError(f"checkpoint key file {path} holds no key: expected one key per line")
    check_role(lines, f"key file {path}", path)
    return Keyring(tuple(derive(ln, str(path)) for ln in lines), f"key file {path}")


def check_role(texts: list[bytes], where: str, path: Path | None = None, environ=None) -> None:
    """ConfigError when a checkpoint key is the campaign's stream secret: its file (a
    campaign's ``stream.key``, or ``$HPCML_STREAM_SECRET_FILE``), its text, its bytes, or one
    inside the other. Every simulation holds that secret; a key it gives could forge a
    checkpoint that verifies."""
    from hpcml.contract import ENV, SECRET_FILE

    environ = os.environ if environ is None else environ
    secret_file = environ.get(ENV["secret_file"])
    why = f"checkpoint key from {where} is the campaign's stream secret"
    advice = (": every simulation holds that secret, so it cannot sign checkpoints -- make a key of its own "
              "(openssl rand -hex 32 > ~/.hpcml-ckpt.key; chmod 600 ~/.hpcml-ckpt.key)")
    if path is not None and (path.name == SECRET_FILE and (path.parent / "campaign_id.json").exists()
                             or secret_file and _same(path, secret_file)):
        raise ConfigError(why + advice)
    if not secret_file:
        return
    try:
        secret = (safeio.read_text(secret_file, 4096, "the stream secret") or "").strip().lower().encode()
    except (OSError, ValueError):
        return  # the stream's own check names it
    if not secret:
        return
    forms = {secret}
    try:
        forms.add(bytes.fromhex(secret.decode()))
    except ValueError:
        pass
    # raw key bytes may begin or end with a whitespace byte: compare them unstripped too
    for t in {x for raw in texts for x in (raw, raw.strip())}:
        if any(f and (f in t or f in t.lower() or (len(t) >= MIN_KEY_CHARS and t.lower() in f)) for f in forms):
            raise ConfigError(why + " (or holds it)" + advice)


def _same(a: Path, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def keyring(key: bytes | str | os.PathLike | Keyring | bool | None = None) -> Keyring | None:
    """The keys in force: ``key`` (bytes: key text; a str or path: a key file; a Keyring;
    False: none, whatever the environment says), else the environment, else None."""
    if key is False:
        return None
    if isinstance(key, Keyring):
        return key
    if isinstance(key, (bytes, bytearray)):
        check_role([bytes(key)], "key=")
        return Keyring((derive(key, "key="),), "key=")
    if key is not None and key is not True:
        return from_file(key)
    if os.environ.get(ENV_KEY):
        check_role([k.encode() for k in os.environ[ENV_KEY].split()], f"${ENV_KEY}")
        return Keyring(tuple(derive(k, f"${ENV_KEY}") for k in os.environ[ENV_KEY].split()), f"${ENV_KEY}")
    if os.environ.get(ENV_KEY_FILE):
        return from_file(os.environ[ENV_KEY_FILE])
    if key is True:
        raise ConfigError(f"a checkpoint key is required: set ${ENV_KEY} or ${ENV_KEY_FILE}, or pass --key FILE")
    return None


__all__ = ["ENV_KEY", "ENV_KEY_FILE", "Keyring", "check_role", "derive", "from_file", "key_id", "keyring"]
