"""Measuring the runtime: benchmarks against torch.distributed.pipelining, cost profiles of a
model on this machine, and replaying measured traces through the simulator.

``rows`` and ``calibrate`` import no torch (``chimera simulate --profile / --from-trace`` use
them); ``harness``, ``runners``, ``torchpp`` and ``profiler`` run torch.
"""
