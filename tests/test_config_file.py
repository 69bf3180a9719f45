"""`--config FILE` (issue 38): only a regular UTF-8 file of at most 1 MiB is read; a message
about one of its values names the file, the line and the table's key (not a flag the user
never typed); a key outside its table says which table it belongs under; flags override the
file's values before they are checked."""

import os

import pytest

from chimera.cli import main
from chimera.cli.train_cmd import parse
from chimera.train import config_file
from chimera.train.config import TrainConfig
from chimera.train.sections import ConfigError


def refused(capsys, *argv) -> str:
    """`chimera train ARGV`'s one-line refusal (exit 2, before any process starts)."""
    with pytest.raises(SystemExit) as exit_:
        main(["train", *argv])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("chimera train: ") and "Traceback" not in err, err
    return err.strip()


def write(path, text) -> str:
    path.write_bytes(text.encode() if isinstance(text, str) else text)
    return str(path)


@pytest.mark.parametrize("make, kind", [
    (lambda p: os.mkfifo(p), "a FIFO"),
    (lambda p: os.mkdir(p), "a directory"),
])
def test_only_a_regular_file_is_read(tmp_path, capsys, make, kind):
    path = tmp_path / "run.toml"
    make(path)  # a FIFO's open would block forever: it is refused before it is opened
    assert f"--config {path}: is {kind}, not a file" in refused(capsys, "--config", str(path))


def test_an_empty_path_is_refused_not_ignored(capsys):
    assert "--config: an empty path" in refused(capsys, "--config", "")
    assert "--config: an empty path" in refused(capsys, "--config=")


def test_a_device_is_refused_not_read_without_bound(capsys):
    assert "is a character device, not a file" in refused(capsys, "--config", "/dev/urandom")
    assert "is a character device" in refused(capsys, "--config=/dev/zero")


def test_a_file_over_the_size_limit_is_refused_by_its_limit(tmp_path, capsys):
    big = write(tmp_path / "big.toml", "# padding\n" * (config_file.MAX_BYTES // 10 + 1))
    assert "larger than 1 MiB" in refused(capsys, "--config", big)
    just = write(tmp_path / "just.toml", b"#" * (config_file.MAX_BYTES - 1) + b"\n")
    assert parse(["--config", just])[0] == TrainConfig()  # the limit itself is accepted


def test_a_file_that_is_not_utf8_is_one_line_naming_its_line(tmp_path, capsys):
    bad = write(tmp_path / "latin1.toml", "[optim]\n# d\xe9j\xe0 vu\nsteps = 3\n".encode("latin-1"))
    err = refused(capsys, "--config", bad)
    assert f"{bad}:2: not UTF-8 text (byte 0xe9)" in err
    utf16 = write(tmp_path / "utf16.toml", "[optim]\nsteps = 3\n".encode("utf-16"))
    assert f"{utf16}:1: not UTF-8" in refused(capsys, "--config", utf16)


def test_a_byte_order_mark_and_an_empty_file_are_read(tmp_path):
    bom = write(tmp_path / "bom.toml", "\ufeff[optim]\nsteps = 3\n".encode("utf-8"))
    assert TrainConfig.from_toml(bom) == TrainConfig(steps=3) == parse(["--config", bom])[0]
    empty = write(tmp_path / "empty.toml", "")
    assert parse(["--config", empty])[0] == TrainConfig()


def test_a_bad_value_names_the_file_line_table_and_key(tmp_path, capsys):
    path = write(tmp_path / "config.toml", "# a run\n[pipeline]\nstages = 2\n\n[optim]\n"
                                           "lr = 1e-3\nsteps = -1\n")
    err = refused(capsys, "--config", path)
    assert f"{path}:7: [optim] steps must be a positive integer, got -1" in err
    assert "--steps" not in err
    with pytest.raises(ConfigError, match=r"config.toml:7: \[optim\] steps must be"):
        TrainConfig.from_toml(path)
    # a value of the wrong type, a choice, a scheme option, a check across two keys
    for text, line, words in [
        ('[net]\ndtype = "fp8"\n', 2, "[net] dtype must be one of float32"),
        ('[optim]\n\nlr = "fast"\n', 3, "[optim] lr must be a finite number > 0, got 'fast'"),
        ('[run]\ncomm_timeout = 0.5\n', 2, "[run] comm_timeout must be between 1 and"),
        ('[pipeline]\nschedule = "chimera"\nmicro_batch_size = 3\n[pipeline.options]\n'
         'strategy = "halving"\n', 3, "[pipeline] micro_batch_size must be even"),
        ('[ckpt]\nresume = true\ncheckpoint_every = 2\n', 2,
         "[ckpt] resume and [ckpt] checkpoint_every (line 3) need --checkpoint-dir"),
    ]:
        path = write(tmp_path / "v.toml", text)
        err = refused(capsys, "--config", path)
        assert f"{path}:{line}: " in err and words in err, (text, err)


def test_a_flag_overrides_a_bad_file_value_before_it_is_checked(tmp_path, capsys):
    path = write(tmp_path / "run.toml", "[optim]\nsteps = -1\nlr = 0.01\n[net]\ndtype = 'fp8'\n")
    cfg, extra = parse(["--config", path, "--steps", "5", "--dtype", "float64"])
    assert (cfg.optim.steps, cfg.optim.lr, cfg.net.dtype) == (5, 0.01, "float64")
    assert extra["config"].kept == {"lr"}  # what the file still decides
    # a bad flag is still the flag's, beside a file
    err = refused(capsys, "--config", path, "--steps", "0", "--dtype", "float64")
    assert "--steps must be a positive integer, got 0" in err and str(path) not in err
    # the file's other bad value is still the file's
    err = refused(capsys, "--config", path, "--steps", "5")
    assert f"{path}:5: [net] dtype must be one of" in err


def test_a_key_outside_its_table_says_where_it_belongs(tmp_path, capsys):
    cases = [
        ('pipeline = "chimera"\n', 1, 'pipeline = "chimera" is a key at the top level, but '
         'pipeline is a table: write [pipeline] and its keys under it (schedule = "chimera")'),
        ('[optim]\nlr = 1e-3\n[run]\nsteps = 4\n', 4,
         "[run] has no field steps; steps belongs under [optim]"),
        ('# top\nsteps = 4\n', 2, "steps = 4 is at the top level, outside any table: steps is a "
         "key of [optim]: put it under [optim]"),
        ('[pipeline]\npipes = 4\n', 2, "[pipeline] has no field pipes; pipes is a scheme option: put it under [pipeline.options]"),
        ('[pipeline]\nstagse = 4\n', 2, "[pipeline] has no field stagse; did you mean stages?"),
        ('[pipeline.options]\nflavor = 1\n', 2, "[pipeline.options] has no scheme option flavor"),
        ('[model]\nname = "x"\n', 1, "unknown table [model]; the tables are net, corpus"),
    ]
    for text, line, words in cases:
        path = write(tmp_path / "t.toml", text)
        err = refused(capsys, "--config", path)
        assert f"{path}:{line}: {words}" in err, (text, err)
        assert "unknown table [pipeline]" not in err


def test_not_toml_is_one_line_with_its_line(tmp_path, capsys):
    path = write(tmp_path / "bad.toml", "[optim]\nsteps = = 3\n")
    err = refused(capsys, "--config", path)
    assert "not TOML" in err and "line 2" in err


def test_a_preflight_message_about_a_file_value_names_the_file(tmp_path, capsys):
    path = write(tmp_path / "run.toml", f"[corpus]\ndata = '{tmp_path / 'missing.txt'}'\n")
    err = refused(capsys, "--config", path)
    assert f"{path}:2: [corpus] data {tmp_path / 'missing.txt'}: no such file" in err


def test_key_lines_follow_tables_dotted_keys_and_multiline_strings():
    text = ('a = 1\n[pipeline]\nstages = 2\nfault = """\nsteps = 9\n"""\n'
            'options.pipes = 2\n[ "optim" ]\nsteps = 3 # a comment\n')
    lines = config_file._key_lines(text)
    assert lines[("a",)] == 1 and lines[("pipeline",)] == 2 and lines[("pipeline", "stages")] == 3
    assert lines[("pipeline", "options", "pipes")] == 7 and lines[("optim", "steps")] == 9
    assert ("pipeline", "steps") not in lines  # inside a multi-line string


@pytest.mark.parametrize("text, words", [
    ("[run]\ntrace = 5\n", "[run] trace must be text, got 5"),
    ("[net]\npartition = 5\n", "[net] partition must be text, got 5"),
    ("[run]\nfault = 5\n", "[run] fault must be text, got 5"),
    ("[ckpt]\nresume_allow = 5\n", "[ckpt] resume_allow must be a list of text, got 5"),
    ("[pipeline]\nrecompute = 2\n", "[pipeline] recompute must be true or false, got 2"),
    ("[run]\nprogress = 'no'\n", "[run] progress must be true or false, got 'no'"),
    ("[pipeline.options]\npipes = 'x'\n", "option [pipeline.options] pipes must be a positive integer"),
], ids=["str", "partition", "fault", "list", "bool", "switch", "option"])
def test_a_value_of_the_wrong_type_is_one_line_naming_its_line(tmp_path, capsys, text, words):
    path = write(tmp_path / "w.toml", text)  # a traceback from deep inside the run, before
    assert f"{path}:2: {words}" in refused(capsys, "--config", path)


def test_a_switch_flag_overrides_a_file_value_that_is_no_switch(tmp_path):
    path = write(tmp_path / "w.toml", "[run]\nprogress = 'no'\n[pipeline]\nrecompute = 'yes'\n")
    cfg, _ = parse(["--config", path, "--no-progress", "--recompute"])
    assert cfg.run.progress is False and cfg.pipeline.recompute is True


def test_a_path_from_python_is_taken_as_its_text(tmp_path):
    assert TrainConfig(log_json=tmp_path / "log.jsonl").run.log_json == str(tmp_path / "log.jsonl")
    with pytest.raises(ConfigError, match="--log-json must be text, got 5"):
        TrainConfig(log_json=5)
