"""The process grid: named parallel axes (pp, dp, ep, cp, tp) over MPI ranks.

``Layout`` is the pure arithmetic (no MPI); ``ProcessGrid`` builds it on an MPI
communicator; ``ProcessGrid.init_torch()`` bootstraps torch.distributed and a DeviceMesh
with the same rank map. ``interface_address`` is :func:`hpcml.net.interface_address`.
"""

from hpcml.grid.layout import AXES, Layout
from hpcml.grid.mpi import ProcessGrid, check_pop, install_abort_handler
from hpcml.lazy import lazy_names

__all__ = ["AXES", "Layout", "ProcessGrid", "check_pop", "install_abort_handler", "interface_address"]

__getattr__ = lazy_names(__name__, {"interface_address": "hpcml.net"})
