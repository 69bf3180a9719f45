"""Measuring the runtime: benchmarks against torch.distributed.pipelining and cost profiles of
a model on this machine (the simulator reads them: ``chimera.sim.profile``, ``chimera.sim.replay``).

``rows`` imports no torch; ``harness`` (which picks a row's runner), ``runners``, ``torchpp``,
``report`` and ``profiler`` do.
"""
