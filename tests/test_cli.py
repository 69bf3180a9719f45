"""CLI smoke tests: the commands run end to end; bad input exits 2 with one line."""

import json

import pytest


def test_schedules_lists_every_scheme(run_cli):
    out = run_cli("schedules").stdout
    for name in ("chimera", "1f1b", "gpipe", "interleaved", "zb-h1", "gems"):
        assert name in out


def test_show_draws_the_paper_figure(run_cli):
    r = run_cli("show", "--schedule", "chimera", "--stages", "4", "--micro-batches", "4")
    assert r.returncode == 0
    lines = r.stdout.splitlines()
    assert "bubble ratio 20.0%" in lines[0]
    rows = [l for l in lines if l.startswith("P")]
    assert rows[0].split("|")[1].split() == "F0 F1 . f2 b2 f3 b3 B0 . B1".split()
    assert rows[3].split("|")[1].split() == "f2 f3 . F0 B0 F1 B1 b2 . b3".split()


def test_simulate_json_is_one_object(run_cli):
    r = run_cli("simulate", "-s", "1f1b", "-D", "4", "-N", "8", "--json")
    data = json.loads(r.stdout)
    assert data["schedule"] == "1f1b" and data["stages"] == 4 and data["micro_batches"] == 8
    assert data["bubble_ratio"] == pytest.approx(3 / 11)
    assert [x["peak_activations"] for x in data["ranks"]] == [4, 3, 2, 1]


def test_show_writes_png_and_trace(tmp_path, run_cli):
    png, trace = tmp_path / "s.png", tmp_path / "s.json"
    r = run_cli("show", "-D", "4", "-N", "8", "--png", str(png), "--trace", str(trace))
    assert r.returncode == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(trace.read_text())["traceEvents"]


@pytest.mark.parametrize("args", [
    ["show", "-D", "5"],
    ["show", "-D", "0"],
    ["show", "-D", "x"],
    ["show", "--schedule", "nope"],
    ["simulate", "--cost", "1:0"],
    ["simulate", "--cost", "abc"],
    ["simulate", "-s", "gpipe", "--pipes", "2"],
    ["simulate", "-s", "interleaved", "-D", "4", "-N", "6"],
    ["simulate", "--p2p", "-1"],
    ["train", "--model", "gpt3"],
    ["train", "--stages", "3"],
    ["train", "--stages", "20"],
    ["train", "--lr", "nan"],
    ["train", "--lr", "0"],
    ["train", "--data", "/no/such/file"],
    ["train", "--strategy", "halving", "--micro-batch-size", "3"],
    ["train", "--schedule", "none", "--stages", "2"],
    ["train", "--micro-batches", "-1"],
])
def test_bad_input_exits_2_with_one_line(args, run_cli):
    r = run_cli(*args)
    assert r.returncode == 2, (args, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) >= 1
    assert r.stderr.strip().splitlines()[0].startswith("chimera")


def test_empty_data_file_is_refused(tmp_path, run_cli):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    r = run_cli("train", "--data", str(empty))
    assert r.returncode == 2 and "Traceback" not in r.stderr


@pytest.mark.slow
def test_train_default_job_end_to_end(tmp_path, run_cli):
    log = tmp_path / "log.jsonl"
    r = run_cli("train", "--steps", "3", "--no-progress", "--log-json", str(log),
            "--png", str(tmp_path / "t.png"), "--trace", str(tmp_path / "t.json"))
    assert r.returncode == 0, r.stderr
    assert "measured bubble ratio" in r.stdout and "optimizer step's tail and p2p waits" in r.stdout
    lines = [json.loads(l) for l in log.read_text().splitlines()]
    assert [l["step"] for l in lines] == [0, 1, 2]
    assert all(l["loss"] > 0 for l in lines)
    assert (tmp_path / "t.png").stat().st_size > 5000
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert any(e.get("name") == "p0s0F0" for e in events)
