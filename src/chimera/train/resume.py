"""What a ``--resume`` may change: the checkpoint's record of its run against this run's config.

A checkpoint's ``meta.json`` records the run that wrote it (``record``: the optimizer
settings, the schedule of the learning rate, the batch, the layout). Resuming compares it
field by field (``compare``) and sorts each difference into

- refused: what would make the resumed run another run. The model (its every config field:
  --seq-len, the vocabulary, the preset), the batch of a step (W*N*B*K sequences: the data
  position is a function of the step and the batch), --seed (the order of the data) and
  --data (unless ``--resume-allow data``: fine-tuning on new data from a checkpoint);
- accepted, and announced: --steps, the learning rate and its schedule, AdamW's settings,
  clipping, the precision, --doc-mask (what attends to what, not the weights), and the layout (schedule, D, W, N, B, K) where the step's batch
  stays the same. Logging and checkpointing flags are not recorded: they change freely.

Imports no torch (``TrainConfig`` checks before torch loads).
"""

from __future__ import annotations

import os

# recorded field -> the flag that sets it
ACCEPTED = {
    "steps": "--steps", "lr": "--lr", "lr_schedule": "--lr-schedule", "min_lr_ratio": "--min-lr-ratio",
    "wsd_decay": "--wsd-decay", "warmup_steps": "--warmup", "weight_decay": "--weight-decay",
    "adam_beta1": "--adam-beta1", "adam_beta2": "--adam-beta2", "adam_eps": "--adam-eps",
    "clip": "--clip", "dtype": "--dtype", "schedule": "--schedule", "stages": "-D",
    "data_parallel": "-W", "micro_batches": "-N", "micro_batch_size": "-B", "grad_accum": "--grad-accum",
    "doc_mask": "--doc-mask",
}
REFUSES = ("a resume refuses a change of the model, --seq-len, the vocabulary, the batch "
           "W*N*B*K, what trains (--freeze, --lora-*), --seed or --data (chimera train --help, "
           "--resume)")
MODEL_FLAGS = {"seq_len": "--seq-len", "vocab_size": "--vocab-size (the data's vocabulary)"}
SUMMARY = ("a resume accepts, and announces, changes to --steps, the learning rate and its "
           "schedule, AdamW's settings, --clip, --dtype, --doc-mask and the layout (same W*N*B*K); it refuses "
           "the model, --seq-len, the vocabulary, the batch W*N*B*K, --seed and --data "
           "(--resume-allow data accepts new data)")


def record(cfg) -> dict:
    """What ``meta.json`` records of the run (``run``), for the next resume to compare."""
    out = {k: cfg.get(k) for k in ACCEPTED if k != "warmup_steps" and k != "micro_batches"}
    out.update(warmup_steps=cfg.warmup_steps, micro_batches=cfg.n_micro, seed=cfg.optim.seed,
               step_batch=cfg.step_batch, data=_where(cfg.corpus.data), **tuning(cfg))
    if cfg.corpus.data_mix:  # the sources by where they are, and their weights
        out["data_mix"] = [_where(p) + ":" + w for p, _, w in
                           (e.rpartition(":") for e in cfg.corpus.data_mix)]
    inside = _in_run(cfg.corpus.data, cfg.ckpt.checkpoint_dir)
    if inside is not None:  # moves with the run folder: compared where it is then
        out["data_in_run"] = inside
    return out


def _in_run(path: str | None, run: str | None) -> str | None:
    """``path`` relative to the run folder ``run`` when it lies inside it, else None."""
    if path is None or run is None:
        return None
    relative = os.path.relpath(os.path.abspath(path), os.path.abspath(run))
    return None if relative.startswith(os.pardir) else relative


def tuning(cfg) -> dict:
    """What trains: the frozen patterns and the LoRA adapters (``chimera export`` merges
    them with these settings)."""
    return {"freeze": list(cfg.net.freeze), "lora": cfg.net.lora}


def _where(path: str | None) -> str | None:
    return None if path is None else os.path.abspath(path)


def compare(meta: dict, cfg, fingerprint: dict) -> tuple[list[str], list[str]]:
    """(refused, accepted): one line per field that differs between the checkpoint's
    ``meta`` and this run (``cfg``; ``fingerprint``: its model's config)."""
    run, data = meta.get("run") or {}, meta.get("data") or {}
    refused = _model_changes(meta, cfg.net.model, fingerprint)
    if meta.get("model") != cfg.net.model:  # another model altogether: the rest is moot
        return refused, []
    batch = run.get("step_batch", data.get("global_batch"))  # before grad_accum: W*N*B
    if batch is not None and batch != cfg.step_batch:
        refused.append(_line("the batch of a step (W*N*B*K sequences)", batch, cfg.step_batch,
                             "-W -N -B --grad-accum"))
    was_tuned = {k: run.get(k) or ([] if k == "freeze" else None) for k in ("freeze", "lora")}
    if was_tuned != tuning(cfg):
        refused.append(_line("what trains", was_tuned, tuning(cfg),
                             "--freeze, --lora-rank, --lora-alpha, --lora-targets"))
    if "seed" in data and data["seed"] != cfg.optim.seed:
        refused.append(_line("seed", data["seed"], cfg.optim.seed, "--seed"))
    was = run["data"] if "data" in run else _where(data.get("source"))
    if run.get("data_in_run") is not None and run["data_in_run"] == _in_run(
            cfg.corpus.data, cfg.ckpt.checkpoint_dir):
        was = _where(cfg.corpus.data)  # the run folder moved, and its data with it
    mix = record(cfg).get("data_mix")
    if (run.get("data_mix") or mix) and run.get("data_mix") != mix and "data" not in cfg.ckpt.resume_allow:
        refused.append(_line("data mix", run.get("data_mix"), mix,
                             "--data-mix; --resume-allow data accepts it"))
    if "data" in run or "source" in data:
        if was != _where(cfg.corpus.data) and "data" not in cfg.ckpt.resume_allow:
            refused.append(_line("data", was or "the default corpus",
                                 cfg.corpus.data or "the default corpus",
                                 "--data; --resume-allow data accepts it"))
    return refused, _accepted(meta, cfg)


def _model_changes(meta: dict, model: str, fingerprint: dict) -> list[str]:
    if meta.get("model") != model:  # another model: its fields would all differ
        return [_line("model", meta.get("model"), model, "--model")]
    out = []
    theirs, ours = _flat(meta.get("model_config") or {}), _flat(fingerprint)
    for key in sorted(set(theirs) | set(ours)):
        if theirs.get(key) != ours.get(key):
            flag = MODEL_FLAGS.get(key.rsplit(".", 1)[-1], "--model")
            out.append(_line(f"model {key}", theirs.get(key, "(none)"), ours.get(key, "(none)"), flag))
    return out


def _flat(d: dict, prefix: str = "") -> dict:
    """A nested config (an HF model's) as dotted keys, so each field is named on its own."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _accepted(meta: dict, cfg) -> list[str]:
    run = dict(meta.get("run") or {})
    for k, v in (meta.get("layout") or {}).items():  # checkpoints from before ``run``
        run.setdefault(k, v)
    now = record(cfg)
    return [_line(k, run[k], now[k], flag) for k, flag in ACCEPTED.items()
            if k in run and run[k] != now[k]]


def _line(what: str, was, now, flag: str) -> str:
    return f"  {what}: {was!r} in the checkpoint, {now!r} now ({flag})"
