"""Simulation codes that hpcml ensembles run, each a runnable MPI program (docs/kernels.md).

``heat2d`` (2-D heat equation) and ``gray_scott`` (reaction-diffusion) share decomposition,
halo exchange, the output loop, sinks and the command line in ``common``. Nothing here
imports torch or training code: a simulation rank starts fast.
"""
