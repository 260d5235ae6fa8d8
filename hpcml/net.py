"""Network addresses of this node: what the grid's rendezvous and the stream servers bind.

Imports neither torch nor MPI: the stream's servers and the campaign contract use it."""

from __future__ import annotations

import fcntl
import socket
import struct

from hpcml.errors import LaunchError

_SIOCGIFADDR = 0x8915


def interface_address(ifname: str) -> str:
    """IPv4 address of network interface ``ifname`` (Linux), e.g. ``hsn0`` -> ``10.x.y.z``."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", ifname.encode()[:15]))
        except OSError as e:
            names = ", ".join(n for _, n in socket.if_nameindex())
            raise LaunchError(f"network interface {ifname!r} has no IPv4 address ({e.strerror}); "
                              f"interfaces here: {names}") from None
    return socket.inet_ntoa(packed[20:24])
