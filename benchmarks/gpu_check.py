"""The one-GPU check: what a machine with one CUDA device can prove about the runtime.

NCCL refuses two ranks on one GPU, so multi-rank NCCL p2p cannot be tried on one device
(the rendezvous check in ``chimera validate`` and the NCCL emulation on gloo cover its order
on CPU). What one device can show, each as one row of the table:

- ``train``: ``chimera train --device cuda`` at world size 1 (an NCCL group), fp32, bf16
  (autocast), bf16-master (float32 masters) and fp16 (loss scale);
- ``api``: ``chimera.api.Pipeline`` on the GPU (NCCL group of one) against one device;
- ``resume``: a checkpoint written on CUDA and resumed gives the losses of a straight run;
- ``virtual``: all D ranks of chimera D=4 (and 1f1b, zb-v) in one process on the GPU, every
  rank a thread, p2p as copies: gradients against single-device training (float64); every
  rank's ``dist`` calls are recorded and replayed under NCCL's strictest model (one stream
  per rank for p2p and collectives: ``chimera.check.rendezvous.replay_recorded``);
- ``device plan``: the same with the device path's collectives cut small
  (``CHIMERA_DEVICE_PLAN``, several buckets per stage), where they broke before: GEMS with
  odd N (buckets decided per stage), the sharded optimizer (reduce-scatters and prefetched
  all-gathers), and a frozen stage under ``api.Pipeline`` (no shard, one allreduce);
- ``host syncs``: ``torch.cuda.set_sync_debug_mode`` counts host syncs in one pipeline
  iteration of every virtual rank (target 0: the loss is read once per step, outside);
- ``profile``: per-layer F/B/I/W on the device, written as a ``chimera.profile/1`` file
  (its links are gloo on the host: on one GPU there is no link to measure);
- ``memory``: peak device memory of the virtual run, per stage's rank share.

Run: ``python benchmarks/gpu_check.py`` (under 5 minutes on an H200). Writes
``out/gpu_check.{md,json}`` and ``out/gpu_profile.json`` (``--out benchmarks/results``: the
committed figures).
``--device cpu`` runs the same rows on the CPU (a smoke test of the script itself; the CPU
results go to ``--out`` and say so).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import warnings

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(ROOT, "src"))

from chimera.runtime.nccl_emulation import DEVICE_PLAN_ENV  # noqa: E402
from chimera.runtime.virtual import VirtualWorld, run_virtual  # noqa: E402
from chimera.check.rendezvous import replay_recorded  # noqa: E402
from chimera.train.config import TrainConfig  # noqa: E402
from chimera.train.equivalence import check_virtual  # noqa: E402
from chimera.train.loop import Trainer, run_context  # noqa: E402


def _train(device: str, dtype: str, steps: int, tmp: str, extra=()) -> dict:
    log = os.path.join(tmp, f"log-{dtype}-{len(extra)}.jsonl")
    cmd = [sys.executable, "-m", "chimera", "train", "--device", device, "-s", "1f1b", "-D", "1",
           "--steps", str(steps), "--dtype", dtype, "--no-progress", "--log-json", log,
           "--png", os.path.join(tmp, "t.png"), "--trace", os.path.join(tmp, "t.json"), *extra]
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")}
    start = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    losses = {}
    if os.path.exists(log):
        with open(log) as f:
            losses = {json.loads(line)["step"]: json.loads(line)["loss"] for line in f if line.strip()}
    return {"ok": r.returncode == 0, "seconds": time.perf_counter() - start, "losses": losses,
            "error": r.stderr.strip().splitlines()[-1] if r.returncode and r.stderr.strip() else ""}


def check_train(device: str, tmp: str) -> list[dict]:
    rows = []
    for dtype in ("float32", "bf16", "bf16-master", "fp16"):  # the last two: issue 25's precisions
        got = _train(device, dtype, 4, tmp)
        rows.append({"check": f"train {dtype}", "ok": got["ok"] and len(got["losses"]) == 4,
                     "detail": f"losses {[round(x, 4) for x in got['losses'].values()]} in {got['seconds']:.1f}s "
                               f"{got['error']}".strip()})
    straight = _train(device, "float32", 4, tmp)
    ck = os.path.join(tmp, "ck")
    first = _train(device, "float32", 2, tmp, ("--checkpoint-dir", ck))
    resumed = _train(device, "float32", 4, tmp, ("--checkpoint-dir", ck, "--resume"))
    diff = max((abs(loss - straight["losses"].get(step, float("inf")))
                for step, loss in resumed["losses"].items()), default=float("inf"))
    ok = first["ok"] and resumed["ok"] and sorted(resumed["losses"]) == [2, 3] and diff < 1e-5
    rows.append({"check": "checkpoint resume", "ok": ok,
                 "detail": f"steps 2-3 after resume vs straight: max |loss diff| {diff:.2e} "
                           f"{resumed['error']}".strip()})
    return rows


def _cfg(schedule: str, dtype: str = "float64", **kw) -> TrainConfig:
    kw = {"stages": 4, "micro_batches": 8, **kw}
    return TrainConfig(schedule=schedule, micro_batch_size=2, dtype=dtype, steps=2, **kw)


def _virtual_row(name: str, cfg: TrainConfig, device: torch.device) -> dict:
    """Virtual ranks on the device against one device, every call replayed strictly."""
    start = time.perf_counter()
    r = check_virtual(cfg, device, replay=True)
    ok = r["max_grad_rel_err"] < 1e-10 and r["replicas_identical"] and not r["missing"] \
        and r["max_norm_rel_err"] < 1e-10
    return {"check": name, "ok": ok,
            "detail": f"max grad rel err {r['max_grad_rel_err']:.1e}, loss rel err "
                      f"{r['max_loss_rel_err']:.1e}, replicas identical {r['replicas_identical']}, "
                      f"{r['replayed_calls']} calls replayed with one stream per rank "
                      f"({time.perf_counter() - start:.1f}s)"}


def check_virtual_ranks(device: torch.device) -> list[dict]:
    rows = [_virtual_row(f"virtual {schedule} D=4 float64", _cfg(schedule), device)
            for schedule in ("chimera", "1f1b", "zb-v")]
    # tensor parallelism (issue 35): D=2 x T=2 on the device, its TP collectives recorded
    # with the pipeline's and replayed under the strict model (the gradient norm too)
    for schedule in ("chimera", "zb-v"):
        cfg = _cfg(schedule, stages=2, tensor_parallel=2, micro_batches=4)
        rows.append(_virtual_row(f"virtual {schedule} D=2 T=2 float64", cfg, device))
    return rows


class _DevicePlan:
    """``CHIMERA_DEVICE_PLAN`` set for a while: the device path's choices (on the CPU too),
    with small buckets so that every stage issues several."""

    def __init__(self, value: str = "65536"):
        self.value, self.saved = value, None

    def __enter__(self):
        self.saved = os.environ.get(DEVICE_PLAN_ENV)
        os.environ[DEVICE_PLAN_ENV] = self.value

    def __exit__(self, *exc):
        if self.saved is None:
            os.environ.pop(DEVICE_PLAN_ENV, None)
        else:
            os.environ[DEVICE_PLAN_ENV] = self.saved


def check_device_plan(device: torch.device) -> list[dict]:
    """Issue 23's rows: GEMS with odd N, the sharded optimizer, a frozen stage."""
    rows = []
    with _DevicePlan():
        for stages, n in ((2, 3), (4, 5)):
            cfg = TrainConfig(schedule="gems", stages=stages, micro_batches=n, micro_batch_size=2,
                              dtype="float64", steps=2)
            rows.append(_virtual_row(f"device plan: gems D={stages} N={n} (odd N) float64", cfg, device))
        rows.append(_virtual_row("device plan: chimera D=4 sharded optimizer float64",
                                 _cfg("chimera", shard_optimizer=True), device))
        rows.append(check_frozen(device))
    return rows


def _frozen_layers():
    layers = [torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Tanh(),
              torch.nn.Linear(8, 4)]
    layers[0].requires_grad_(False)  # stage 0: nothing to train
    return [layer.double() for layer in layers]


def _frozen_rank(rank: int, device: torch.device, x, y) -> dict:
    import chimera.api as chimera

    pipe = chimera.Pipeline(_frozen_layers, torch.nn.functional.mse_loss, schedule="gems",
                            micro_batches=3, micro_batch_size=2,
                            model=chimera.ModelOptions(partition=[range(0, 2), range(2, 5)]),
                            options=chimera.ExecOptions(shard_optimizer=True),
                            context=chimera.RunContext.here(device=device))
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    losses = []
    for _ in range(2):
        opt.zero_grad()
        losses.append(pipe.step(x, y))
        opt.step()
    return {"losses": losses, "params": {n: p.detach().cpu() for n, p in pipe.named_parameters()},
            "shards": sorted(pipe.runtime.shards)}


def check_frozen(device: torch.device) -> dict:
    """api.Pipeline, gems D=2 N=3, sharded, stage 0 frozen, on virtual ranks on the device,
    every call replayed strictly, against the same layers on one device."""
    from chimera.byo import seeded

    start = time.perf_counter()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 8, generator=gen, dtype=torch.float64)
    y = torch.randn(6, 4, generator=gen, dtype=torch.float64)
    world = VirtualWorld(2, record=True)
    got = run_virtual(2, lambda rank: _frozen_rank(rank, device, x, y), world)
    replayed = replay_recorded(world.recorded(), "strict")
    with seeded(0):  # what Pipeline does with seed=0
        ref = torch.nn.Sequential(*_frozen_layers()).to(device)
    opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1)
    ref_losses = []
    for _ in range(2):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ref(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
        ref_losses.append(float(loss.detach()))
    ref_params = {n: p.detach().cpu() for n, p in ref.named_parameters()}
    err = max(float((p - ref_params[n]).abs().max()) for r in got for n, p in r["params"].items())
    loss_err = max(abs(a - b) for r in got for a, b in zip(r["losses"], ref_losses))
    no_frozen_shard = all(stage != 0 for r in got for _, stage in r["shards"])
    return {"check": "device plan: api.Pipeline frozen stage, sharded, gems D=2 N=3",
            "ok": err < 1e-10 and loss_err < 1e-10 and no_frozen_shard,
            "detail": f"max |param diff| {err:.1e}, max |loss diff| {loss_err:.1e}, frozen stage "
                      f"unsharded {no_frozen_shard}, {replayed} calls replayed with one stream "
                      f"per rank ({time.perf_counter() - start:.1f}s)"}


def check_host_syncs(device: torch.device) -> tuple[list[dict], dict]:
    """Host syncs inside one pipeline iteration of every rank, and peak memory per rank."""
    cfg = _cfg("chimera", "float32")
    gate = threading.Barrier(cfg.world)
    counted: list = []
    peaks: dict = {}

    def rank_body(rank: int) -> None:
        trainer = Trainer(cfg, run_context(cfg, device))  # the virtual rank's transport
        trainer.step(0)  # warm-up: allocations, lazy inits
        data = trainer._micro_data(*trainer.batch(1))
        if gate.wait() == 0 and device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            torch.cuda.set_sync_debug_mode("warn")
        gate.wait()
        trainer.runtime.zero_grad()
        trainer.runtime.run(data)  # the hot path: no loss read, no optimizer
        if gate.wait() == 0 and device.type == "cuda":
            torch.cuda.set_sync_debug_mode("default")
            peaks["all_ranks_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
        gate.wait()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_virtual(cfg.world, rank_body)
        counted = [w for w in caught if "synchroniz" in str(w.message)]
    where = sorted({f"{os.path.basename(w.filename)}:{w.lineno}" for w in counted})
    detail = f"{len(counted)} in one iteration of {cfg.world} ranks" + (f" at {', '.join(where)}" if where else "")
    if device.type != "cuda":
        detail = "not measurable on the CPU"
    return [{"check": "host syncs in the hot path", "ok": device.type != "cuda" or not counted,
             "detail": detail}], peaks


def _api_rank(rank: int, world: int, device: str, out: str) -> None:
    """One rank of the API check: a float64 MLP with a tied weight, 3 AdamW steps."""
    import chimera.api as chimera

    def make_layers():
        first, last = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        last.weight = first.weight  # tied: one logical parameter
        return [first, torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Tanh(), last]

    def layers64():
        return [layer.double() for layer in make_layers()]

    pipe = chimera.Pipeline(layers64, torch.nn.functional.mse_loss, schedule="1f1b", stages=1,
                            micro_batches=2, micro_batch_size=4,
                            context=chimera.RunContext.here(device=device))
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 8, generator=gen, dtype=torch.float64), torch.randn(8, 8, generator=gen, dtype=torch.float64)
    losses = []
    for _ in range(3):
        opt.zero_grad()
        losses.append(pipe.step(x, y))
        opt.step()
    state = {k: v.cpu() for k, v in pipe.state_dict().items()}
    from chimera.byo import seeded

    with seeded(0):  # what Pipeline does with seed=0
        ref = torch.nn.Sequential(*layers64()).to(device)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_losses = []
    for _ in range(3):
        ref_opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ref(x.to(device)), y.to(device))
        loss.backward()
        ref_opt.step()
        ref_losses.append(float(loss.detach()))
    diff = max(float((state[k] - v.cpu()).abs().max()) for k, v in ref.state_dict().items())
    with open(out, "w") as f:
        json.dump({"losses": losses, "ref_losses": ref_losses, "param_diff": diff,
                   "device": str(next(iter(pipe.parameters())).device)}, f)


def check_api(device: str, tmp: str) -> list[dict]:
    import functools

    import chimera.api as chimera

    out = os.path.join(tmp, "api.json")
    where = "cuda:0" if device == "cuda" else device
    chimera.spawn(functools.partial(_api_rank, device=where, out=out), world=1,
                  backend="nccl" if device == "cuda" else "gloo")
    with open(out) as f:
        r = json.load(f)
    loss_diff = max(abs(a - b) for a, b in zip(r["losses"], r["ref_losses"]))
    ok = r["param_diff"] < 1e-10 and loss_diff < 1e-10 and r["device"].startswith(device)
    return [{"check": "api.Pipeline", "ok": ok,
             "detail": f"on {r['device']}: 3 AdamW steps, tied weight, float64: max |param diff| "
                       f"{r['param_diff']:.1e}, max |loss diff| {loss_diff:.1e}"}]


def check_profile(device: str, out: str, model: str) -> list[dict]:
    from chimera.bench.profiler import profile_layers
    from chimera.sim.profile import PROFILE_SCHEMA

    start = time.perf_counter()
    layers = profile_layers(model, 2, repeat=5, device=device)
    profile = {"schema": PROFILE_SCHEMA, "model": model, "micro_batch": 2,
               "device": device, "layers": layers,
               # one GPU has no link to measure: nominal NVLink-class figures, say so
               "p2p": {"alpha_s": 10e-6, "beta_bytes_per_s": 100e9, "assumed": True},
               "allreduce": {"alpha_s": 20e-6, "beta_bytes_per_s": 100e9, "assumed": True}}
    with open(out, "w") as f:
        json.dump(profile, f, indent=1)
    f_ms = sum(x["forward_s"] for x in layers) * 1e3
    b_ms = sum(x["backward_s"] for x in layers) * 1e3
    return [{"check": "profile", "ok": True,
             "detail": f"{len(layers)} layers, F {f_ms:.2f} ms B {b_ms:.2f} ms per micro-batch "
                       f"-> {os.path.relpath(out, ROOT)} ({time.perf_counter() - start:.1f}s)"}]


def write(rows: list[dict], extra: dict, out_dir: str, device: str) -> None:
    head = f"# One-GPU check ({device}: {extra['device_name']}, torch {torch.__version__})\n\n"
    table = "| check | ok | detail |\n|---|---|---|\n" + "".join(
        f"| {r['check']} | {'yes' if r['ok'] else 'NO'} | {r['detail']} |\n" for r in rows)
    with open(os.path.join(out_dir, "gpu_check.md"), "w") as f:
        f.write(head + table + f"\nPeak device memory of the virtual D=4 run: {extra.get('peak')}\n")
    with open(os.path.join(out_dir, "gpu_check.json"), "w") as f:
        json.dump({"rows": rows, **extra}, f, indent=1)
    print(head + table)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (smoke test)")
    ap.add_argument("--out", default="out",
                    help="folder for gpu_check.{md,json} and gpu_profile.json")
    ap.add_argument("--profile-model", default="gpt2-bench", help="model preset to profile")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (use --device cpu for a smoke test)", file=sys.stderr)
        return 2
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    os.makedirs(args.out, exist_ok=True)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, fn in (("train", lambda: check_train(args.device, tmp)),
                         ("virtual", lambda: check_virtual_ranks(device)),
                         ("device plan", lambda: check_device_plan(device)),
                         ("api", lambda: check_api(args.device, tmp)),
                         ("profile", lambda: check_profile(args.device, os.path.join(args.out, "gpu_profile.json"),
                                                           args.profile_model))):
            try:
                rows += fn()
            except Exception as exc:  # noqa: BLE001 - a failed row is a result, not a crash
                rows.append({"check": name, "ok": False, "detail": f"{type(exc).__name__}: {exc}"})
        try:
            sync_rows, peaks = check_host_syncs(device)
            rows += sync_rows
        except Exception as exc:  # noqa: BLE001
            rows.append({"check": "host syncs", "ok": False, "detail": f"{type(exc).__name__}: {exc}"})
            peaks = {}
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    write(rows, {"device_name": name, "peak": peaks, "when": time.strftime("%Y-%m-%d %H:%M")},
          args.out, args.device)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
