"""TrainConfig as sections (issue 24): each field written once (type, default, help); the same
run as Python, as `chimera train` flags and as a TOML file; values refused by name when made;
the old flat attribute names are gone (issue 34); every checkpoint records its config; one
default for the micro-batch count."""

import dataclasses
import inspect

import pytest

from chimera.cli import main
from chimera.cli.train_cmd import parse
from chimera.schedules import default_micro_batches
from chimera.schedules.registry import option_declarations
from chimera.train import build
from chimera.train.config import TrainConfig
from chimera.train.sections import FLAT, SECTIONS, ConfigError, Optim, Pipeline, flag

# one value off the default for most fields (a real run would not check files here)
CHANGED = dict(model="bert-tiny", seq_len=32, partition="0-1,2-3", dtype="float64",
               wire_dtype="bf16", doc_mask=True, vocab_size=300, text_field="body", eos_id=5,
               schedule="chimera", stages=4,
               micro_batches=8, micro_batch_size=2, data_parallel=2, tensor_parallel=2, sync="end",
               recompute=True,
               shard_optimizer=True, pipes=4, strategy="doubling", steps=7, lr=1e-3, warmup=2,
               lr_schedule="wsd", min_lr_ratio=0.05, wsd_decay=0.3, adam_beta1=0.8,
               adam_beta2=0.9, adam_eps=1e-6, weight_decay=0.0, grad_accum=2, clip=0.5, seed=3,
               threads=2, device="cpu", backend="gloo", compile=True, comm_timeout=60.0,
               rendezvous_timeout=90.0,
               emulate_nccl="strict", device_plan=4096, malloc="default", fault="nan:1:3",
               tensorboard="tb", peak_flops=2e11, log_json="log.jsonl", trace="t.json",
               png="t.png", trace_step=3, progress=False, skip_nonfinite=True, skip_limit=4,
               spike_factor=3.0, eval_every=2, eval_batches=3, checkpoint_dir="ck",
               checkpoint_every=2, keep_checkpoints=5, resume=True, resume_allow=("data",),
               freeze=("0.*", "*.ln_1.*"), lora_rank=4, lora_alpha=8.0, lora_targets=("*.attn.qkv",))
ARGV = ["--model", "bert-tiny", "--seq-len", "32", "--partition", "0-1,2-3", "--dtype", "float64",
        "--wire-dtype", "bf16", "--doc-mask", "--vocab-size", "300", "--text-field", "body",
        "--eos-id", "5", "-s", "chimera",
        "-D", "4", "-N", "8", "-B", "2", "-W", "2", "-T", "2", "--sync", "end", "--recompute",
        "--shard-optimizer", "-Q", "4", "--strategy", "doubling", "--steps", "7", "--lr", "1e-3",
        "--warmup", "2", "--lr-schedule", "wsd", "--min-lr-ratio", "0.05", "--wsd-decay", "0.3",
        "--adam-beta1", "0.8", "--adam-beta2", "0.9", "--adam-eps", "1e-6", "--weight-decay", "0",
        "--grad-accum", "2", "--clip", "0.5", "--seed", "3", "--threads", "2", "--device", "cpu",
        "--backend", "gloo", "--compile", "--comm-timeout", "60",
        "--rendezvous-timeout", "90", "--emulate-nccl", "strict",
        "--device-plan", "4096", "--malloc", "default", "--fault", "nan:1:3", "--tensorboard", "tb",
        "--peak-flops", "2e11", "--log-json", "log.jsonl", "--trace", "t.json", "--png", "t.png",
        "--trace-step", "3", "--no-progress", "--skip-nonfinite", "--skip-limit", "4",
        "--spike-factor", "3", "--eval-every", "2", "--eval-batches", "3", "--checkpoint-dir",
        "ck", "--checkpoint-every", "2", "--keep-checkpoints", "5", "--resume",
        "--resume-allow", "data", "--freeze", "0.*", "*.ln_1.*", "--lora-rank", "4",
        "--lora-alpha", "8", "--lora-targets", "*.attn.qkv"]


def test_every_field_is_written_once_with_a_default_and_help():
    for cls in SECTIONS.values():
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen
        for f in dataclasses.fields(cls):
            assert f.default is not dataclasses.MISSING and f.metadata["help"], (cls, f.name)
    assert set(FLAT) - {"options"} <= set(CHANGED) | {"data", "token_dtype", "tokenizer", "val_data", "val_fraction", "data_mix"}


def test_python_flags_and_toml_are_one_run(tmp_path):
    python = TrainConfig(**CHANGED)
    nested = TrainConfig(net=python.net, corpus=python.corpus, pipeline=python.pipeline,
                         optim=python.optim, run=python.run, ckpt=python.ckpt)
    flags, extra = parse(ARGV + ["--json"])
    python.save_toml(tmp_path / "run.toml")
    assert flags == python == nested == TrainConfig.from_toml(tmp_path / "run.toml")
    assert extra["json"] is True and extra["config"] is None
    assert python.pipeline.scheme_options == {"pipes": 4, "strategy": "doubling"}
    # a file, and flags beside it that override it (the rest stays the file's)
    again, _ = parse(["--config", str(tmp_path / "run.toml"), "--steps", "9", "-Q", "2"])
    assert again == python.replace(steps=9, pipes=2)
    assert again.optim == dataclasses.replace(python.optim, steps=9)


def test_toml_round_trips_the_defaults_and_the_unset(tmp_path):
    for cfg in (TrainConfig(), TrainConfig(schedule="none", stages=1, trace=None, png=None)):
        cfg.save_toml(tmp_path / "c.toml")
        assert TrainConfig.from_toml(tmp_path / "c.toml") == cfg
    assert "[pipeline]" in TrainConfig().to_toml() and "[optim]" in TrainConfig().to_toml()


def test_help_lists_every_field_and_option(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for name in FLAT:
        if name != "options":
            assert flag(name) in out, name
    for name, (opt, _) in option_declarations().items():
        assert not opt.flag or flag(name) in out, name
    for short in ("-s", "-D", "-N", "-B", "-W", "-Q", "-v", "--config", "--json", "--no-progress"):
        assert short in out, short
    assert "2D" in out and "none, gpipe, 1f1b" in out  # a default's meaning; the schemes


@pytest.mark.parametrize("kwargs, message", [
    (dict(stages=0), "--stages must be a positive integer, got 0"),
    (dict(micro_batch_size=10**8), "--micro-batch-size 100000000 exceeds the limit of 65536"),
    (dict(lr=float("nan")), "--lr must be a finite number > 0, got nan"),
    (dict(adam_beta2=1.0), "--adam-beta2 must be a finite number >= 0 and < 1, got 1.0"),
    (dict(dtype="fp8"), "--dtype must be one of float32, float64, bf16, bf16-master, fp16, got 'fp8'"),
    (dict(device="tpu"), "--device must be one of auto, cpu, cuda"),
    (dict(resume_allow="data,seed"), "--resume-allow takes data, got seed"),
    (dict(checkpoint_every=2), "--resume and --checkpoint-every need --checkpoint-dir"),
    (dict(options={"flavor": 1}), "unknown scheme option(s) flavor"),
    (dict(schedule="pipedream"), "simulation only"),
])
def test_bad_values_are_refused_when_made_naming_the_flag(kwargs, message):
    with pytest.raises(ConfigError) as exc:
        TrainConfig(**kwargs)
    assert message in str(exc.value) and "\n" not in str(exc.value)


def test_a_bad_file_or_flag_is_one_line(tmp_path, capsys):
    (tmp_path / "typo.toml").write_text("[pipeline]\nstagse = 4\n")
    with pytest.raises(ConfigError, match=r"\[pipeline\] has no field stagse"):
        TrainConfig.from_toml(tmp_path / "typo.toml")
    (tmp_path / "table.toml").write_text("[model]\nname = 'x'\n")
    with pytest.raises(ConfigError, match=r"unknown table \[model\]"):
        TrainConfig.from_toml(tmp_path / "table.toml")
    for argv, word in ((["--stages", "two"], "two"), (["--stagse", "4"], "--stagse"),
                       (["--config", str(tmp_path / "typo.toml")], "stagse"),
                       (["--dtype", "fp8"], "fp8")):
        with pytest.raises(SystemExit) as exit_:
            main(["train", *argv])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1, err
        assert err.startswith("chimera train: ") and word in err, err


def test_old_flat_names_are_no_attributes_and_get_reads_a_flag():
    cfg = TrainConfig(**CHANGED)
    for name in [*FLAT, "chunks", "pipes", "strategy", "schedule_options", "stages_total",
                 "model_source"]:
        with pytest.raises(AttributeError):
            getattr(cfg, name)
    for name, section in FLAT.items():
        if name != "options":
            assert cfg.get(name) == getattr(getattr(cfg, section), name), name
    assert (cfg.get("pipes"), cfg.get("strategy")) == (4, "doubling")
    assert cfg.pipeline.stages == 4 and cfg.optim.lr == 1e-3 and cfg.n_micro == 8


def test_flat_arguments_and_replace_keep_working():
    cfg = TrainConfig(stages=4, pipes=4, options={"strategy": "doubling"})
    assert cfg.pipeline == Pipeline(stages=4, options=(("pipes", 4), ("strategy", "doubling")))
    assert dataclasses.replace(cfg, lr=1e-4).optim == Optim(lr=1e-4)
    assert cfg.replace(pipes=None).pipeline.scheme_options == {"strategy": "doubling"}
    with pytest.raises(TypeError, match="flavour"):
        TrainConfig(flavour=1)


def test_a_checkpoint_records_its_config(data, tmp_path, capsys):
    from chimera.train import checkpoint as ckpt
    from chimera.train.loop import Trainer

    cfg = TrainConfig(schedule="none", stages=1, micro_batch_size=2, steps=2, data=data,
                      progress=False, seq_len=16)
    trainer = Trainer(build.preflight(cfg))
    trainer.step(0)
    path = ckpt.save(trainer, tmp_path, 1, keep=3)
    assert TrainConfig.from_toml(path / "config.toml") == cfg
    assert "config.toml" in ckpt.read_meta(path)["files"]  # verified as the tensors are
    ckpt.verify(path)
    # a run starts from it: the same configuration, on flags
    again, _ = parse(["--config", str(path / "config.toml")])
    assert again == cfg


def test_train_the_api_and_show_share_the_micro_batch_default(tmp_path):
    import torch
    import torch.distributed as dist

    from chimera.api import Pipeline as ApiPipeline
    from chimera.cli import build_parser
    from chimera.cli.common import schedule_from_args

    assert TrainConfig(stages=4).n_micro == default_micro_batches(4, "chimera") == 8
    for command in ("show", "simulate"):
        args = build_parser().parse_args([command, "-D", "4"])
        assert schedule_from_args(args).micro_batches == 8
    assert TrainConfig(schedule="none", stages=1).n_micro == 1
    assert inspect.signature(ApiPipeline).parameters["micro_batches"].default is None
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        pipe = ApiPipeline([torch.nn.Linear(2, 2)], torch.nn.functional.mse_loss, schedule="1f1b",
                           stages=1)
        assert pipe.schedule.micro_batches == default_micro_batches(1, "1f1b")
    finally:
        dist.destroy_process_group()
