"""Device files: a device the planner does not ship, with its time-model constants, as
``hpcml plan calibrate`` writes them from a user's own measured runs and ``hpcml plan
--device-file`` reads them back.

A file is untrusted input (a project directory others can write): read bounded, parsed with a
depth limit, every field known, every number finite and in its range, refused in one line
naming the file and the field. Two kinds:

- ``"device"``: one accelerator per rank (:class:`~hpcml.plan.devices.Device`'s fields);
- ``"cpu"``: a host whose cores the ranks share (:class:`~hpcml.plan.cpu.CpuFacts` and gloo's
  bus bandwidth); a layout's rank count then sets each rank's share (:func:`hpcml.plan.cpu.cpu_device`).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from hpcml import safeio
from hpcml.errors import ConfigError
from hpcml.numeric import is_int, is_real
from hpcml.plan.cpu import CpuFacts, cpu_device
from hpcml.plan.devices import Device
from hpcml.plan.constants import Constants

FORMAT = "hpcml-device/1"
MAX_BYTES = 1 << 20
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
#: Constants a file may set, and their ranges (what a physical device can have).
RANGES: dict[str, tuple[float, float]] = {
    "gemm_eff": (1e-3, 2.0), "fp8_eff": (1e-3, 2.0), "attn_eff": (0.0, 2.0), "attn_eff_fused": (0.0, 2.0),
    "compiled_passes": (0.0, 1.0),
    "m_half": (0.0, 1e6),
    "n_half": (0.0, 1e6), "elementwise_passes": (0.0, 1e4),
    "softmax_passes": (0.0, 1e3), "comm_eff": (1e-3, 2.0), "latency_s": (0.0, 1.0), "dp_overlap": (0.0, 1.0),
    "tp_overlap": (0.0, 1.0), "step_overhead_s": (0.0, 3600.0), "block_s": (0.0, 10.0), "tp_block_s": (0.0, 10.0),
    "sp_block_s": (0.0, 10.0), "cp_block_s": (0.0, 10.0), "fsdp_unit_s": (0.0, 10.0), "reserved_gib": (0.0, 1e4)}
assert set(RANGES) == {f.name for f in fields(Constants)}


@dataclass(frozen=True)
class DeviceFile:
    """What a device file holds: a device (or a CPU host) and its constants."""

    name: str
    constants: Constants
    device: Device | None = None
    cpu: CpuFacts | None = None
    busbw_gbps: float = 1.0
    calibration: dict | None = None
    """How the constants were fitted (runs, errors), as ``hpcml plan calibrate`` wrote it."""

    def resolve(self, ranks: int) -> Device:
        """The device one of ``ranks`` training ranks is (a CPU host: its share of the cores)."""
        if self.cpu is None:
            return self.device
        dev, _ = cpu_device(self.cpu, ranks, {"busbw_gbps": self.busbw_gbps})
        return replace(dev, name=f"{self.name}-x{ranks}", family=family(self.name))

    def to_dict(self) -> dict:
        out: dict = {"format": FORMAT, "name": self.name}
        if self.cpu is None:
            out["device"] = {k: v for k, v in asdict(self.device).items() if k not in ("name", "family")}
        else:
            out["cpu"], out["busbw_gbps"] = asdict(self.cpu), self.busbw_gbps
        out["constants"] = asdict(self.constants)
        if self.calibration is not None:
            out["calibration"] = self.calibration
        return out


def family(name: str) -> str:
    """The calibration family of the devices of file ``name`` (how their constants are found)."""
    return f"file:{name}"


_REGISTERED: dict[str, DeviceFile] = {}


def register(df: DeviceFile) -> str:
    """Make ``df`` a device layouts can name (``gpu=df.name``); returns the name."""
    _REGISTERED[df.name] = df
    return df.name


def unregister(name: str) -> None:
    _REGISTERED.pop(name, None)


def valid_name(name: str) -> bool:
    """Whether ``name`` may name a device file's device (1-64 letters, digits, '.', '_', '-'),
    and is not a built-in device's (a file named ``h100-80gb`` would price every later layout
    that names the H100 on the calibrated machine)."""
    from hpcml.plan.devices import DEVICES

    return bool(_NAME.fullmatch(name)) and name.lower() not in {d.lower() for d in DEVICES}


def registered(name: str | None) -> DeviceFile | None:
    return _REGISTERED.get(name) if name else None


def constants_of(fam: str) -> Constants | None:
    """The constants of a registered file's family (:func:`family`), or None."""
    return _REGISTERED[fam[5:]].constants if fam.startswith("file:") and fam[5:] in _REGISTERED else None


def _number(where: str, key: str, v, lo: float, hi: float) -> float:
    if not is_real(v) or not (math.isfinite(v) and lo <= v <= hi):
        raise ConfigError(f"{where}: {key}={repr(v)[:40]}: expected a number in [{lo:g}, {hi:g}]")
    return float(v)


def _known(where: str, what: str, d, allowed: set[str], required: set[str] = frozenset()) -> dict:
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: {what} is {type(d).__name__}: expected an object")
    bad = sorted(set(d) - allowed)
    if bad:
        raise ConfigError(f"{where}: {what} has unknown keys {bad[:5]}: expected some of {sorted(allowed)}")
    missing = sorted(required - set(d))
    if missing:
        raise ConfigError(f"{where}: {what} lacks {missing}")
    return d


def from_dict(d, where: str) -> DeviceFile:
    """A device file's content, checked (every error one line naming ``where`` and the field)."""
    d = _known(where, "the file", d, {"format", "name", "device", "cpu", "busbw_gbps", "constants", "calibration"},
               {"format", "name", "constants"})
    if d["format"] != FORMAT:
        raise ConfigError(f"{where}: format {str(d['format'])[:40]!r}: expected {FORMAT!r}")
    name = d["name"]
    if not isinstance(name, str) or not valid_name(name):
        raise ConfigError(f"{where}: name {str(name)[:80]!r}: expected 1-64 letters, digits, '.', '_' or '-', not a "
                          f"built-in device's name")
    if ("device" in d) == ("cpu" in d):
        raise ConfigError(f"{where}: expected exactly one of 'device' (an accelerator) or 'cpu' (a CPU host)")
    cd = _known(where, "constants", d["constants"], set(RANGES))
    consts = Constants(**{k: _number(where, f"constants.{k}", v, *RANGES[k]) for k, v in cd.items()})
    cal = d.get("calibration")
    if cal is not None and not isinstance(cal, dict):
        raise ConfigError(f"{where}: calibration is {type(cal).__name__}: expected an object")
    if "cpu" in d:
        names = {f.name for f in fields(CpuFacts)}
        c = _known(where, "cpu", d["cpu"], names, {"cores", "flops_core", "flops_all", "m_half", "copy_gbps",
                                                     "memory_gib"})
        # a measurement may find no cost beyond the matmuls (elementwise_passes 0) or no row effect (m_half 0)
        vals = {k: _number(where, f"cpu.{k}", v, 0.0 if k in ("m_half", "elementwise_passes") else 1e-9, 1e18)
                for k, v in c.items()}
        if vals["cores"] != int(vals["cores"]) or not 1 <= vals["cores"] <= 1 << 16:
            raise ConfigError(f"{where}: cpu.cores={c['cores']!r}: expected an integer in [1, 65536]")
        vals["cores"] = int(vals["cores"])
        bw = _number(where, "busbw_gbps", d.get("busbw_gbps", 1.0), 1e-6, 1e6)
        return DeviceFile(name=name, constants=consts, cpu=CpuFacts(**vals), busbw_gbps=bw, calibration=cal)
    dv = _known(where, "device", d["device"], {f.name for f in fields(Device)} - {"name", "family"},
                {"memory_gib", "peak_tflops", "hbm_gbps", "gpus_per_node", "intra_gbps", "inter_gbps", "source"})
    args: dict = {}
    for k, v in dv.items():
        if k == "source":
            if not isinstance(v, str) or len(v) > 4096:
                raise ConfigError(f"{where}: device.source: expected a string of at most 4096 characters")
            args[k] = v
        elif k == "sustained_range":
            if v is not None and (not isinstance(v, list) or len(v) != 2):
                raise ConfigError(f"{where}: device.sustained_range={str(v)[:40]}: expected [low, high] or null")
            args[k] = None if v is None else tuple(_number(where, k, x, 1e-6, 1.0) for x in v)
        elif k == "fp8_tflops":
            args[k] = None if v is None else _number(where, f"device.{k}", v, 1e-6, 1e9)
        elif k in ("gpus_per_node", "shared_cores"):
            if not is_int(v) or not 0 <= v <= 1 << 16:
                raise ConfigError(f"{where}: device.{k}={repr(v)[:40]}: expected an integer in [0, 65536]")
            args[k] = v
        else:
            args[k] = _number(where, f"device.{k}", v, 0.0, 1e9)
    try:
        dev = Device(name=name, family=family(name), **args)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    return DeviceFile(name=name, constants=consts, device=dev, calibration=cal)


def load(path: str | Path) -> DeviceFile:
    """Read, check and register the device file at ``path``."""
    where = f"device file {path}"
    raw = safeio.read_bytes(Path(path), MAX_BYTES, "a device file (JSON)")
    if raw is None:
        raise ConfigError(f"{where}: no such file")
    data = safeio.parse_json(raw, where, max_depth=8)
    df = from_dict(data, where)
    register(df)
    return df


def write(df: DeviceFile, path: str | Path) -> None:
    """Write ``df`` to ``path`` atomically (a reader never sees half a file), checked first as
    :func:`load` will check it: nothing is written that hpcml would refuse to read."""
    from_dict(json.loads(json.dumps(df.to_dict())), f"device file {path}")
    safeio.replace(Path(path), json.dumps(df.to_dict(), indent=1) + "\n")
