"""Simulation codes that hpcml ensembles run: each a runnable MPI program (see docs/)."""
