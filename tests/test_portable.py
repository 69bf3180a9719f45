"""A run folder moved to another directory resumes, generates and exports: the checkpoint keeps
its tokenizer inside, its config.toml's paths are written for a move (chimera.train.portable),
and an export that cannot write its tokenizer fails."""

import json
import shutil

import pytest

from chimera.cli import main
from chimera.train import TrainConfig

pytest.importorskip("tokenizers")

TRAIN = ["train", "--schedule", "none", "--stages", "1", "-B", "2", "--seq-len", "16",
         "--no-progress", "--checkpoint-every", "1", "--trace", "", "--png", ""]


@pytest.fixture
def moved(tmp_path, monkeypatch):
    """A run trained in start/ on data and a tokenizer outside it, its folder then moved to
    elsewhere/moved; the current folder is a third one."""
    from chimera.data.bpe import tokenize
    from chimera.data.formats import DataSpec

    (tmp_path / "data").mkdir()
    with open(tmp_path / "data" / "docs.jsonl", "w") as f:
        for i in range(40):
            f.write(json.dumps({"text": f"document {i} " + "words and more words " * 8}) + "\n")
    tokenize(DataSpec(str(tmp_path / "data" / "docs.jsonl")), tmp_path / "tok", 300)
    (tmp_path / "start").mkdir()
    monkeypatch.chdir(tmp_path / "start")
    assert main([*TRAIN, "--steps", "2", "--data", "../data/docs.jsonl", "--tokenizer",
                 "../tok/tokenizer.json", "--checkpoint-dir", "ckpt"]) == 0
    (tmp_path / "elsewhere").mkdir()
    shutil.move(tmp_path / "start" / "ckpt", tmp_path / "elsewhere" / "moved")
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    return tmp_path


def test_the_saved_config_reads_the_same_files_after_the_move(moved):
    step = moved / "elsewhere" / "moved" / "step-00000002"
    cfg = TrainConfig.from_toml(step / "config.toml")
    assert cfg.corpus.data == str(moved / "data" / "docs.jsonl")
    assert cfg.corpus.tokenizer == str(moved / "tok" / "tokenizer.json")
    assert cfg.ckpt.checkpoint_dir == str(moved / "elsewhere" / "moved")
    assert 'checkpoint_dir = ".."' in (step / "config.toml").read_text()
    assert (step / "tokenizer.json").read_bytes() == (moved / "tok" / "tokenizer.json").read_bytes()


def test_a_moved_run_generates_and_exports_without_its_tokenizer_source(moved, capsys):
    (moved / "tok").rename(moved / "tok-gone")             # only the checkpoint's copy is left
    run = str(moved / "elsewhere" / "moved")
    assert main(["generate", "--checkpoint", run, "--prompt", "document", "--max-new-tokens",
                 "4", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("document")
    assert main(["export", "--checkpoint", run, "--out", "exported"]) == 0
    assert (moved / "here" / "exported" / "tokenizer.json").read_bytes() == (
        moved / "tok-gone" / "tokenizer.json").read_bytes()


def test_a_moved_run_resumes_from_its_config(moved, capsys):
    step = moved / "elsewhere" / "moved" / "step-00000002"
    assert main(["train", "--config", str(step / "config.toml"), "--resume", "--steps", "3"]) == 0
    assert (moved / "elsewhere" / "moved" / "step-00000003").is_dir()
    assert "resum" in capsys.readouterr().err.lower()


def test_an_export_that_cannot_write_its_tokenizer_fails(moved, capsys):
    step = moved / "elsewhere" / "moved" / "step-00000002"
    meta = json.loads((step / "meta.json").read_text())
    meta["data"]["tokenizer"] = {"path": str(moved / "gone.json"), "sha256": "0" * 64}  # older form
    (step / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(SystemExit) as exit:
        main(["export", "--checkpoint", str(step), "--out", "exported"])
    assert exit.value.code != 0 and not (moved / "here" / "exported").exists()
    assert "gone.json' is gone: no tokenizer to export" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit:
        main(["generate", "--checkpoint", str(step), "--prompt", "x"])
    assert exit.value.code != 0 and "pass --tokenizer FILE" in capsys.readouterr().err


def test_data_inside_the_run_folder_moves_with_it(tmp_path, monkeypatch):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "notes.txt").write_text("some text to learn from, said twice. " * 40)
    monkeypatch.chdir(tmp_path)
    assert main([*TRAIN, "--steps", "1", "--data", "run/notes.txt", "--checkpoint-dir", "run"]) == 0
    shutil.move(tmp_path / "run", tmp_path / "moved")
    config = tmp_path / "moved" / "step-00000001" / "config.toml"
    assert 'data = "../notes.txt"' in config.read_text()
    assert TrainConfig.from_toml(config).corpus.data == str(tmp_path / "moved" / "notes.txt")
    assert main(["train", "--config", str(config), "--resume", "--steps", "2"]) == 0
    assert (tmp_path / "moved" / "step-00000002").is_dir()


def test_a_mix_of_sources_is_written_for_a_move_and_compared_on_resume(tmp_path, monkeypatch):
    from chimera.train import resume
    from chimera.train.portable import portable_toml

    monkeypatch.chdir(tmp_path)
    (tmp_path / "run" / "step-00000001").mkdir(parents=True)
    (tmp_path / "run" / "step-00000001" / "meta.json").write_text("{}")
    cfg = TrainConfig(data_mix=("run/a.txt:0.7", "b.txt:0.3"), checkpoint_dir="run")
    config = tmp_path / "run" / "step-00000001" / "config.toml"
    config.write_text(portable_toml(cfg, config.parent))
    assert '"../a.txt:0.7"' in config.read_text()
    shutil.move(tmp_path / "run", tmp_path / "moved")
    again = TrainConfig.from_toml(tmp_path / "moved" / "step-00000001" / "config.toml")
    assert again.corpus.data_mix == (f"{tmp_path}/moved/a.txt:0.7", f"{tmp_path}/b.txt:0.3")
    meta = {"model": cfg.net.model, "run": resume.record(cfg)}
    other = cfg.replace(data_mix=("run/a.txt:0.5", "b.txt:0.5"))
    refused, _ = resume.compare(meta, other, {})
    assert any("data mix" in line for line in refused)
