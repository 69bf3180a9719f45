"""Several training sources mixed by weight (--data-mix, chimera.data.mixture)."""

import json

import numpy as np
import pytest
import torch

from chimera.data import get_batch
from chimera.data.formats import DataSpec, describe, open_data
from chimera.train import TrainConfig


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    root = tmp_path_factory.mktemp("mix")
    for name, letter in (("a", "a"), ("b", "b")):
        (root / name).mkdir()
        for i in range(30):                       # 30 documents each, letters of one kind
            (root / name / f"{i}.txt").write_text(f"{letter * 40}\n")
    return root


def _source_of(row: torch.Tensor) -> str:
    letters = set(bytes(row.tolist()).decode()) - {"\n"}
    assert len(letters) == 1, letters                 # a row never mixes sources
    return letters.pop()


def test_each_row_comes_from_one_source_drawn_by_weight(two):
    mix = open_data(DataSpec(mix=(f"{two / 'a'}:3", f"{two / 'b'}:1")))
    assert mix.weights == (0.75, 0.25) and mix.is_bytes and mix.vocab_size == 256
    rows = [_source_of(r) for step in range(40) for r in get_batch(mix, step, 32, 16, seed=0)[0]]
    share = rows.count("a") / len(rows)
    assert abs(share - 0.75) < 0.05, share           # 1280 draws: 4 standard deviations
    first = get_batch(mix, 5, 32, 16, seed=0)
    assert all(torch.equal(x, y) for x, y in zip(first, get_batch(mix, 5, 32, 16, seed=0)))
    assert not torch.equal(first[0], get_batch(mix, 6, 32, 16, seed=0)[0])
    inputs, targets = first
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    held = get_batch(mix, 0, 64, 16, seed=0, split="val")[0]   # the held-out splits, mixed
    assert {_source_of(r) for r in held} == {"a", "b"}


def test_mixed_sources_share_a_vocabulary_and_replace_data(two, tmp_path):
    np.arange(100, dtype="<u2").tofile(tmp_path / "ids.bin")
    (tmp_path / "meta.json").write_text(json.dumps({
        "format": "chimera-tokens", "dtype": "uint16", "vocab_size": 100, "files": {"train": "ids.bin"}}))
    with pytest.raises(ValueError, match="ids.bin reads as ids of a vocabulary of 100, .* as bytes: "
                                         "mixed sources must share a vocabulary"):
        describe(DataSpec(mix=(f"{two / 'a'}:1", f"{tmp_path / 'ids.bin'}:1")))
    with pytest.raises(ValueError, match="--data and --data-mix both"):
        DataSpec(str(two / "a"), mix=(f"{two / 'a'}:1", f"{two / 'b'}:1"))
    for bad in (("x",), (f"{two / 'a'}:1",), (f"{two / 'a'}:0", f"{two / 'b'}:1"),
                (f"{two / 'a'}:w", f"{two / 'b'}:1")):
        with pytest.raises(ValueError, match="--data-mix"):
            DataSpec(mix=bad)


def test_train_takes_data_mix(two, tmp_path, monkeypatch):
    from chimera.cli import main
    from chimera.cli.train_cmd import parse

    cfg, _ = parse(["--data-mix", f"{two / 'a'}:0.7", f"{two / 'b'}:0.3"])
    assert cfg.corpus.data_mix == (f"{two / 'a'}:0.7", f"{two / 'b'}:0.3")
    cfg.save_toml(tmp_path / "run.toml")
    assert TrainConfig.from_toml(tmp_path / "run.toml") == cfg
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--schedule", "none", "--stages", "1", "--steps", "2", "-B", "2",
                 "--seq-len", "16", "--eval-every", "2", "--no-progress", "--trace", "", "--png",
                 "", "--data-mix", f"{two / 'a'}:0.7", f"{two / 'b'}:0.3"]) == 0
