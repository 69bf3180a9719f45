"""Bad input is refused before any process starts: exit code 2 and one line on stderr from
the CLI, a UserError (a ValueError: ConfigError, ScheduleError, ...) from the Python API. Any
other exception is a bug: the CLI shows its traceback.

The CLI runs in this process (``chimera.cli.main``) with the launcher replaced by a trap,
so a case that got as far as starting processes fails loudly instead of training.
"""

import argparse
import json
import math
import os
import shutil
import subprocess
import sys

import pytest

from chimera.cli import main
from chimera.ir import ScheduleError
from chimera.train import ConfigError, TrainConfig, build
from limits import limit

PROFILE = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results", "profile-gpt2-bench.json")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Data and checkpoints to be refused: empty, binary-only, corrupt, another model's."""
    from chimera.train import checkpoint
    from chimera.train.loop import Trainer

    root = tmp_path_factory.mktemp("bad")
    (root / "empty.txt").write_text("")
    (root / "binary").mkdir()
    (root / "binary" / "blob.dat").write_bytes(b"\0\1\2" * 1000)
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
    _checkpoint_files(root)
    (root / "short.txt").write_bytes(b"x" * 32)  # one sequence, but not after the held-out 5%
    (root / "short-val.txt").write_bytes(b"x" * 300)  # trains; 15 held-out bytes: no sequence
    os.mkfifo(root / "fifo")
    _measured_files(root)
    _data_files(root)
    return root


def _checkpoint_files(root):
    """Issue 26: an empty files table (it switched the integrity check off), a lock that is a
    folder, a directory whose every checkpoint is in doubt."""
    shutil.copytree(root / "gpt2-tiny", root / "nofiles")
    meta = root / "nofiles" / "step-00000001" / "meta.json"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "files": {}}))
    (root / "lockdir" / ".lock").mkdir(parents=True)
    shutil.copytree(root / "gpt2-tiny", root / "doubt")
    meta = root / "doubt" / "step-00000001" / "meta.json"
    meta.write_text(json.dumps({**json.loads(meta.read_text()),
                                "health": {"status": "in doubt", "reason": "step 1: the loss is nan"}}))


def _broken_inputs(root):
    """Issue 26: a token folder claiming 10^12 ids, a truncated datasets file, HF folders with
    damaged or mis-shaped weights, a profile whose times overflow any sum."""
    import datasets
    import transformers

    shutil.copytree(root / "tok", root / "hugevocab")
    meta = root / "hugevocab" / "meta.json"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "vocab_size": 10**12}))
    datasets.Dataset.from_dict({"text": ["some text " * 50] * 20}).save_to_disk(str(root / "cut-ds"))
    arrow = next((root / "cut-ds").glob("*.arrow"))
    arrow.write_bytes(arrow.read_bytes()[: arrow.stat().st_size // 2])
    cfg = transformers.GPT2Config(vocab_size=256, n_embd=16, n_layer=2, n_head=4, n_positions=32)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(str(root / "hf-cut"))
    shutil.copytree(root / "hf-cut", root / "hf-shape")
    shutil.copytree(root / "hf-cut", root / "hf-none", ignore=shutil.ignore_patterns("*.safetensors"))
    weights = root / "hf-cut" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    config = root / "hf-shape" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "n_inner": 48}))
    profile = json.loads(open(PROFILE).read())
    for layer in profile["layers"]:
        layer["forward_s"] = 1e308  # each finite; their sum is not
    (root / "overflow.json").write_text(json.dumps(profile))


def _data_files(root):
    """Data in formats that must be refused, never read as bytes (issue 15)."""
    import pickle
    import zipfile

    import datasets
    import numpy as np

    from chimera.data.bpe import tokenize
    from chimera.data.formats import DataSpec

    text = (root / "text.txt").read_text()
    tokenize(DataSpec(str(root / "text.txt")), root / "tok", 300)
    datasets.Dataset.from_dict({"body": ["a", "b"]}).save_to_disk(str(root / "ds"))
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a"]})}).save_to_disk(
        str(root / "dsdict"))
    np.save(root / "floats.npy", np.random.default_rng(0).random(5000))
    np.save(root / "objects.npy", np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
    np.save(root / "rows.npy", np.zeros((100, 64), dtype=np.int64))
    np.save(root / "negative.npy", np.arange(-1, 4999, dtype=np.int64))
    np.savez(root / "ids.npz", ids=np.arange(5000))
    (root / "odd.bin").write_bytes(b"\1\0" * 2000 + b"\7")      # not a multiple of 2
    np.arange(5000, dtype="<u2").tofile(root / "ids.bin")           # ids up to 4999
    (root / "data.pkl").write_bytes(pickle.dumps(list(range(5000))))
    (root / "pickle.txt").write_bytes(pickle.dumps(list(range(5000))))  # a pickle, misnamed
    with zipfile.ZipFile(root / "text.zip", "w") as z:
        z.writestr("a.txt", text)
    (root / "binary.txt").write_bytes(text.encode()[:9000] + b"\0\1\2" + text.encode()[9000:])
    (root / "latin1.txt").write_bytes(text.encode() + "caf\u00e9".encode("latin-1"))
    (root / "records.json").write_text(json.dumps([{"text": text}]))
    (root / "bad.jsonl").write_text(json.dumps({"text": "ok"}) + "\n{not json\n")
    (root / "nofield.jsonl").write_text(json.dumps({"body": text}) + "\n")
    (root / "mixed").mkdir()
    (root / "mixed" / "notes.txt").write_text(text)
    np.save(root / "mixed" / "ids.npy", np.arange(5000))
    (root / "not-a-tokenizer.json").write_text(json.dumps({"hello": 1}))
    _broken_inputs(root)


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
    # issue 15: anything unrecognized or binary is refused, never read as bytes
    (["train", "--data", "{root}/ds/state.json"], "datasets folder"),       # its metadata
    (["train", "--data", "{root}/ds/dataset_info.json"], "datasets folder"),
    (["train", "--data", "{root}/ds"], "no 'text' column"),
    (["train", "--data", "{root}/dsdict"], "DatasetDict"),
    (["train", "--data", "{root}/records.json"], "JSON file"),
    (["train", "--data", "{root}/tok/tokenizer.json"], "--tokenizer"),
    (["train", "--data", "{root}/floats.npy"], "float64"),
    (["train", "--data", "{root}/objects.npy", "--vocab-size", "100"], "pickle"),
    (["train", "--data", "{root}/rows.npy", "--vocab-size", "100"], "1-D"),
    (["train", "--data", "{root}/negative.npy", "--vocab-size", "5000"], "token id -1"),
    (["train", "--data", "{root}/ids.npz"], "npz"),
    (["train", "--data", "{root}/odd.bin", "--token-dtype", "uint16", "--vocab-size", "9"],
     "not a multiple of 2"),
    (["train", "--data", "{root}/ids.bin", "--vocab-size", "5000"], "--token-dtype"),
    (["train", "--data", "{root}/ids.bin", "--token-dtype", "uint16"], "--vocab-size"),
    (["train", "--data", "{root}/ids.bin", "--token-dtype", "uint16", "--vocab-size", "4000"],
     "token id 4000"),
    (["train", "--data", "{root}/tok", "--token-dtype", "uint32"], "contradicts"),
    (["train", "--data", "{root}/tok", "--vocab-size", "200"], "smaller"),
    (["train", "--data", "{root}/data.pkl"], "pickle"),
    (["train", "--data", "{root}/pickle.txt"], "pickle"),
    (["train", "--data", "{root}/text.zip"], "zip"),
    (["train", "--data", "{root}/binary.txt"], "binary"),
    (["train", "--data", "{root}/mixed"], "ids.npy"),
    (["train", "--data", "{root}/bad.jsonl"], "line 2"),
    (["train", "--data", "{root}/nofield.jsonl"], "--text-field"),
    (["train", "--data", "{root}/latin1.txt", "--tokenizer", "{root}/tok/tokenizer.json"], "UTF-8"),
    (["train", "--data", "{root}/text.txt", "--token-dtype", "uint16"], "--token-dtype"),
    (["train", "--data", "{root}/text.txt", "--vocab-size", "512"], "bytes"),
    (["train", "--data", "{root}/text.txt", "--text-field", "body"], "--text-field"),
    (["train", "--tokenizer", "{root}/not-a-tokenizer.json"], "not a tokenizers JSON"),
    (["train", "--tokenizer", "{root}/missing.json"], "no such file"),
    (["train", "--data", "{root}/ds/data-00000-of-00001.arrow"], "Arrow"),
    (["tokenize", "--out", "{root}/t"], "--vocab-size"),
    (["tokenize", "--data", "{root}/negative.npy", "--vocab-size", "300", "--out", "{root}/t"], "text"),
    (["tokenize", "--vocab-size", "100", "--out", "{root}/t"], "more than 256"),
    (["tokenize", "--vocab-size", "300", "--out", "{root}/tok"], "not an empty folder"),
    (["tokenize", "--data", "{root}/binary.txt", "--vocab-size", "300", "--out", "{root}/t"], "binary"),
    # issue 26: tracebacks, or checks that came only after the ranks started
    (["train", "--warmup", "-5"], "--warmup"),
    (["train", "--skip-limit", "0"], "positive"),
    (["train", "--spike-factor", "1"], "--spike-factor"),
    (["train", "--resume", "--checkpoint-dir", "{root}/nofiles"], "does not list the index"),
    (["train", "--checkpoint-dir", "{root}/lockdir"], "lock file"),
    (["train", "--resume", "--checkpoint-dir", "{root}/doubt"], "is in doubt"),
    (["train", "--data", "{root}/hugevocab"], "vocab_size 1,000,000,000,000"),
    (["train", "--data", "{root}/cut-ds"], "not a whole arrow stream"),
    (["train", "--model", "hf:{root}/hf-cut"], "not a readable safetensors file"),
    (["train", "--model", "hf:{root}/hf-shape"], "the config makes (16, 48)"),
    (["show", "--png", "/proc/chimera.png"], "cannot write in /proc"),
    (["show", "--trace", "{root}/binary"], "is a directory"),
    (["simulate", "--profile", "{root}/overflow.json"], "above the limit"),
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
        TrainConfig(**kwargs).preflight()
    assert isinstance(exc.value, (ConfigError, ScheduleError))
    assert "\n" not in str(exc.value).strip() or isinstance(exc.value, ScheduleError)


def test_api_refuses_data_formats(files):
    """TrainConfig refuses what its layout and metadata show; open_data what the ids show."""
    from chimera.data.formats import DataSpec, open_data

    for kwargs, word in ((dict(data=str(files / "floats.npy"), vocab_size=10), "float64"),
                         (dict(data=str(files / "ds" / "state.json")), "datasets folder"),
                         (dict(data=str(files / "ids.bin"), token_dtype="uint16"), "--vocab-size"),
                         (dict(data=str(files / "text.txt"), token_dtype="int8"), "--token-dtype")):
        with pytest.raises(ConfigError, match=word):
            TrainConfig(**kwargs).preflight()
    with pytest.raises(ValueError, match="token id 4000"):
        open_data(DataSpec(str(files / "ids.bin"), token_dtype="uint16", vocab_size=4000))
    cfg = TrainConfig(data=str(files / "tok"), model="bert-tiny", schedule="none", stages=1).preflight()
    assert build.model_config(cfg).vocab_size == 301  # the tokenizer's 300 ids and BERT's mask


def test_api_refuses_another_models_checkpoint(files):
    with pytest.raises(ConfigError, match="bert-tiny"):
        TrainConfig(resume=True, checkpoint_dir=str(files / "bert-tiny")).preflight()
    with pytest.raises(ConfigError, match="corrupt"):
        TrainConfig(resume=True, checkpoint_dir=str(files / "corrupt")).preflight()


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


@pytest.mark.parametrize("bug", [ValueError("an internal invariant"), KeyError("internal")])
def test_a_library_bug_is_not_reported_as_bad_input(bug, monkeypatch, capsys):
    """Only a UserError is bad input: any other exception inside a command (here one the
    simulator raises) propagates with its traceback instead of a one-line exit 2."""
    import chimera.cli.schedule_cmds

    def broken(*args, **kwargs):
        raise bug

    monkeypatch.setattr(chimera.cli.schedule_cmds, "simulate", broken)
    with pytest.raises(type(bug)):
        main(["simulate", "-s", "1f1b", "-D", "2"])
    assert capsys.readouterr().err == ""


@pytest.mark.slow
def test_a_library_bug_shows_its_traceback_and_exits_1(cli_env):
    """The same as a command: Python prints the traceback and exits with code 1."""
    code = ("import sys\n"
            "import chimera.cli.schedule_cmds as cmds\n"
            "def broken(*args, **kwargs):\n"
            "    raise ValueError('an internal invariant')\n"
            "cmds.simulate = broken\n"
            "from chimera.cli import main\n"
            "raise SystemExit(main(sys.argv[1:]))\n")
    r = subprocess.run([sys.executable, "-c", code, "simulate", "-s", "1f1b", "-D", "2"],
                       capture_output=True, text=True, timeout=limit(120), env=cli_env)
    assert r.returncode == 1
    assert "Traceback (most recent call last)" in r.stderr
    assert r.stderr.strip().splitlines()[-1] == "ValueError: an internal invariant"


def test_every_user_facing_error_type_is_a_user_error():
    """The one base the CLI catches: each package error for bad input derives from it."""
    from chimera.cli.common import UsageError
    from chimera.errors import UserError
    from chimera.plan.hardware import PlanError
    from chimera.runtime.boundary import BoundaryMismatch
    from chimera.sim.profile import ProfileError
    from chimera.train.checkpoint import CheckpointError
    from chimera.check.validate import ValidationError

    for error in (UsageError, ScheduleError, ValidationError, ConfigError, CheckpointError,
                  PlanError, ProfileError, BoundaryMismatch):
        assert issubclass(error, UserError) and issubclass(error, ValueError), error


def test_a_config_checks_values_and_preflight_reads_files(files, monkeypatch):
    """Making a TrainConfig reads no file and builds no schedule; preflight() does both, once."""
    import chimera.train.build

    cases = [(dict(data="/no/such/file"), "no such file"),
             (dict(resume=True, checkpoint_dir=str(files / "corrupt")), "corrupt"),
             (dict(stages=3), "stages")]
    built = []
    monkeypatch.setattr(chimera.train.build, "build_scheme",
                        lambda *a, **k: built.append(a) or pytest.fail("built"))
    for kwargs, _ in cases:
        TrainConfig(**kwargs)  # values only: fine
    assert not built
    monkeypatch.undo()
    for kwargs, word in cases:
        with pytest.raises(ConfigError, match=word):
            TrainConfig(**kwargs).preflight()
    cfg = TrainConfig(schedule="1f1b")
    assert cfg.preflight() is cfg and "schedule" in vars(cfg)["_built"]  # kept beside it
    with pytest.raises(ConfigError, match="--micro-batch-size"):  # a value: refused when made
        TrainConfig(strategy="halving", micro_batch_size=3)


def test_hf_folder_without_weights_says_it_starts_from_scratch(files, capsys):
    """Issue 26: such a folder trained from HF's initialization without a word (a forgotten
    weights file passed for a fine-tune); a folder with weights says nothing."""
    from chimera.cli.train_cmd import _note_init

    _note_init(TrainConfig(model=f"hf:{files / 'hf-none'}").preflight())
    err = capsys.readouterr().err
    assert "holds no weights" in err and "Hugging Face's initialization" in err
    _note_init(TrainConfig(model="gpt2-tiny"))
    assert capsys.readouterr().err == ""
