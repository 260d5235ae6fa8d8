"""HDF5 checkpoints: per-rank shards plus an index of virtual datasets that presents every
global tensor whole -- save distributed, load on any layout, read by any HDF5 tool."""

from hpcml.ckpt.reader import LoadReport, load, read_extra, read_tensor, resolve
from hpcml.ckpt.state import training_tensors
from hpcml.ckpt.writer import AsyncSaver, SaveResult, save
from hpcml.errors import CheckpointError

__all__ = ["AsyncSaver", "CheckpointError", "LoadReport", "SaveResult", "load", "read_extra", "read_tensor", "resolve", "save",
           "training_tensors"]
