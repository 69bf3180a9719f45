"""Edges of the Python API (issue 25, item 4): an auxiliary 0-dim output, a plain function
as a layer, a schedule with more model pieces than stages, BatchNorm's batch counter, bad
sizes and timeouts; and ``spawn`` when the child cannot rebuild its function."""

import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import chimera.api as chimera
from chimera import rng
from chimera.byo import FunctionLayer, as_module
from ranks import run_ranks
from limits import limit

N, B = 4, 2  # micro-batches, rows each: a mini-batch of 8


class WithAux(nn.Module):
    """A last layer returning its output and a 0-dim auxiliary loss (API.md invites it)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 1, dtype=torch.float64)

    def forward(self, h):
        return self.lin(h), 1e-2 * h.pow(2).mean()


def aux_loss(out, aux, target):
    return nn.functional.mse_loss(out, target) + aux


def layers(last=None, middle=torch.tanh, bn: bool = False) -> list:
    """``last``: the class of the last layer (built here, after the seed; under the lock of
    torch's global RNG, which virtual ranks share)."""
    with rng.seeded(0):
        first = nn.Linear(4, 6, dtype=torch.float64)
        norm = [nn.BatchNorm1d(6, momentum=None, dtype=torch.float64)] if bn else []
        return [first, *norm, middle, last() if last else nn.Linear(6, 1, dtype=torch.float64)]


def batch():
    g = torch.Generator().manual_seed(1)
    return (torch.randn(N * B, 4, dtype=torch.float64, generator=g),
            torch.randn(N * B, 1, dtype=torch.float64, generator=g))


def _refusal(fn) -> str | None:
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    return None


def _worker(rank: int, world: int) -> dict:
    kw = dict(micro_batches=N, micro_batch_size=B)
    x, y = batch()
    res = {}
    pipe = chimera.Pipeline(layers(WithAux), aux_loss, **kw)
    res["aux"] = pipe.eval().eval_step(x, y, return_outputs=True)
    plain = chimera.Pipeline(layers(), nn.functional.mse_loss, **kw,
                             model=chimera.ModelOptions(partition=[range(0, 2), range(2, 3)]))
    res["function_loss"] = plain.step(x, y)
    bn = chimera.Pipeline(layers(bn=True), nn.functional.mse_loss, **kw,
                          model=chimera.ModelOptions(partition=[range(0, 2), range(2, 4)]))
    for _ in range(3):
        bn.step(x, y)
    res["tracked"] = [int(b) for m in bn.runtime.modules.values()
                      for n, b in m.named_buffers() if n.endswith("num_batches_tracked")]
    res["zbv"] = _refusal(lambda: chimera.Pipeline([nn.Linear(4, 1)], nn.functional.mse_loss,
                                                   schedule="zb-v", stages=2, **kw))
    res["bad"] = [_refusal(lambda: chimera.Pipeline(layers(), nn.functional.mse_loss, **bad))
                  for bad in (dict(micro_batch_size=0), dict(micro_batches=0))]
    res["bad"] += [_refusal(lambda: chimera.RuntimeOptions(comm_timeout=t))
                   for t in (-5.0, float("nan"))]
    return res


@pytest.fixture(scope="module")
def world():
    return run_ranks(_worker, 2)  # virtual ranks: the transport is not the subject here


def test_eval_outputs_with_a_scalar_auxiliary_loss(world):
    """A 0-dim leaf comes back as one value per micro-batch (it cannot be concatenated)."""
    x, y = batch()
    model = nn.Sequential(*map(_module, layers(WithAux))).eval()
    for rank in range(2):
        loss, (out, aux) = world[rank]["aux"]
        assert out.shape == (N * B, 1) and aux.shape == (N,)
        with torch.no_grad():
            torch.testing.assert_close(out, model(x)[0])
            want = [model(x[m * B:(m + 1) * B])[1] for m in range(N)]
        torch.testing.assert_close(aux, torch.stack(want))
        assert loss == pytest.approx(sum(aux_loss(*model(x[m * B:(m + 1) * B]), y[m * B:(m + 1) * B]).item()
                                         for m in range(N)) / N, rel=1e-12)


def test_a_plain_function_is_a_layer(world):
    x, y = batch()
    with torch.no_grad():
        want = float(nn.functional.mse_loss(nn.Sequential(*map(_module, layers()))(x), y))
    for rank in range(2):
        assert world[rank]["function_loss"] == pytest.approx(want, rel=1e-12)
    with pytest.raises(ValueError, match="layer 1 is a int, not an nn.Module or a function"):
        as_module(3, 1)


def _module(layer):
    return layer if isinstance(layer, nn.Module) else FunctionLayer(layer)


def test_batch_counter_counts_every_replicas_micro_batches(world):
    """One device running 4 micro-batches a step for 3 steps counts 12; so does each replica
    of the stage (Chimera D=2: two replicas, each ran half of them)."""
    for rank in range(2):
        assert world[rank]["tracked"] and set(world[rank]["tracked"]) == {3 * N}


def test_more_pieces_than_stages_names_the_schedule(world):
    msg = world[0]["zbv"]
    assert "zb-v with stages=2 cuts the model into 4 pieces" in msg
    assert "2 on each of its 2 ranks" in msg and "1 layer" in msg


def test_bad_sizes_and_timeouts_are_one_line(world):
    got = world[0]["bad"]
    assert "micro_batch_size must be a positive integer, got 0" in got[0]
    assert "micro_batches must be a positive integer, got 0" in got[1]
    assert "comm_timeout must be between 1 and 604800 seconds, got -5.0" in got[2]
    assert "got nan" in got[3]


def test_spawn_refuses_what_it_cannot_start():
    with pytest.raises(ValueError, match="world must be a positive integer"):
        chimera.spawn(_noop, world=0)
    with pytest.raises(ValueError, match="cannot be sent to new processes"):
        chimera.spawn(lambda rank, world: None, world=1)


def _noop(rank, world):
    pass


@pytest.mark.slow
def test_spawn_says_why_a_child_could_not_rebuild_its_function(tmp_path, cli_env):
    """The function lives in a module the new process cannot import: the child's own error,
    not "no Python error" (its traceback used to be printed above, the report said nothing)."""
    script = tmp_path / "main.py"
    script.write_text(textwrap.dedent("""
        import sys, types
        import chimera.api as chimera
        if __name__ == "__main__":
            mod = types.ModuleType("only_in_the_parent")
            exec("def worker(rank, world):\\n    pass\\n", mod.__dict__)
            sys.modules["only_in_the_parent"] = mod
            try:
                chimera.spawn(mod.worker, world=2)
            except chimera.SpawnError as exc:
                print(str(exc).splitlines()[0])
    """))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=limit(120),
                       env=cli_env)
    assert "No module named 'only_in_the_parent'" in r.stdout, r.stdout + r.stderr
    assert "could not be rebuilt in the new process" in r.stdout
    assert "no Python error" not in r.stdout


MIXED = """
import sys
import torch
from torch import nn
import chimera.api as chimera

def main(rank, world):
    torch.manual_seed(0)
    pipe = chimera.Pipeline([nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 1)], nn.functional.mse_loss,
                            micro_batches=4, micro_batch_size=2,
                            context=chimera.RunContext.here(comm_timeout=5.0))
    x, y = torch.ones(8, 4), torch.ones(8, 1)
    pipe.step(x, y)
    if rank == 1:  # the same values in another shape
        x, y = x.unsqueeze(1), y.unsqueeze(1)
    try:
        pipe.step(x, y)
        said = "no error"
    except Exception as exc:
        said = f"{type(exc).__name__}: {exc}"
    with open(f"{sys.argv[1]}.{rank}", "w") as f:
        f.write(said)

if __name__ == "__main__":
    try:
        chimera.spawn(main, world=2)
    except chimera.SpawnError:
        pass  # the ranks leave out of step: the group's end fails, the messages are written
"""


@pytest.mark.slow
def test_a_rank_given_another_shape_is_refused_on_every_rank(tmp_path, cli_env):
    """The batch check starts with the step and is read at its end: the rank whose shape
    changed reads it at once (before probing), the other went on into the run; when that
    run fails (its peer never sends), the check explains why, on both ranks."""
    script = tmp_path / "mixed.py"
    script.write_text(MIXED)
    subprocess.run([sys.executable, str(script), str(tmp_path / "said")], env=cli_env,
                   capture_output=True, text=True, timeout=limit(120))
    for rank in (0, 1):
        said = (tmp_path / f"said.{rank}").read_text()
        assert said.startswith("UserError") and "different mini-batches" in said, (rank, said)
