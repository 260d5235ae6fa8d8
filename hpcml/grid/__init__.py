"""The process grid: named parallel axes (pp, dp, ep, cp, tp) over MPI ranks.

``Layout`` is the pure arithmetic (no MPI); ``ProcessGrid`` builds it on an MPI
communicator; ``ProcessGrid.init_torch()`` bootstraps torch.distributed and a DeviceMesh
with the same rank map.
"""

from hpcml.grid.layout import AXES, CORE_AXES, Layout
from hpcml.grid.mpi import ProcessGrid, install_abort_handler

__all__ = ["AXES", "CORE_AXES", "Layout", "ProcessGrid", "install_abort_handler"]
