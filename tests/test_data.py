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


def test_the_stdlib_holds_out_a_seeded_choice_of_its_files():
    """The default corpus's held-out split is whole files picked by a seeded hash of their
    paths from the whole library (not its alphabetical tail, codec tables), and is the last
    5% of the bytes, where every reader of a bare corpus cuts."""
    from chimera.data import held_out, stdlib_documents, stdlib_sources

    train, val = stdlib_documents()
    assert sum(map(len, val)) == int(DEFAULT_MAX_BYTES * 0.05)
    assert sum(map(len, train)) + sum(map(len, val)) == DEFAULT_MAX_BYTES
    assert not set(train) & set(val) and len(val) > 5
    assert not any(b"gencodec.py" in doc[:8192] for doc in train + val)  # no generated tables
    corpus = load_corpus()
    assert bytes(split_corpus(corpus, "val").tolist()) == b"".join(val)
    picked = [held_out(f"x/{i}.py") for i in range(2000)]
    assert 0.03 < sum(picked) / len(picked) < 0.07       # about one file in 20
    old_tail = b"".join(p.read_bytes() + b"\n" for p in stdlib_sources())[:DEFAULT_MAX_BYTES][-len(b"".join(val)):]
    assert b"".join(val) != old_tail and old_tail.count(b"#  0x") > 2 * b"".join(val).count(b"#  0x")


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


def test_bert_on_bytes_is_unchanged():
    """Byte data masks with 0xFF and draws random ids below it, as before tokenizers' mask
    ids: the batches of these steps, pinned (their SHA-256), on the corpus as it was read
    then (the stdlib's files in order, before the held-out files moved to its end)."""
    import hashlib

    from chimera.data import _read_files, stdlib_sources

    corpus = torch.frombuffer(bytearray(_read_files(stdlib_sources(), 200_000)), dtype=torch.uint8)
    digest = hashlib.sha256()
    for step in range(3):
        for t in get_batch(corpus, step, 8, 32, seed=0, kind="bert"):
            digest.update(t.numpy().tobytes())
    assert digest.hexdigest()[:16] == "67eb6fe65738b80d"  # from the code before mask ids


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


# ---------------------------------------------------------------------------------------
# Data formats: a short `chimera train` on each; its batches are windows of the file's ids

import argparse  # noqa: E402  (the sections above need none of these)
import json  # noqa: E402

import numpy as np  # noqa: E402

from chimera.cli import main  # noqa: E402
from chimera.data import Corpus  # noqa: E402
from chimera.data.formats import DataSpec, open_data  # noqa: E402
from chimera.data.meta import meta_mask  # noqa: E402
from chimera.train import build  # noqa: E402
from chimera.train.loop import Trainer  # noqa: E402

T = 32  # gpt2-tiny's sequence length


@pytest.fixture(scope="module")
def fmt(tmp_path_factory):
    """One file or folder per format, and the ids each holds (the train split's source)."""
    import datasets

    from chimera.data.bpe import tokenize

    root = tmp_path_factory.mktemp("formats")
    text = open(argparse.__file__, encoding="utf-8").read()[:24_000]
    (root / "text.txt").write_text(text)
    tokenize(DataSpec(str(root / "text.txt")), root / "tok", 300)
    ids = np.random.default_rng(0).integers(0, 1000, 6000)
    ids.astype("<u2").tofile(root / "u16.bin")
    big = ids + 65_000                                     # ids that need 32 bits
    big.astype("<u4").tofile(root / "u32.bin")
    np.save(root / "ids.npy", ids.astype(np.int32))
    (root / "nanogpt").mkdir()
    ids[:5000].astype("<u2").tofile(root / "nanogpt" / "train.bin")
    ids[5000:].astype("<u2").tofile(root / "nanogpt" / "val.bin")
    (root / "nanogpt" / "prepare.py").write_text("# how nanoGPT made them\n")
    docs = [text[i:i + 700] for i in range(0, len(text), 700)]
    with open(root / "docs.jsonl", "w") as f:
        for n, doc in enumerate(docs):
            f.write(json.dumps({"id": n, "body": doc}) + "\n")
    rows = [ids[i:i + 97].tolist() for i in range(0, len(ids), 97)]
    datasets.Dataset.from_dict({"input_ids": rows}).save_to_disk(str(root / "ds-ids"))
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(root / "ds-text"))
    return root, text, ids, docs


def train_batches(argv, monkeypatch, tmp_path, steps=2):
    """Run `chimera train` (single process) on ``argv``; return its batches and model vocab."""
    seen = []
    real = Trainer.batch

    def batch(self, step):
        inputs, targets = real(self, step)
        seen.append((inputs, targets, self.source.vocab_size))
        return inputs, targets
    monkeypatch.setattr(Trainer, "batch", batch)
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--schedule", "none", "--stages", "1", "-B", "3", "--steps", str(steps),
                 "--no-progress", "--json", *argv]) == 0
    assert len(seen) == steps
    return seen


def assert_windows_of(seen, ids, vocab):
    """Every row (inputs, then the last target) is T + 1 consecutive ids of ``ids``."""
    windows = np.lib.stride_tricks.sliding_window_view(np.asarray(ids, dtype=np.int64), T + 1)
    for inputs, targets, model_vocab in seen:
        assert model_vocab == vocab
        assert torch.equal(inputs[:, 1:], targets[:, :-1])
        for row in torch.cat([inputs, targets[:, -1:]], dim=1).numpy():
            assert (windows == row).all(axis=1).any(), row


def train_split(ids):
    """A source of one document (or of ids with no end-of-text id): its last 5% held out."""
    return ids[:len(ids) - max(1, int(len(ids) * 0.05))]


def train_documents(documents):
    """A source of several documents (arrays): the ones the seeded choice keeps, in order."""
    from chimera.data.documents import held_out_mask

    held = held_out_mask(len(documents), 0.05)
    assert held.any() and not held.all()
    return np.concatenate([d for d, h in zip(documents, held) if not h])


def byte_docs(docs):
    return [np.frombuffer((d + "\n").encode(), np.uint8) for d in docs]


def encode(tokenizer_json, docs):
    """Each document and a newline, then the end-of-text id where the tokenizer has one."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    eos = [tok.token_to_id(t) for t in ("<|endoftext|>", "</s>") if tok.token_to_id(t) is not None][:1]
    return [i for doc in docs for i in tok.encode(doc + "\n", add_special_tokens=False).ids + eos]


def test_train_on_text_as_bytes(fmt, monkeypatch, tmp_path):
    root, text, _, _ = fmt
    seen = train_batches(["--data", str(root / "text.txt")], monkeypatch, tmp_path)
    assert_windows_of(seen, train_split(np.frombuffer((text + "\n").encode(), np.uint8)), 256)


def test_train_on_text_through_a_tokenizer(fmt, monkeypatch, tmp_path):
    root, text, _, _ = fmt
    seen = train_batches(["--data", str(root / "text.txt"), "--tokenizer",
                          str(root / "tok" / "tokenizer.json")], monkeypatch, tmp_path)
    assert_windows_of(seen, train_split(encode(root / "tok" / "tokenizer.json", [text])), 300)


def test_tokenize_writes_ids_that_decode_to_the_text(fmt, monkeypatch, tmp_path):
    """chimera tokenize's folder: meta.json, the 95/5 cut, ids that decode back, and the
    same batches as the text through its tokenizer."""
    from tokenizers import Tokenizer

    root, text, _, _ = fmt
    meta = json.loads((root / "tok" / "meta.json").read_text())
    assert (meta["dtype"], meta["vocab_size"], meta["format"]) == ("uint16", 300, "chimera-tokens")
    train = np.fromfile(root / "tok" / "train.bin", "<u2")
    val = np.fromfile(root / "tok" / "val.bin", "<u2")
    assert [len(train), len(val)] == [meta["tokens"]["train"], meta["tokens"]["val"]]
    assert len(val) == max(1, int((len(train) + len(val)) * 0.05))
    tok = Tokenizer.from_file(str(root / "tok" / "tokenizer.json"))
    assert tok.decode(np.concatenate([train, val]).tolist(), skip_special_tokens=False) == (
        text + "\n<|endoftext|>")
    seen = train_batches(["--data", str(root / "tok")], monkeypatch, tmp_path)
    assert_windows_of(seen, train, 300)
    same = train_batches(["--data", str(root / "text.txt"), "--tokenizer",
                          str(root / "tok" / "tokenizer.json")], monkeypatch, tmp_path)
    for a, b in zip(seen, same[-2:]):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_tokenize_cli_on_jsonl_and_datasets_text(fmt, tmp_path, capsys):
    """The command: a given tokenizer on a .jsonl field, a trained one on a datasets text
    column (the same text and vocabulary as the fixture's: the same tokenizer, byte for byte)."""
    root, text, _, docs = fmt
    tok = root / "tok" / "tokenizer.json"
    assert main(["tokenize", "--data", str(root / "docs.jsonl"), "--text-field", "body",
                 "--tokenizer", str(tok), "--out", str(tmp_path / "j"), "--no-progress"]) == 0
    assert "chimera train --data" in capsys.readouterr().out
    train = np.fromfile(tmp_path / "j" / "train.bin", "<u2")
    assert train.tolist() == train_documents([np.array(encode(tok, [d])) for d in docs]).tolist()
    (tmp_path / "one.txt").write_text(text)
    assert main(["tokenize", "--data", str(tmp_path / "one.txt"), "--vocab-size", "300",
                 "--out", str(tmp_path / "again"), "--no-progress"]) == 0
    assert (tmp_path / "again" / "tokenizer.json").read_bytes() == tok.read_bytes()  # deterministic
    assert main(["tokenize", "--data", str(root / "ds-text"), "--vocab-size", "300",
                 "--out", str(tmp_path / "d"), "--no-progress"]) == 0
    meta = json.loads((tmp_path / "d" / "meta.json").read_text())
    assert meta["tokens"]["train"] + meta["tokens"]["val"] == len(
        encode(tmp_path / "d" / "tokenizer.json", docs))


def test_train_on_a_tokenized_file_with_its_meta(fmt, monkeypatch, tmp_path):
    root = fmt[0]
    seen = train_batches(["--data", str(root / "tok" / "train.bin")], monkeypatch, tmp_path)
    assert_windows_of(seen, train_split(np.fromfile(root / "tok" / "train.bin", "<u2")), 300)


@pytest.mark.parametrize("name, dtype, offset", [("u16.bin", "uint16", 0), ("u32.bin", "uint32", 65_000)])
def test_train_on_a_bin_token_file(fmt, monkeypatch, tmp_path, name, dtype, offset):
    root, _, ids, _ = fmt
    vocab = 1000 + offset
    seen = train_batches(["--data", str(root / name), "--token-dtype", dtype, "--vocab-size",
                          str(vocab)], monkeypatch, tmp_path)
    assert_windows_of(seen, train_split(ids + offset), vocab)


def test_train_on_a_nanogpt_folder(fmt, monkeypatch, tmp_path):
    root, _, ids, _ = fmt
    seen = train_batches(["--data", str(root / "nanogpt"), "--token-dtype", "uint16",
                          "--vocab-size", "1024"], monkeypatch, tmp_path)
    assert_windows_of(seen, ids[:5000], 1024)              # train.bin whole; val.bin held out


def test_train_on_an_npy(fmt, monkeypatch, tmp_path):
    root, _, ids, _ = fmt
    seen = train_batches(["--data", str(root / "ids.npy"), "--vocab-size", "1000"],
                         monkeypatch, tmp_path)
    assert_windows_of(seen, train_split(ids), 1000)


def test_train_on_jsonl_as_bytes_and_tokens(fmt, monkeypatch, tmp_path):
    root, _, _, docs = fmt
    argv = ["--data", str(root / "docs.jsonl"), "--text-field", "body"]
    seen = train_batches(argv, monkeypatch, tmp_path)
    assert_windows_of(seen, train_documents(byte_docs(docs)), 256)
    tok = root / "tok" / "tokenizer.json"
    seen = train_batches([*argv, "--tokenizer", str(tok)], monkeypatch, tmp_path)
    assert_windows_of(seen[-2:], train_documents([np.array(encode(tok, [d])) for d in docs]), 300)


def test_train_on_a_datasets_folder(fmt, monkeypatch, tmp_path):
    root, _, ids, docs = fmt
    seen = train_batches(["--data", str(root / "ds-ids"), "--vocab-size", "1000"],
                         monkeypatch, tmp_path)
    assert_windows_of(seen, train_documents([ids[i:i + 97] for i in range(0, len(ids), 97)]), 1000)
    seen = train_batches(["--data", str(root / "ds-text")], monkeypatch, tmp_path)
    assert_windows_of(seen[-2:], train_documents(byte_docs(docs)), 256)


def test_bert_on_token_ids_gets_a_mask_id_after_the_vocabulary(fmt):
    root = fmt[0]
    corpus = open_data(DataSpec(str(root / "tok")))
    inputs, targets = get_batch(corpus, 0, 16, T, seed=0, kind="bert")
    selected = targets != IGNORE_INDEX
    assert (inputs == 300).any() and (inputs[~selected] < 300).all()
    assert (targets[selected] < 300).all()
    with pytest.raises(ValueError, match="needs vocab_size >= 301"):
        get_batch(corpus, 0, 16, T, seed=0, kind="bert", vocab_size=300)


def test_token_files_are_memory_mapped_and_sampled_as_in_memory(fmt):
    """A memory map gives the same batches as the same ids in memory (and as a tensor)."""
    from chimera.data.tokens import TokenFile

    root, _, ids, _ = fmt
    mapped = open_data(DataSpec(str(root / "u16.bin"), token_dtype="uint16", vocab_size=1000))
    assert isinstance(mapped.train, TokenFile) and isinstance(mapped.val, TokenFile)
    loaded = Corpus.from_tokens(ids.astype(np.int64), 1000, "memory")
    tensor = Corpus.from_tokens(torch.from_numpy(ids), 1000, "tensor")
    for step in (0, 7):
        a, b, c = (get_batch(x, step, 12, T, seed=3) for x in (mapped, loaded, tensor))
        assert torch.equal(a[0], b[0]) and torch.equal(a[0], c[0]) and torch.equal(a[1], b[1])
        val = get_batch(mapped, step, 4, T, seed=3, split="val")[0].numpy()
        tail = np.lib.stride_tricks.sliding_window_view(ids[len(mapped.train):], T)
        assert all((tail == row).all(axis=1).any() for row in val)  # from the held-out tail


@pytest.mark.slow
def test_pipeline_on_token_ids_matches_the_reference(fmt, capsys):
    """1F1B on D=2 ranks, a 1000-id vocabulary: the same losses as one process (float64)."""
    root = fmt[0]
    common = ["train", "--data", str(root / "u16.bin"), "--token-dtype", "uint16",
              "--vocab-size", "1000", "--dtype", "float64", "-N", "4", "-B", "2", "--steps", "2",
              "--no-progress", "--json", "--trace", "", "--png", ""]
    losses = []
    for layout in (["--schedule", "none", "--stages", "1"], ["--schedule", "1f1b", "--stages", "2"]):
        assert main([*common, *layout]) == 0
        out = capsys.readouterr().out
        losses.append([s["loss"] for s in json.loads(out.splitlines()[-1])["steps"]])
    assert losses[0] == pytest.approx(losses[1], abs=1e-10, rel=0)
    assert losses[0][0] == pytest.approx(np.log(1000), rel=0.05)   # ids of 1000, uniform-ish


# ---------------------------------------------------------------------------------------
# BERT's mask id: the tokenizer's own mask token where it has one

MASK = 4  # [MASK]'s id in the tokenizer below (its special tokens come first)


@pytest.fixture(scope="module")
def bert_tok(fmt):
    """A BERT-style WordPiece tokenizer.json with [MASK], trained on the fixture's text."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok.train_from_iterator([fmt[1]], trainers.WordPieceTrainer(vocab_size=400, special_tokens=specials))
    path = fmt[0] / "bert-tokenizer.json"
    tok.save(str(path))
    assert tok.token_to_id("[MASK]") == MASK
    return path, tok.get_vocab_size()


def test_mask_token_of_a_tokenizer():
    """[MASK] and RoBERTa's <mask> as special tokens; a plain vocabulary entry is text."""
    from tokenizers import Tokenizer, models, trainers

    from chimera.data.text import mask_id_of

    roberta = Tokenizer(models.BPE())
    roberta.train_from_iterator(["some text"], trainers.BpeTrainer(
        vocab_size=50, special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"]))
    assert mask_id_of(roberta) == 4
    assert mask_id_of(Tokenizer(models.WordLevel({"a": 0, "<mask>": 1}, unk_token="a"))) is None


def test_bert_masks_with_the_tokenizers_mask_token(fmt, bert_tok, monkeypatch, tmp_path):
    """Text through a tokenizer with [MASK]: the masked positions hold [MASK]'s id, and the
    model's vocabulary is the tokenizer's (no id appended)."""
    path, vocab = bert_tok
    argv = ["--model", "bert-tiny", "--data", str(fmt[0] / "text.txt"), "--tokenizer", str(path)]
    seen = train_batches(argv, monkeypatch, tmp_path)
    for inputs, targets, model_vocab in seen:
        assert model_vocab == vocab
        selected = targets != IGNORE_INDEX
        masked = selected & (inputs == MASK)
        assert masked.any() and not (inputs[~selected] == MASK).any()
        assert 0.6 < masked.sum() / selected.sum() < 0.95       # 80% of them, give or take
        assert int(inputs.max()) < vocab and int(targets[selected].max()) < vocab
    from chimera.train import TrainConfig, build

    cfg = TrainConfig(model="bert-tiny", schedule="none", stages=1, data=str(fmt[0] / "text.txt"),
                      tokenizer=str(path)).preflight()
    assert (build.data_info(cfg).mask_id, build.mask_id(cfg),
            build.model_config(cfg).vocab_size) == (MASK, MASK, vocab)


def test_tokenize_records_the_mask_id(fmt, bert_tok, tmp_path, capsys):
    """chimera tokenize --tokenizer writes the mask id to meta.json; token files read it (and
    from a meta.json written before it was recorded, from the tokenizer beside them); a
    trained BPE has none, so BERT appends one and says so; --resume refuses another mask id."""
    path, vocab = bert_tok
    out = tmp_path / "b"
    assert main(["tokenize", "--data", str(fmt[0] / "text.txt"), "--tokenizer", str(path),
                 "--out", str(out), "--no-progress"]) == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["mask_id"] == MASK
    assert json.loads((fmt[0] / "tok" / "meta.json").read_text())["mask_id"] is None
    corpus = open_data(DataSpec(str(out)))
    assert corpus.mask_id == MASK
    inputs, targets = get_batch(corpus, 0, 16, T, seed=0, kind="bert")
    assert (inputs == MASK).any() and int(inputs.max()) < vocab
    del meta["mask_id"]
    (out / "meta.json").write_text(json.dumps(meta))
    assert open_data(DataSpec(str(out))).mask_id == MASK
    meta["mask_id"] = MASK
    (out / "meta.json").write_text(json.dumps(meta))
    common = ["train", "--model", "bert-tiny", "--schedule", "none", "--stages", "1", "-B", "2",
              "--steps", "1", "--no-progress", "--json", "--trace", "", "--png", "",
              "--checkpoint-dir", str(tmp_path / "ck")]
    assert main([*common, "--data", str(out)]) == 0
    assert json.loads((tmp_path / "ck" / "step-00000001" / "meta.json").read_text())["data"]["mask_id"] == MASK
    meta["mask_id"] = MASK + 1                            # the same vocabulary, another mask
    (out / "meta.json").write_text(json.dumps(meta))
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main([*common, "--data", str(out), "--resume", "--steps", "2"])
    err = capsys.readouterr().err.strip()
    assert "mask id 4" in err and len(err.splitlines()) == 1
    assert main([*common[:-1], str(tmp_path / "ck2"), "--data", str(fmt[0] / "tok")]) == 0
    note = [line for line in capsys.readouterr().err.splitlines() if "BERT masks" in line]
    assert note == [f"chimera train: BERT masks with id 300, appended after the data's 300 ids "
                    f"({fmt[0] / 'tok' / 'tokenizer.json'} has no [MASK] or <mask> token)"]


# ---------------------------------------------------------------------------------------
# Text through a tokenizer is tokenized once, by the launcher

@pytest.mark.slow
def test_spawned_ranks_map_the_launchers_ids(fmt, tmp_path):
    """A 2-rank run on text with --tokenizer: the launcher tokenizes it and the ranks map
    those ids (the text is gone before they start, so they cannot read it), and its losses
    are those of the same run on chimera tokenize's token files: the same ids."""
    import shutil

    from chimera.train import TrainConfig
    from chimera.train.launch import launch

    root = fmt[0]
    shutil.copy(root / "text.txt", tmp_path / "text.txt")
    common = dict(schedule="1f1b", stages=2, micro_batches=2, micro_batch_size=2, steps=2,
                  progress=False, trace=None, png=None)
    cfg = TrainConfig(data=str(tmp_path / "text.txt"), tokenizer=str(root / "tok" / "tokenizer.json"),
                      **common).preflight()
    corpus = open_data(build.data_spec(cfg), seq_len=build.model_source(cfg).seq_len)
    (tmp_path / "text.txt").unlink()
    once = launch(cfg, corpus)
    files = launch(TrainConfig(data=str(root / "tok"), **common))
    assert [s["loss"] for s in once["steps"]] == [s["loss"] for s in files["steps"]]


def test_a_token_file_of_ids_made_in_memory(fmt, tmp_path):
    """to_token_file: the same ids and batches, over a read-only file."""
    import os

    from chimera.data.formats import to_token_file
    from chimera.data.tokens import TokenFile

    root = fmt[0]
    made = open_data(DataSpec(str(root / "text.txt"), tokenizer=str(root / "tok" / "tokenizer.json")))
    mapped = to_token_file(made, tmp_path / "ids.bin")
    assert isinstance(mapped.train, TokenFile) and isinstance(mapped.val, TokenFile)
    assert os.stat(tmp_path / "ids.bin").st_mode & 0o222 == 0          # read-only
    assert (mapped.vocab_size, mapped.tokenizer, mapped.where) == (made.vocab_size, made.tokenizer, made.where)
    assert np.array_equal(mapped.train[np.arange(len(mapped.train))], made.train)
    assert np.array_equal(mapped.val[np.arange(len(mapped.val))], made.val)
    for step in (0, 3):
        for split in ("train", "val"):
            a, b = (get_batch(c, step, 6, T, seed=1, split=split) for c in (made, mapped))
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_an_old_meta_whose_tokenizer_cannot_be_read_still_gives_its_ids(tmp_path):
    """A meta.json written before mask ids were recorded names a tokenizer; if that file cannot
    be read (no tokenizers package, or a broken file), the ids are still the data: no mask."""
    broken = tmp_path / "tokenizer.json"
    broken.write_text("{not json")
    meta = {"tokenizer_path": str(broken), "vocab_size": 300, "path": str(tmp_path / "meta.json")}
    assert meta_mask(meta) is None


def test_a_file_streams_in_the_pieces_cut_makes_of_it(monkeypatch, tmp_path):
    """A text file is read a block at a time (never whole), into exactly the pieces ``cut``
    makes of the whole text; the last one ends the document; a bad byte is placed exactly."""
    from chimera.data import text as data_text

    text = "".join(f"line {i} " + "é" * (i % 7) + "\n" * (1 + i % 3) for i in range(3000))
    (tmp_path / "t.txt").write_text(text + "a" * 300)     # and a line longer than a piece
    monkeypatch.setattr(data_text, "READ_BYTES", 97)     # blocks cut characters in two
    monkeypatch.setattr(type(tmp_path), "read_bytes", lambda self: pytest.fail("read whole"))
    pieces = list(data_text._file_pieces(tmp_path / "t.txt", limit=128))
    assert pieces == list(data_text.cut(text + "a" * 300 + "\n", 128))
    assert [type(p) is data_text.DocEnd for p in pieces] == [False] * (len(pieces) - 1) + [True]
    (tmp_path / "bad.txt").write_bytes(b"x" * 1000 + b"\xff" + b"y" * 10)
    with pytest.raises(ValueError, match="byte 0xff at offset 1,000"):
        list(data_text._file_pieces(tmp_path / "bad.txt"))


def test_tokenize_puts_the_end_of_text_token_between_documents(tmp_path, capsys):
    """`chimera tokenize` reserves <|endoftext|> (a special token, id 0) and writes it after
    every document, so a window that crosses documents sees where one ends."""
    from tokenizers import Tokenizer

    (tmp_path / "docs").mkdir()
    for name, body in (("a.txt", "first document " * 40), ("b.txt", "second one " * 40)):
        (tmp_path / "docs" / name).write_text(body)
    assert main(["tokenize", "--data", str(tmp_path / "docs"), "--vocab-size", "300",
                 "--out", str(tmp_path / "tok"), "--no-progress"]) == 0
    meta = json.loads((tmp_path / "tok" / "meta.json").read_text())
    tok = Tokenizer.from_file(str(tmp_path / "tok" / "tokenizer.json"))
    assert meta["eos_id"] == tok.token_to_id("<|endoftext|>") == 0
    ids = np.concatenate([np.fromfile(tmp_path / "tok" / n, "<u2") for n in ("train.bin", "val.bin")])
    ends = np.flatnonzero(ids == 0)
    assert len(ends) == 2 and ends[-1] == len(ids) - 1
    assert tok.decode(ids[:ends[0]].tolist()) == "first document " * 40 + "\n"
    assert tok.encode("<|endoftext|>" + "x").ids[0] == 0  # a special token, not text


def test_tokenizing_the_stdlib_holds_out_its_held_out_files(monkeypatch, tmp_path):
    """`chimera tokenize` on the default corpus: val.bin is the ids of the held-out files, and
    the stdlib read through that tokenizer gives the same two splits."""
    from chimera import data
    from chimera.data.bpe import tokenize

    monkeypatch.setattr(data, "DEFAULT_MAX_BYTES", 200_000)  # a small corpus, the same rule
    meta = tokenize(DataSpec(None), tmp_path / "tok", 300)
    assert meta["split"].startswith("val.bin holds a seeded choice")
    train = np.fromfile(tmp_path / "tok" / "train.bin", "<u2")
    val = np.fromfile(tmp_path / "tok" / "val.bin", "<u2")
    _, held = data.stdlib_documents()
    from tokenizers import Tokenizer

    tok = tmp_path / "tok" / "tokenizer.json"
    bpe = Tokenizer.from_file(str(tok))
    from chimera.data.text import cut

    want = []
    for doc in held:  # each file (the last one cut at the cap) in its pieces, then <|endoftext|>
        for piece in cut(doc.decode("utf-8", errors="replace")):
            want += bpe.encode(piece).ids
        want.append(0)
    assert val.tolist() == want
    corpus = open_data(DataSpec(None, tokenizer=str(tok)))
    assert np.array_equal(np.asarray(corpus.train), train) and np.array_equal(np.asarray(corpus.val), val)


# ---------------------------------------------------------------------------------------
# The formats table is the one place a format is defined

def test_every_format_detect_returns_has_one_entry(fmt, tmp_path):
    """Each format of the fixture (and a text folder, the stdlib) is detected as a name that
    is one entry of FORMATS, and every entry is some path's format; nothing in the data
    package compares a value with a format's name (it looks the entry up instead)."""
    import ast
    import pathlib

    from chimera.data import formats
    from chimera.data.formats import FORMATS, detect

    root = fmt[0]
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("some text\n")
    paths = {None: "stdlib", root / "text.txt": "text", tmp_path / "notes": "text",
             root / "tok": "token-folder", root / "u16.bin": "bin", root / "ids.npy": "npy",
             root / "docs.jsonl": "jsonl", root / "ds-ids": "datasets", root / "ds-text": "datasets"}
    found = {p: detect(DataSpec(None if p is None else str(p))) for p in paths}
    assert found == paths
    assert set(found.values()) == set(FORMATS)
    assert all(FORMATS[name].name == name for name in FORMATS)
    for module in pathlib.Path(formats.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(module.read_text())):
            if isinstance(node, ast.Compare):
                named = {c.value for c in ast.walk(node) if isinstance(c, ast.Constant)} & set(FORMATS)
                assert not named, f"{module.name}:{node.lineno} compares with {named}: use FORMATS"


def _toy_ids(spec, column, vocab, progress, eos=None):
    """A toy format: token ids written as decimal numbers."""
    from chimera.data.tokens import check_ids

    ids = np.array(open(spec.path).read().split(), dtype=np.int64)
    if vocab is not None:
        check_ids(ids, vocab, spec.path)
    return ids, None, None


def _toy_text(spec, check_size):
    """A toy format: the text of a file, shouted."""
    from chimera.data.text import doc_pieces

    return doc_pieces([open(spec.path).read().upper()]), None


def test_a_format_added_to_the_table_is_detected_described_and_opened(fmt, monkeypatch, tmp_path):
    """One entry (added after the text fallback, and still tried before it) is all a format
    needs: detect, describe, open_data, the flags' refusals, chimera tokenize and chimera
    train take it from the table."""
    from chimera.data.bpe import tokenize
    from chimera.data.formats import FORMATS, DataInfo, Format, describe, detect, file_suffix

    monkeypatch.setitem(FORMATS, "toy-ids", Format("toy-ids", file_suffix(".ids"), ids=_toy_ids))
    monkeypatch.setitem(FORMATS, "toy-text", Format("toy-text", file_suffix(".up"), pieces=_toy_text))
    root, text, ids, _ = fmt
    (tmp_path / "a.ids").write_text(" ".join(map(str, ids)))
    (tmp_path / "a.up").write_text(text)
    spec = DataSpec(str(tmp_path / "a.ids"), vocab_size=1000)
    assert detect(spec) == "toy-ids" and detect(DataSpec(str(tmp_path / "a.up"))) == "toy-text"
    assert describe(spec) == DataInfo("toy-ids", 1000, is_bytes=False, text=False)
    assert np.array_equal(open_data(spec).train, train_split(ids))
    with pytest.raises(ValueError, match="outside the vocabulary of 900 ids"):
        open_data(DataSpec(spec.path, vocab_size=900))
    with pytest.raises(ValueError, match="--token-dtype applies to .bin token files, not to"):
        describe(DataSpec(spec.path, token_dtype="uint16"))
    with pytest.raises(ValueError, match="holds token ids but no vocabulary size"):
        describe(DataSpec(spec.path))
    with pytest.raises(ValueError, match="holds token ids already"):
        tokenize(spec, tmp_path / "no", None)
    seen = train_batches(["--data", spec.path, "--vocab-size", "1000"], monkeypatch, tmp_path)
    assert_windows_of(seen, train_split(ids), 1000)

    shout = DataSpec(str(tmp_path / "a.up"))
    assert describe(shout) == DataInfo("toy-text", 256, is_bytes=True, text=True)
    corpus = open_data(shout)
    assert bytes(torch.cat([corpus.train, corpus.val]).tolist()) == (text.upper() + "\n").encode()
    tok = root / "tok" / "tokenizer.json"
    corpus = open_data(DataSpec(shout.path, tokenizer=str(tok)))
    assert np.array_equal(np.concatenate([corpus.train, corpus.val]), encode(tok, [text.upper()]))
    meta = tokenize(DataSpec(shout.path, tokenizer=str(tok)), tmp_path / "tok", None)
    assert meta["tokens"]["train"] == len(corpus.train) and detect(DataSpec(str(tmp_path / "tok"))) == "token-folder"


def test_a_format_entry_is_checked():
    """An entry that reads nothing, or a column without both readings, is refused."""
    from chimera.data.formats import Format, file_suffix

    with pytest.raises(ValueError, match="reads neither text"):
        Format("x", file_suffix(".x"))
    with pytest.raises(ValueError, match="a column chooses between text and ids"):
        Format("x", file_suffix(".x"), ids=_toy_ids, column=lambda spec: "text")
    with pytest.raises(ValueError, match="flags must be among"):
        Format("x", file_suffix(".x"), ids=_toy_ids, flags=("vocab_size",))
