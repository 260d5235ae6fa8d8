"""The layout planner: before the allocation, predict for a model on N devices the memory of
the fullest rank and the step time of every valid layout (tp, cp, pp, ep, dp, ZeRO stage,
micro-batch, recompute), and pick the best.

Memory is counted from the model's real parameter shapes as its plan shards them; the time
model is analytic with constants fitted on published measured runs (``data/``). No MPI, no
torch: a search over thousands of layouts answers in well under a second.
"""

from hpcml.plan.devices import DEVICES, Device
from hpcml.plan.predict import Prediction, load_model, predict
from hpcml.plan.candidate import PlanLayout

__all__ = ["DEVICES", "Device", "PlanLayout", "Prediction", "load_model", "predict"]
