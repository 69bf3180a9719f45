"""The performance model: pick W, D, B, recomputation and scheme for a model on a machine.

``plan(Workload(model, gpus, global_batch, hardware))`` enumerates every configuration,
bounds, simulates and ranks them (``search``); ``memory`` sizes a rank, ``hardware`` holds
the machine presets and the profile format, ``workload`` turns both into the simulator's
cost model, ``report`` prints tables and explanations. No torch.
"""

from chimera.plan.hardware import (PRESETS as HARDWARE, Hardware, PlanError, Profile, get_hardware,
                                   load_profile, parse_profile)
from chimera.plan.search import Candidate, Evaluation, Planner, PlanResult, plan
from chimera.plan.workload import Pricing, Workload

__all__ = ["HARDWARE", "Candidate", "Evaluation", "Hardware", "PlanError", "PlanResult", "Planner",
           "Pricing", "Profile", "Workload", "get_hardware", "load_profile", "parse_profile", "plan"]
