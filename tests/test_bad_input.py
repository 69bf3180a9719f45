"""Bad input is refused before any process starts: exit code 2 and one line on stderr from
the CLI, a ValueError subclass (ConfigError, ScheduleError) from the Python API.

The CLI runs in this process (``chimera.cli.main``) with the launcher replaced by a trap,
so a case that got as far as starting processes fails loudly instead of training.
"""

import argparse
import json
import math
import os
import shutil

import pytest

from chimera.cli import main
from chimera.ir import ScheduleError
from chimera.train import ConfigError, TrainConfig

PROFILE = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results", "profile-gpt2-bench.json")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Data and checkpoints to be refused: empty, binary-only, corrupt, another model's."""
    from chimera.train import checkpoint
    from chimera.train.loop import Trainer

    root = tmp_path_factory.mktemp("bad")
    (root / "empty.txt").write_text("")
    (root / "binary").mkdir()
    (root / "binary" / "blob.bin").write_bytes(b"\0\1\2" * 1000)
    (root / "text.txt").write_bytes(open(argparse.__file__, "rb").read()[:20_000])
    (root / "not-a-dir").write_text("x")
    (root / "profile.json").write_text("{this is not json")
    for model in ("gpt2-tiny", "bert-tiny"):
        t = Trainer(TrainConfig(model=model, schedule="none", stages=1, data=str(root / "text.txt"),
                                micro_batch_size=2, progress=False))
        t.step(0)
        checkpoint.save(t, root / model, 1, keep=1)
    shutil.copytree(root / "gpt2-tiny", root / "corrupt")
    blob = next((root / "corrupt" / "step-00000001").glob("*.distcp"))
    blob.write_bytes(blob.read_bytes()[:-100])  # truncated
    shutil.copytree(root / "gpt2-tiny", root / "tampered")
    meta = root / "tampered" / "step-00000001" / "meta.json"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "step": "seven"}))
    (root / "short.txt").write_bytes(b"x" * 32)  # one sequence, but not after the held-out 5%
    (root / "short-val.txt").write_bytes(b"x" * 300)  # trains; 15 held-out bytes: no sequence
    os.mkfifo(root / "fifo")
    _measured_files(root)
    return root


def _measured_files(root):
    """Profiles and traces with values no cost can be made of."""
    profile = json.loads(open(PROFILE).read())

    def variant(name, edit, base=profile):
        data = json.loads(json.dumps(base))
        edit(data)
        (root / name).write_text(json.dumps(data))  # json writes inf as Infinity
    variant("beta0.json", lambda d: d["p2p"].update(beta_bytes_per_s=0))
    variant("null.json", lambda d: d["layers"][1].update(param_bytes=None))
    variant("inf.json", lambda d: d["layers"][1].update(forward_s=math.inf))
    variant("split-half.json", lambda d: [d["layers"][1].pop(k) for k in ("input_backward_s", "weight_backward_s")])
    assert main(["show", "-D", "2", "-N", "2", "--trace", str(root / "trace.json")]) == 0
    trace = json.loads((root / "trace.json").read_text())
    variant("step-str.json", lambda d: d["otherData"].update(step_s="fast"), trace)
    variant("trace-inf.json", lambda d: next(e for e in d["traceEvents"] if e.get("ph") == "X")
            .update(dur=math.inf), trace)


PLAN = ["plan", "--model", "gpt2-small", "--gpus", "8", "--global-batch", "64", "--hardware", "a100"]
CASES = [
    # (argv, a word the one line must contain); {root} is the fixture folder
    (["show", "-D", "5"], "even"),                                   # impossible layout
    (["show", "-D", "0"], "positive"),
    (["show", "-N", "abc"], "abc"),
    (["show", "--schedule", "nope"], "nope"),
    (["simulate", "--cost", "1:0"], "cost"),
    (["simulate", "-s", "interleaved", "-D", "4", "-N", "6"], "interleaved"),
    (["simulate", "--p2p", "-1"], "p2p"),
    (["simulate", "-s", "gpipe", "--pipes", "2"], "pipes"),
    (["train", "--model", "gpt3"], "gpt3"),
    (["train", "--stages", "20"], "stages"),                         # more stages than layers
    (["train", "--stages", "3"], "even"),
    (["train", "--schedule", "pipedream-2bw"], "simulation only"),
    (["train", "--lr", "nan"], "--lr"),
    (["train", "--lr", "-1"], "--lr"),
    (["train", "--steps", "0"], "positive"),
    (["train", "--data-parallel", "two"], "two"),
    (["train", "--comm-timeout", "0"], "--comm-timeout"),
    (["train", "--data", "/no/such/file"], "/no/such/file"),
    (["train", "--data", "{root}/empty.txt"], "empty"),
    (["train", "--data", "{root}/binary"], "empty"),                 # nothing readable as text
    (["train", "--resume"], "--checkpoint-dir"),
    (["train", "--checkpoint-every", "-2", "--checkpoint-dir", "{root}/x"], "-2"),
    (["train", "--keep-checkpoints", "0", "--checkpoint-dir", "{root}/x"], "positive"),
    (["train", "--checkpoint-dir", "{root}/not-a-dir"], "not a directory"),
    (["train", "--resume", "--checkpoint-dir", "{root}/corrupt"], "corrupt"),
    (["train", "--resume", "--checkpoint-dir", "{root}/bert-tiny"], "bert-tiny"),  # another model
    ([*PLAN[:2], "nope", *PLAN[3:]], "nope"),
    ([*PLAN[:4], "0", *PLAN[5:]], "positive"),
    ([*PLAN[:6], "abc", *PLAN[7:]], "abc"),
    ([*PLAN[:8], "nope"], "nope"),
    ([*PLAN, "--profile", "/no/such.json"], "/no/such.json"),
    ([*PLAN, "--profile", "{root}/profile.json"], "profile"),
    # issue 13, case 2: a directory holding another run's checkpoints
    (["train", "--checkpoint-dir", "{root}/gpt2-tiny"], "--resume"),
    # case 3: sizes beyond a stated limit, special files
    (["show", "-D", "1000000"], "limit of 1024"),
    (["show", "-D", "512", "-N", "512"], "limit of 65,536"),
    (["train", "-N", "10000000"], "limit of 16384"),
    (["train", "-B", "100000000"], "limit of 65536"),
    (["train", "--data", "/dev/urandom"], "character device"),
    (["train", "--data", "{root}/fifo"], "FIFO"),
    # case 4: tracebacks before
    (["train", "--partition", "abc"], "abc"),
    (["train", "--partition", "0-3"], "--partition"),
    (["train", "--data", "{root}/short.txt"], "training split"),
    (["train", "--comm-timeout", "1e300"], "604800"),
    (["train", "--comm-timeout", "1e-9"], "--comm-timeout"),
    (["train", "--resume", "--checkpoint-dir", "{root}/tampered"], "malformed"),
    (["simulate", "--profile", "{root}/beta0.json"], "beta_bytes_per_s > 0"),
    (["simulate", "--profile", "{root}/null.json"], "param_bytes"),
    (["simulate", "--profile", "{root}/inf.json"], "Infinity"),
    (["simulate", "--profile", "{root}/split-half.json"], "every layer has input_backward_s"),
    # one parser: plan refuses a profile with the line simulate gives
    ([*PLAN, "--profile", "{root}/beta0.json"], "beta_bytes_per_s > 0"),
    ([*PLAN, "--profile", "{root}/inf.json"], "Infinity"),
    (["simulate", "--from-trace", "{root}/step-str.json"], "step_s"),
    (["simulate", "--from-trace", "{root}/trace-inf.json"], "Infinity"),
    # case 5: output paths checked before the work; no rows, no overwrite
    (["train", "--trace", "{root}/binary"], "is a directory"),
    (["train", "--png", "{root}/not-a-dir/t.png"], "not a folder"),
    (["train", "--log-json", "{root}/binary"], "is a directory"),
    (["bench", "--rows", ","], "no rows"),
    (["bench", "--out", "{root}/not-a-dir"], "not a directory"),
    (["profile", "--out", "{root}/not-a-dir/p.json"], "not a folder"),
    # issue 15: evaluation and sampling
    (["train", "--eval-every", "-1"], "-1"),
    (["train", "--eval-every", "5", "--eval-batches", "0"], "positive"),
    (["train", "--data", "{root}/short-val.txt", "--eval-every", "5"], "held-out split"),
    (["generate", "--checkpoint", "{root}/nope", "--prompt", "x"], "no such directory"),
    (["generate", "--checkpoint", "{root}/binary", "--prompt", "x"], "no checkpoint"),
    (["generate", "--checkpoint", "{root}/corrupt", "--prompt", "x"], "corrupt"),
    (["generate", "--checkpoint", "{root}/tampered", "--prompt", "x"], "malformed"),
    (["generate", "--checkpoint", "{root}/bert-tiny", "--prompt", "x"], "BERT"),
    (["generate", "--checkpoint", "{root}/gpt2-tiny", "--prompt", ""], "empty"),
    (["generate", "--checkpoint", "{root}/gpt2-tiny", "--prompt", "x", "--temperature", "-1"],
     "--temperature"),
    (["generate", "--checkpoint", "{root}/gpt2-tiny", "--prompt", "x", "--tokenizer",
      "{root}/text.txt"], "not a tokenizers file"),
]
if not __import__("torch").cuda.is_available():
    CASES.append((["train", "--device", "cuda"], "--device cuda"))


@pytest.fixture
def no_launch(monkeypatch):
    import chimera.train.launch

    import chimera.bench.harness
    import chimera.bench.profiler

    def trap(*args, **kwargs):
        raise AssertionError("bad input reached the launcher")
    monkeypatch.setattr(chimera.train.launch, "launch", trap)
    monkeypatch.setattr(chimera.bench.harness, "measure", trap)
    monkeypatch.setattr(chimera.bench.profiler, "build_profile", trap)


@pytest.mark.parametrize("argv, word", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_cli_refuses_with_exit_2_and_one_line(argv, word, files, no_launch, capsys):
    argv = [a.replace("{root}", str(files)) for a in argv]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"chimera {argv[0]}"), err
    assert word.replace("{root}", str(files)) in lines[0], err


API_CASES = [
    dict(lr=math.nan), dict(lr=0.0), dict(stages=20), dict(stages=3), dict(model="gpt3"),
    dict(micro_batch_size=0), dict(comm_timeout=-1.0), dict(resume=True), dict(checkpoint_every=-1),
    dict(data="/no/such/file"), dict(schedule="nope"), dict(steps=1.5),
    dict(micro_batches=10**6), dict(data="/dev/urandom"), dict(comm_timeout=1e300),
    dict(partition="abc"), dict(micro_batch_size=10**8),
]


@pytest.mark.parametrize("kwargs", API_CASES, ids=[str(k) for k in API_CASES])
def test_api_raises_a_value_error_subclass(kwargs):
    with pytest.raises(ValueError) as exc:
        TrainConfig(**kwargs)
    assert isinstance(exc.value, (ConfigError, ScheduleError))
    assert "\n" not in str(exc.value).strip() or isinstance(exc.value, ScheduleError)


def test_api_refuses_another_models_checkpoint(files):
    with pytest.raises(ConfigError, match="bert-tiny"):
        TrainConfig(resume=True, checkpoint_dir=str(files / "bert-tiny"))
    with pytest.raises(ConfigError, match="corrupt"):
        TrainConfig(resume=True, checkpoint_dir=str(files / "corrupt"))


def test_api_pipeline_refuses_a_million_micro_batches(tmp_path):
    """The size is checked before anything is built (a world of one: 1F1B on one stage)."""
    import torch
    import torch.distributed as dist

    from chimera.api import Pipeline

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        with pytest.raises(ScheduleError, match="limit of 16384"):
            Pipeline([torch.nn.Linear(2, 2)], torch.nn.functional.mse_loss, schedule="1f1b",
                     stages=1, micro_batches=10**6)
    finally:
        dist.destroy_process_group()


def test_bench_with_every_row_failed_writes_nothing(tmp_path, monkeypatch, capsys):
    """The results folder keeps its files when a bench measured nothing (issue 13, case 5)."""
    import chimera.bench.harness
    from chimera.bench.rows import BenchConfig, select_rows

    rows = select_rows(BenchConfig(rows=("single",)))
    monkeypatch.setattr(chimera.bench.harness, "measure",
                        lambda cfg, rows: {"failed": {r.id: "boom" for r in rows}})
    (tmp_path / "bench.json").write_text("earlier results")
    assert main(["bench", "--rows", "single", "--out", str(tmp_path)]) == 1
    assert (tmp_path / "bench.json").read_text() == "earlier results"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json"]
    assert "every row failed" in capsys.readouterr().err and rows
