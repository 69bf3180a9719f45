"""Corpus loading and the layout-independent batch sampler."""

import pytest
import torch

from chimera.data import (
    DEFAULT_MAX_BYTES, IGNORE_INDEX, Batches, derive_seed, get_batch, load_corpus,
    split_corpus)


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(max_bytes=200_000)


def test_stdlib_corpus_is_deterministic_and_capped():
    a = load_corpus(max_bytes=100_000)
    assert a.dtype == torch.uint8 and a.shape == (100_000,)
    assert torch.equal(a, load_corpus(max_bytes=100_000))
    assert b"import" in bytes(a.tolist())
    assert len(load_corpus()) == DEFAULT_MAX_BYTES       # the stdlib is larger than the cap


def test_load_file_and_directory(tmp_path):
    (tmp_path / "b.txt").write_bytes(b"second")
    (tmp_path / "a.txt").write_bytes(b"first")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.txt").write_bytes(b"third")
    (tmp_path / "blob.bin").write_bytes(b"\0\1\2")        # binary: skipped
    (tmp_path / ".hidden").write_bytes(b"secret")         # hidden: skipped
    assert bytes(load_corpus(tmp_path).tolist()) == b"first\nsecond\nthird\n"
    assert bytes(load_corpus(tmp_path / "a.txt").tolist()) == b"first\n"
    assert len(load_corpus(tmp_path, max_bytes=4)) == 4


def test_load_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_corpus(tmp_path / "missing")
    with pytest.raises(ValueError, match="empty"):
        load_corpus(tmp_path)                             # empty directory
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        load_corpus(tmp_path / "empty.txt")
    (tmp_path / "short.txt").write_bytes(b"hello")
    with pytest.raises(ValueError, match="fewer than one sequence"):
        load_corpus(tmp_path / "short.txt", seq_len=32)


def test_split_corpus():
    data = torch.arange(100, dtype=torch.uint8)
    assert torch.equal(split_corpus(data, "val"), data[95:])
    assert torch.equal(split_corpus(data, "train"), data[:95])
    with pytest.raises(ValueError, match="split must be one of"):
        split_corpus(data, "test")


def test_gpt2_batch_shapes_and_shift(corpus):
    inputs, targets = get_batch(corpus, step=0, global_batch=8, seq_len=16, seed=0)
    assert inputs.shape == targets.shape == (8, 16)
    assert inputs.dtype == targets.dtype == torch.long
    assert torch.equal(inputs[:, 1:], targets[:, :-1])


def test_batches_depend_only_on_step_and_seed(corpus):
    rng_state = torch.get_rng_state()
    later_first = [get_batch(corpus, s, 4, 16, seed=1) for s in (5, 2)]
    earlier_first = [get_batch(corpus, s, 4, 16, seed=1) for s in (2, 5)]
    assert torch.equal(torch.get_rng_state(), rng_state)  # global RNG untouched
    assert torch.equal(later_first[0][0], earlier_first[1][0])
    assert torch.equal(later_first[1][0], earlier_first[0][0])
    assert not torch.equal(later_first[0][0], later_first[1][0])
    other_seed = get_batch(corpus, 5, 4, 16, seed=2)[0]
    assert not torch.equal(other_seed, later_first[0][0])


def test_micro_batches_are_row_slices_whatever_the_layout(corpus):
    """Any (W, N) layout slices the same global batch: the union of rows is the same."""
    inputs, _ = get_batch(corpus, 3, 12, 16, seed=0)
    for chunks in (1, 2, 3, 4, 6, 12):
        again = torch.cat(get_batch(corpus, 3, 12, 16, seed=0)[0].chunk(chunks))
        assert torch.equal(again, inputs)


def test_val_split_draws_from_held_out_tail(corpus):
    inputs, _ = get_batch(corpus, 0, 4, 16, seed=0, split="val")
    tail = bytes(split_corpus(corpus, "val").tolist())
    for row in inputs:
        assert bytes(row.tolist()) in tail


def test_bert_masking_statistics(corpus):
    inputs, targets = get_batch(corpus, 0, 64, 128, seed=0, kind="bert")
    assert inputs.shape == targets.shape == (64, 128)
    selected = targets != IGNORE_INDEX
    assert selected.any(dim=1).all()                      # every row has a target
    assert 0.13 < selected.float().mean() < 0.17
    masked = selected & (inputs == 255)
    kept = selected & (inputs == targets)
    assert 0.75 < masked.sum() / selected.sum() < 0.85
    assert 0.06 < kept.sum() / selected.sum() < 0.14
    random_ = selected & ~(inputs == 255) & ~(inputs == targets)
    assert 0.06 < random_.sum() / selected.sum() < 0.14
    assert torch.all(targets[selected] < 255)             # the mask id is not a UTF-8 byte


def test_bert_unselected_positions_are_untouched(corpus):
    inputs, targets = get_batch(corpus, 1, 8, 32, seed=0, kind="bert")
    g = torch.Generator().manual_seed(derive_seed(0, "batch", "train", 1))
    data = split_corpus(corpus, "train")
    starts = torch.randint(0, len(data) - 32 + 1, (8, 1), generator=g)
    original = data[starts + torch.arange(32)].long()
    assert torch.equal(inputs[targets == IGNORE_INDEX], original[targets == IGNORE_INDEX])
    assert torch.equal(targets[targets != IGNORE_INDEX], original[targets != IGNORE_INDEX])


def test_batches_sampler(corpus):
    batches = Batches(corpus, global_batch=4, seq_len=16, seed=3, kind="bert")
    assert torch.equal(batches[7][0], get_batch(corpus, 7, 4, 16, 3, "bert")[0])
    with pytest.raises(ValueError, match="kind"):
        Batches(corpus, 4, 16, 0, kind="t5")


@pytest.mark.parametrize("kwargs, message", [
    (dict(kind="t5"), "kind must be one of"),
    (dict(step=-1), "step must be a non-negative"),
    (dict(global_batch=0), "global_batch must be a positive"),
    (dict(seq_len=0), "seq_len must be a positive"),
    (dict(split="test"), "split must be one of"),
    (dict(vocab_size=100), "vocab_size >= 256"),
    (dict(seq_len=20_000, split="val"), "'val' split has"),
])
def test_get_batch_errors(corpus, kwargs, message):
    args = dict(step=0, global_batch=2, seq_len=16, seed=0)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        get_batch(corpus, **args)


def test_derive_seed_is_stable():
    assert derive_seed(1, "x") == derive_seed(1, "x") != derive_seed(1, "y")
    assert 0 <= derive_seed(2**70, "z") < 2**63
