"""The held-out split by documents, --val-data, --val-fraction, and a literal end-of-text
marker in training text (chimera.data.documents, chimera.data.formats)."""

import json

import numpy as np
import pytest
import torch

from chimera.data import get_batch
from chimera.data.documents import Spans, held_out_mask, split_documents
from chimera.data.formats import DataSpec, describe, open_data

DOCS = [f"document {i:03d} says {'abcdefghij'[i % 10] * (20 + i)}" for i in range(60)]


def _text(ids) -> str:
    return bytes(np.asarray(ids, dtype=np.uint8).tolist()).decode()


def _check_whole(train: str, val: str, docs=DOCS) -> None:
    """Every document is wholly in one split, never in both, and some are held out."""
    held = [d for d in docs if d in val]
    assert 0 < len(held) < len(docs)
    for d in docs:
        assert (d in train) != (d in val), d
        assert (f"document {d[9:12]}" in train) != (d in val)   # not even its first words


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("documents")
    (root / "folder").mkdir()
    for i, doc in enumerate(DOCS):
        (root / "folder" / f"{i:03d}.txt").write_text(doc)
    with open(root / "docs.jsonl", "w") as f:
        for doc in DOCS:
            f.write(json.dumps({"text": doc}) + "\n")
    return root


def test_a_text_folder_holds_out_whole_files(sources):
    corpus = open_data(DataSpec(str(sources / "folder")))
    _check_whole(_text(np.asarray(corpus.train)), _text(np.asarray(corpus.val)))
    assert len(corpus.train) + len(corpus.val) == sum(len(d) + 1 for d in DOCS)


def test_jsonl_objects_are_held_out_whole(sources):
    corpus = open_data(DataSpec(str(sources / "docs.jsonl")))
    _check_whole(_text(np.asarray(corpus.train)), _text(np.asarray(corpus.val)))


def test_training_batches_never_hold_a_held_out_document(sources):
    corpus = open_data(DataSpec(str(sources / "docs.jsonl")))
    held = [d for d in DOCS if d in _text(np.asarray(corpus.val))]
    seen = "".join(_text(row) for step in range(20)
                   for row in get_batch(corpus, step, 8, 48, seed=0)[0].numpy())
    assert not any(d[:16] in seen for d in held)
    assert any(d[:16] in seen for d in DOCS if d not in held)


def test_token_ids_split_at_their_end_of_text_id(tmp_path):
    rng = np.random.default_rng(1)
    docs = [np.append(rng.integers(1, 100, 10 + i), 0) for i in range(40)]  # id 0 ends each
    np.concatenate(docs).astype("<u2").tofile(tmp_path / "ids.bin")
    (tmp_path / "meta.json").write_text(json.dumps({
        "format": "chimera-tokens", "dtype": "uint16", "vocab_size": 100, "eos_id": 0,
        "files": {"train": "ids.bin"}}))
    corpus = open_data(DataSpec(str(tmp_path / "ids.bin")))
    held = held_out_mask(len(docs), 0.05)
    assert np.array_equal(np.asarray(corpus.val), np.concatenate([d for d, h in zip(docs, held) if h]))
    assert np.array_equal(np.asarray(corpus.train), np.concatenate([d for d, h in zip(docs, held) if not h]))
    # without an end-of-text id the ids are one stream: its last 5%
    (tmp_path / "meta.json").unlink()
    plain = open_data(DataSpec(str(tmp_path / "ids.bin"), token_dtype="uint16", vocab_size=100))
    assert len(plain.val) == max(1, int(len(plain) * 0.05))
    # a raw file (nanoGPT's, no meta.json) with --eos-id: the same documents held out
    raw = open_data(DataSpec(str(tmp_path / "ids.bin"), token_dtype="uint16", vocab_size=100, eos_id=0))
    assert np.array_equal(np.asarray(raw.val), np.asarray(corpus.val))
    assert np.array_equal(np.asarray(raw.train), np.asarray(corpus.train))


def test_eos_id_is_refused_where_it_cannot_hold(tmp_path, sources):
    np.arange(1, 50, dtype="<u2").tofile(tmp_path / "ids.bin")
    (tmp_path / "meta.json").write_text(json.dumps({
        "format": "chimera-tokens", "dtype": "uint16", "vocab_size": 100, "eos_id": 0,
        "files": {"train": "ids.bin"}}))
    with pytest.raises(ValueError, match="--eos-id 7 contradicts .*meta.json .end-of-text id 0"):
        describe(DataSpec(str(tmp_path / "ids.bin"), eos_id=7))
    assert describe(DataSpec(str(tmp_path / "ids.bin"), eos_id=0)).eos_id == 0
    (tmp_path / "meta.json").unlink()
    with pytest.raises(ValueError, match="--eos-id 100 is not below the vocabulary .100 ids"):
        describe(DataSpec(str(tmp_path / "ids.bin"), token_dtype="uint16", vocab_size=100, eos_id=100))
    with pytest.raises(ValueError, match="--eos-id applies to token ids"):
        describe(DataSpec(str(sources / "docs.jsonl"), eos_id=0))
    with pytest.raises(ValueError, match="--eos-id must be an id from 0"):
        DataSpec(str(tmp_path / "ids.bin"), eos_id=-1)


def test_a_datasets_folder_holds_out_whole_rows(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [[i] * (5 + i % 7) for i in range(1, 50)]
    datasets.Dataset.from_dict({"input_ids": rows}).save_to_disk(str(tmp_path / "ds"))
    corpus = open_data(DataSpec(str(tmp_path / "ds"), vocab_size=64))
    val, train = set(np.asarray(corpus.val).tolist()), set(np.asarray(corpus.train).tolist())
    assert val and not val & train and val | train == set(range(1, 50))


def test_val_fraction_and_seeded_choice(sources):
    a = open_data(DataSpec(str(sources / "folder"), val_fraction=0.3))
    b = open_data(DataSpec(str(sources / "folder"), val_fraction=0.3))
    assert np.array_equal(np.asarray(a.val), np.asarray(b.val))          # the same every time
    small = open_data(DataSpec(str(sources / "folder")))
    assert len(a.val) > 2 * len(small.val)
    none = open_data(DataSpec(str(sources / "folder"), val_fraction=0))
    assert len(none.val) == 0 and len(none.train) == sum(len(d) + 1 for d in DOCS)
    for bad in (1, 1.5, -0.1, True, "x"):
        with pytest.raises(ValueError, match="--val-fraction must be a number"):
            DataSpec(str(sources / "folder"), val_fraction=bad)
    with pytest.raises(ValueError, match="standard library's held-out files"):
        DataSpec(None, val_fraction=0.1)


def test_val_data_is_held_out_whole_and_data_trains_whole(sources, tmp_path):
    (tmp_path / "val.txt").write_text("the held-out text\n" * 5)
    corpus = open_data(DataSpec(str(sources / "docs.jsonl"), val_data=str(tmp_path / "val.txt")))
    assert _text(np.asarray(corpus.val)) == "the held-out text\n" * 5 + "\n"
    assert len(corpus.train) == sum(len(d) + 1 for d in DOCS)
    np.save(tmp_path / "ids.npy", np.full(50, 3, np.int32))
    with pytest.raises(ValueError, match="--val-data: --vocab-size applies to token ids: .*val.txt "
                                         "is read as bytes"):
        describe(DataSpec(str(tmp_path / "ids.npy"), vocab_size=100, val_data=str(tmp_path / "val.txt")))
    with pytest.raises(ValueError, match="give one"):
        DataSpec(str(sources / "docs.jsonl"), val_data=str(tmp_path / "val.txt"), val_fraction=0.1)


def test_spans_read_as_one_array():
    base = torch.arange(100, dtype=torch.uint8)
    train, val = split_documents(base, np.arange(10, 101, 10), 0.3)
    whole = np.concatenate([np.asarray(train), np.asarray(val)])
    assert sorted(whole.tolist()) == list(range(100))
    index = np.arange(len(train)).reshape(2, -1)
    assert np.array_equal(train[index], np.asarray(train).reshape(2, -1))
    assert isinstance(train, Spans) and split_documents(base, [100], 0.3) is None


def test_a_literal_end_of_text_in_the_text_is_plain_text(tmp_path):
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer

    from chimera.data.bpe import tokenize

    (tmp_path / "src").mkdir()
    for i in range(8):
        (tmp_path / "src" / f"{i}.txt").write_text(f"file {i} mentions <|endoftext|> in passing\n" * 3)
    tokenize(DataSpec(str(tmp_path / "src")), tmp_path / "tok", 300)
    tok_json = str(tmp_path / "tok" / "tokenizer.json")
    corpus = open_data(DataSpec(str(tmp_path / "src"), tokenizer=tok_json, val_fraction=0))
    ids = np.asarray(corpus.train)
    eos = Tokenizer.from_file(tok_json).token_to_id("<|endoftext|>")
    assert int((ids == eos).sum()) == 8                    # one after each file, none inside
    text = Tokenizer.from_file(tok_json).decode(ids.tolist(), skip_special_tokens=True)
    assert text.count("<|endoftext|>") == 24               # the literal came back as text


def test_chimera_tokenize_holds_out_whole_documents(sources, tmp_path):
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer

    from chimera.data.bpe import tokenize

    meta = tokenize(DataSpec(str(sources / "docs.jsonl")), tmp_path / "tok", 300)
    tok = Tokenizer.from_file(str(tmp_path / "tok" / "tokenizer.json"))
    train, val = (np.fromfile(tmp_path / "tok" / f"{s}.bin", "<u2") for s in ("train", "val"))
    assert [len(train), len(val)] == [meta["tokens"]["train"], meta["tokens"]["val"]]
    _check_whole(tok.decode(train.tolist()), tok.decode(val.tolist()))
    # the same documents as chimera train holds out of the text itself
    corpus = open_data(DataSpec(str(sources / "docs.jsonl"), tokenizer=str(tmp_path / "tok" / "tokenizer.json")))
    assert np.array_equal(np.asarray(corpus.val), val) and np.array_equal(np.asarray(corpus.train), train)
