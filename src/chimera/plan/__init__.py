"""The performance model: pick W, D, B, recomputation and scheme for a model on a machine.

``plan(Workload(model, gpus, global_batch, hardware))`` enumerates every configuration,
bounds, simulates and ranks them (``search``); ``memory`` sizes a rank, ``hardware`` holds
the machine presets, ``workload`` turns them or a measured profile (``chimera.sim.profile``)
into the simulator's cost model, ``report`` prints tables and explanations. No torch.
"""

from chimera.plan.hardware import PRESETS as HARDWARE, Hardware, PlanError, get_hardware
from chimera.plan.search import Candidate, Evaluation, Planner, PlanResult, plan
from chimera.plan.workload import Pricing, Workload
from chimera.sim.profile import Profile, ProfileError, load_profile, parse_profile

__all__ = ["HARDWARE", "Candidate", "Evaluation", "Hardware", "PlanError", "PlanResult", "Planner",
           "Pricing", "Profile", "ProfileError", "Workload", "get_hardware", "load_profile", "parse_profile", "plan"]
