"""The transport: every ``torch.distributed`` call of the package goes through one (except
where process groups are set up), a world of one rank, the transport in effect per thread,
and the NCCL emulation over another transport (here: virtual ranks, in process)."""

import ast
import datetime
import threading

import pytest
import torch

from sources import PACKAGE, package_files, tree
from chimera.runtime.transport import OneRank, ReduceOp, TorchDist, Transport, Wrapping, current, using


# Modules that may call torch.distributed directly, and why. Everything else asks its transport.
ALLOWED = {
    "runtime/transport.py": "TorchDist: the transport over torch.distributed",
    "runtime/workers.py": "starts and ends the gloo group of a spawned worker (init/destroy_process_group)",
    "runtime/launch_local.py": "chimera.api.spawn's init_process_group",
    "train/launch.py": "chimera train's init_process_group (torchrun's rendezvous, a store per restart)",
    "bench/links.py": "late_torch_sends: torch's pipelining rows call torch.distributed.isend "
                      "themselves, so the priced link swaps that function for a step",
}
# Libraries built on a process group: importing them is not calling torch.distributed.
LIBRARIES = {"checkpoint", "pipelining"}


def direct_uses(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, text) of each import of ``torch.distributed`` (not of a library in it) and each
    ``torch.distributed.NAME`` in ``tree``."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, f"import {a.name}") for a in node.names
                    if a.name == "torch.distributed"]
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            out += [(node.lineno, "from torch import distributed") for a in node.names
                    if a.name == "distributed"]
        elif isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
            out += [(node.lineno, f"from torch.distributed import {a.name}") for a in node.names
                    if a.name not in LIBRARIES]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) \
                and isinstance(node.value.value, ast.Name) and node.value.value.id == "torch" \
                and node.value.attr == "distributed" and node.attr not in LIBRARIES:
            out += [(node.lineno, f"torch.distributed.{node.attr}")]
    return out


def test_only_the_allowed_modules_call_torch_distributed():
    found = []
    for path in package_files():
        rel = path.relative_to(PACKAGE).as_posix()
        if rel not in ALLOWED:
            found += [f"{rel}:{line}: {text}" for line, text in direct_uses(tree(path))]
    assert not found, ("torch.distributed used directly (take a transport: the run context's):\n"
                       + "\n".join(found))


# Where the ambient transport may be read or set: its definition, the one place a run starts
# (RunContext.here) and the launcher that runs virtual ranks as threads. Everything else is
# handed its transport in a RunContext.
AMBIENT = {"runtime/transport.py", "runtime/context.py", "runtime/virtual.py"}


def test_only_launchers_look_the_transport_up():
    found = []
    for path in package_files():
        rel = path.relative_to(PACKAGE).as_posix()
        if rel in AMBIENT:
            continue
        for node in ast.walk(tree(path)):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("current", "using"):
                found.append(f"{rel}:{node.lineno}: {node.func.id}()")
            if isinstance(node, ast.ImportFrom) and node.module == "chimera.runtime.transport":
                found += [f"{rel}:{node.lineno}: imports {a.name}" for a in node.names
                          if a.name in ("current", "using")]
    assert not found, "the transport looked up instead of handed down:\n" + "\n".join(found)


def test_every_allowed_module_still_needs_it():
    stale = [rel for rel in ALLOWED if not direct_uses(tree(PACKAGE / rel))]
    assert not stale, f"take these off ALLOWED: {stale}"


def test_the_check_finds_each_form():
    code = ("import torch.distributed as dist\nfrom torch import distributed\n"
            "from torch.distributed import all_reduce, pipelining\n"
            "import torch.distributed.checkpoint as dcp\ntorch.distributed.barrier()\n"
            "torch.distributed.checkpoint.save\n")
    assert [line for line, _ in direct_uses(ast.parse(code))] == [1, 2, 3, 5]


def test_one_rank_collectives_are_the_identity():
    t = OneRank()
    x = torch.tensor([1.0, -2.0])
    assert t.all_reduce(x, op=ReduceOp.MAX) is None and torch.equal(x, torch.tensor([1.0, -2.0]))
    assert t.all_reduce(x, async_op=True).wait() is True
    out = torch.zeros(2)
    t.all_gather_single(out, x)
    assert torch.equal(out, x)
    objects = [None]
    t.all_gather_object(objects, {"a": 1})
    assert objects == [{"a": 1}]
    box = ["kept"]
    t.broadcast_object_list(box, src=0)
    assert box == ["kept"] and (t.get_rank(), t.get_world_size()) == (0, 1)
    assert t.get_process_group_ranks(t.new_group([0])) == [0]
    with pytest.raises(RuntimeError, match="no peer 1"):
        t.isend(x, 1)


def test_the_transport_in_effect_is_per_thread():
    assert isinstance(current(), TorchDist)
    one = OneRank()
    seen = []
    with using(one):
        assert current() is one
        other = threading.Thread(target=lambda: seen.append(current()))
        other.start()
        other.join()
    assert isinstance(seen[0], TorchDist) and isinstance(current(), TorchDist)


def test_a_wrapping_transport_passes_every_call_on():
    class Counting(Wrapping):
        calls = 0

        def all_reduce(self, tensor, op=ReduceOp.SUM, group=None, async_op=False):
            Counting.calls += 1
            return super().all_reduce(tensor, op=op, group=group, async_op=async_op)

    t = Counting(OneRank())
    t.all_reduce(torch.ones(1))
    assert Counting.calls == 1 and t.get_world_size() == 1 and t.store() is t.inner.store()
    assert not isinstance(Transport(), Wrapping)


def test_nccl_emulation_wraps_virtual_ranks():
    """The emulation over an in-process world: messages match by order, not tag (rank 0
    sends tags 1 then 2, rank 1 receives 2 then 1: virtual ranks buffer like gloo, NCCL
    would not), and a collective still sums."""
    from chimera.runtime.nccl_emulation import NcclEmulation
    from chimera.runtime.p2p import CommTimeout, wait_work
    from chimera.runtime.virtual import run_virtual

    def body(rank):
        emulation = NcclEmulation(current(), "pair")
        try:
            total = torch.full((2,), float(rank + 1))
            emulation.all_reduce(total)  # blocking: through the collective stream
            a, b = torch.ones(3), torch.zeros(3)
            works = [emulation.isend(a, 1, 1), emulation.isend(a, 1, 2)] if rank == 0 else \
                [emulation.irecv(b, 0, 2), emulation.irecv(a, 0, 1)]
            try:
                wait_work(works[0], datetime.timedelta(seconds=10), rank, "first message", 1 - rank)
                return total.tolist(), "no error"
            except CommTimeout as exc:
                return total.tolist(), str(exc)
        finally:
            emulation.close()

    for total, message in run_virtual(2, body):
        assert total == [3.0, 3.0]
        assert "NCCL would match it with tag" in message


def test_a_one_stage_pipeline_on_one_rank_is_single_device_training():
    """api.Pipeline on a world of one (no process group): the loss and gradients of the
    same layers on one device."""
    from torch import nn

    from chimera.api import Pipeline, RunContext
    from chimera.byo import seeded

    def layers():
        return [nn.Linear(4, 4).double(), nn.Tanh(), nn.Linear(4, 2).double()]

    pipe = Pipeline(layers, nn.functional.mse_loss, schedule="1f1b", stages=1, micro_batches=2,
                    micro_batch_size=2, context=RunContext.here(transport=OneRank()))
    with seeded(0):  # what Pipeline does with seed=0
        ref = nn.Sequential(*layers())
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 4, generator=g, dtype=torch.float64)
    y = torch.randn(4, 2, generator=g, dtype=torch.float64)
    loss = pipe.step(x, y)
    want = nn.functional.mse_loss(ref(x), y)
    want.backward()
    assert loss == pytest.approx(want.item(), rel=1e-12)
    for (name, p), q in zip(pipe.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=0, msg=name)
