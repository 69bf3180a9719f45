"""`chimera profile`: measure a model's per-layer costs and this machine's links.

Per layer of the flat list (embedding, blocks, head; the head's forward includes the loss, as
the runtime's last stage does): forward F, full backward B, and the split backward the runtime
executes, I (input gradient, ``chimera.runtime.split_backward.backward_input``) then W (weight
gradients, ``backward_weight``); the bytes it keeps for backward (saved tensors, weights
excluded), of its output (what crosses a stage boundary) and of its parameters. Times are
medians over repeats on ``threads`` torch threads (the runtime's one per rank by default).

Links: two gloo processes on the loopback, p2p (half a ping-pong round trip) and a two-rank
allreduce at sizes from 4 KiB to 16 MiB, fitted as ``alpha + bytes / beta``; the allreduce as
a ring, whose 2(g-1) = 2 steps each move bytes/g: ``T = 2 alpha + bytes / beta``.

Optimizer: the trainer's own AdamW (``train.loop.make_optimizer``: fused, nanoGPT's decay
groups) stepping over every layer's parameters with gradients set, per byte of parameters
(``optimizer_s_per_byte``): a rank's step costs that times the bytes of the replicas it holds,
so Chimera's second copy of each stage doubles it and a sharded optimizer divides it.

The result is a ``chimera.profile/1`` object (:mod:`chimera.sim.profile`, the one schema
``chimera simulate --profile`` and ``chimera plan --profile`` read).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time

import torch

from chimera.bench.runners import ActivationMeter
from chimera.models import build_layers, get_config, layer_names, loss_fn
from chimera.runtime import workers
from chimera.runtime.allocator import keep_freed_memory
from chimera.runtime.split_backward import backward_input, backward_weight
from chimera.runtime.context import RuntimeOptions
from chimera.runtime.transport import TorchDist, Transport
from chimera.sim.profile import PROFILE_SCHEMA
from chimera.train.config import TrainConfig
from chimera.train.loop import make_optimizer
from chimera.runtime.workers import gloo_group

LINK_SIZES = tuple(4096 * 4 ** k for k in range(7))  # 4 KiB .. 16 MiB


def _median_time(fn, repeat: int, warmup: int = 1) -> float:
    """Median wall seconds of ``fn()``, which returns the seconds it measured itself."""
    for _ in range(warmup):
        fn()
    return statistics.median(fn() for _ in range(repeat))


class _Layer:
    """One layer and its measured input, ready to run F, B, I and W on a fresh graph."""

    def __init__(self, module, x, last: bool, lossf, targets):
        self.module, self.x, self.last, self.lossf, self.targets = module, x, last, lossf, targets
        self.params = [p for p in module.parameters() if p.requires_grad]

    def forward(self):
        x = self.x.detach().requires_grad_(self.x.is_floating_point())
        y = self.module(x)
        if self.last:
            y = self.lossf(y, self.targets)
        return x, y

    def _grad(self, y):
        return None if self.last else torch.ones_like(y) * 1e-3

    def _now(self) -> float:
        """The host clock once the device is idle (kernels run asynchronously on CUDA)."""
        if self.x.device.type == "cuda":
            torch.cuda.synchronize(self.x.device)
        return time.perf_counter()

    def time_f(self) -> float:
        t0 = self._now()
        self.forward()
        return self._now() - t0

    def time_b(self) -> float:
        _, y = self.forward()
        g = self._grad(y)
        t0 = self._now()
        torch.autograd.backward(y, g)
        return self._now() - t0

    def time_iw(self) -> tuple[float, float]:
        x, y = self.forward()
        g = self._grad(y)
        t0 = self._now()
        _, pending = backward_input(y, x if x.requires_grad else None, g, self.params)
        t1 = self._now()
        backward_weight(pending)
        return t1 - t0, self._now() - t1

    def saved_bytes(self) -> int:
        meter = ActivationMeter(self.params)
        with meter.hooks():
            _, y = self.forward()
        del y
        return meter.peak


def profile_layers(model: str, micro_batch: int, repeat: int = 5, seed: int = 0,
                   device: str = "cpu") -> list[dict]:
    cfg = get_config(model)
    layers = [layer.to(device) for layer in build_layers(cfg, seed)]
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, cfg.vocab_size, (micro_batch, cfg.seq_len), generator=gen).to(device)
    targets = torch.randint(0, cfg.vocab_size, (micro_batch, cfg.seq_len), generator=gen).to(device)
    lossf, names, out = loss_fn(cfg, "mean"), layer_names(cfg), []
    for k, module in enumerate(layers):
        layer = _Layer(module, x, k == len(layers) - 1, lossf, targets)
        iw = [layer.time_iw() for _ in range(repeat + 1)][1:]
        with torch.no_grad():
            y = module(x)
        out.append({
            "name": names[k],
            "forward_s": _median_time(layer.time_f, repeat),
            "backward_s": _median_time(layer.time_b, repeat),
            "input_backward_s": statistics.median(i for i, _ in iw),
            "weight_backward_s": statistics.median(w for _, w in iw),
            "activation_bytes": layer.saved_bytes(),
            "output_bytes": y.numel() * y.element_size(),
            "param_bytes": sum(p.numel() * p.element_size() for p in module.parameters()),
        })
        x = y
    return out


def fit_link(samples: list[tuple[int, float]], steps: int = 1) -> dict:
    """Least-squares ``seconds = a + bytes * c``: alpha = a / steps (each of a ring's steps pays
    it; 1 for p2p), beta = 1 / c (a two-rank ring moves bytes/2 twice: bytes in all)."""
    n = len(samples)
    mx = sum(b for b, _ in samples) / n
    my = sum(t for _, t in samples) / n
    var = sum((b - mx) ** 2 for b, _ in samples)
    c = sum((b - mx) * (t - my) for b, t in samples) / var if var else 0.0
    a = my - c * mx
    return {"alpha_s": max(a, 0.0) / steps, "beta_bytes_per_s": 1.0 / c if c > 0 else 1e12,
            "samples": [[b, t] for b, t in samples]}


def ping(transport: Transport, buf: torch.Tensor, pair: tuple[int, int] = (0, 1)) -> float:
    """Half a round trip of ``buf`` between the ranks of ``pair`` (0.0 on the others)."""
    transport.barrier()
    rank = transport.get_rank()
    if rank not in pair:
        return 0.0
    peer = pair[1] if rank == pair[0] else pair[0]
    t0 = time.perf_counter()
    if rank == pair[0]:
        transport.isend(buf, peer).wait()
        transport.irecv(buf, peer).wait()
    else:
        transport.irecv(buf, peer).wait()
        transport.isend(buf, peer).wait()
    return (time.perf_counter() - t0) / 2


def allreduce_time(transport: Transport, buf: torch.Tensor, group=None, members=None) -> float:
    """Seconds of one allreduce of ``buf`` over ``group`` (0.0 on ranks outside ``members``)."""
    transport.barrier()
    if members is not None and transport.get_rank() not in members:
        return 0.0
    t0 = time.perf_counter()
    transport.all_reduce(buf, group=group)
    return time.perf_counter() - t0


def _links_worker(rank: int, port: int, repeat: int, out: str) -> None:
    with gloo_group(rank, 2, port):
        transport = TorchDist()  # the group just made
        result: dict = {"p2p": [], "allreduce": []}
        for nbytes in LINK_SIZES:
            buf = torch.zeros(nbytes // 4)
            for key, fn in (("p2p", ping), ("allreduce", allreduce_time)):
                times = [fn(transport, buf) for _ in range(repeat + 2)][2:]
                result[key].append((nbytes, statistics.median(times)))
        if rank == 0:
            with open(out, "w") as f:
                json.dump(result, f)


def measure_links(repeat: int = 20) -> dict:
    """p2p and allreduce alpha-beta of two gloo processes on this machine."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "links.json")
        with workers.hosted_store(2) as store:
            codes = workers.run(_links_worker, (store, repeat, out), 2, grace=10.0)
        if any(codes):
            raise RuntimeError(f"measuring the links failed (exit codes {codes}; the ranks' "
                               "messages are above)")
        with open(out) as f:
            raw = json.load(f)
    return {"p2p": fit_link(raw["p2p"]), "allreduce": {**fit_link(raw["allreduce"], steps=2), "group": 2}}


def optimizer_seconds_per_byte(model: str, repeat: int = 5, seed: int = 0) -> float:
    """Median seconds of one AdamW step of the whole model, per byte of its parameters."""
    params = [p for layer in build_layers(get_config(model), seed) for p in layer.parameters()]
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)
    optimizer = make_optimizer(params, TrainConfig(model=model))
    nbytes = sum(p.numel() * p.element_size() for p in params)

    def timed() -> float:
        start = time.perf_counter()
        optimizer.step()
        return time.perf_counter() - start
    return _median_time(timed, repeat) / nbytes


def build_profile(model: str, micro_batch: int, threads: int = 1, repeat: int = 5,
                  link_repeat: int = 20) -> dict:
    torch.set_num_threads(threads)
    keep_freed_memory(RuntimeOptions.from_env().malloc)  # the layers run as in `chimera train`
    layers = profile_layers(model, micro_batch, repeat)
    data = {"schema": PROFILE_SCHEMA, "model": model, "micro_batch": micro_batch,
            "threads": threads, "dtype": "float32", "layers": layers,
            "date": time.strftime("%Y-%m-%d %H:%M"), "torch": torch.__version__,
            "cpus": os.cpu_count(), "load_average": os.getloadavg(),
            "optimizer_s_per_byte": optimizer_seconds_per_byte(model, repeat)}
    data.update(measure_links(link_repeat))
    return data
