"""The process grid: named parallel axes (pp, dp, ep, cp, tp) over MPI ranks.

``Layout`` is the pure arithmetic (no MPI); ``ProcessGrid`` builds it on an MPI
communicator; ``ProcessGrid.init_torch()`` bootstraps torch.distributed and a DeviceMesh
with the same rank map. ``interface_address`` is :func:`hpcml.net.interface_address`.
"""

from hpcml.grid.layout import AXES, Layout
from hpcml.grid.mpi import ProcessGrid, install_abort_handler

__all__ = ["AXES", "Layout", "ProcessGrid", "install_abort_handler", "interface_address"]


def __getattr__(name: str):
    if name == "interface_address":
        from hpcml.net import interface_address

        return interface_address
    raise AttributeError(f"module 'hpcml.grid' has no attribute {name!r}")
