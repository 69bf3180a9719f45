"""The round trip a Hugging Face user makes: `chimera tokenize`, `chimera train`, `chimera
export`, then transformers' AutoTokenizer and AutoModelForCausalLM on the folder: the run's
logits, an end-of-text token inside the model's vocabulary, a batch padded with it, HF
generate; and `chimera train --model hf:EXPORTED --data TEXT` through the folder's tokenizer."""

import json
import os
import stat

import pytest
import torch

from chimera.cli import main

TEXT = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(400))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One single-process run per kind of export: a GPT-2 preset on bytes and on a trained
    BPE, an HF Llama and an HF GPT-2 (a config.json) on the BPE; each exported."""
    from transformers import GPT2Config

    root = tmp_path_factory.mktemp("roundtrip")
    (root / "text.txt").write_text(TEXT)
    assert main(["tokenize", "--data", str(root / "text.txt"), "--vocab-size", "320",
                 "--out", str(root / "tok"), "--no-progress"]) == 0
    GPT2Config(vocab_size=320, n_embd=32, n_layer=2, n_head=2, n_positions=64).save_pretrained(root / "gcfg")
    runs = {"gpt2-tiny-bytes": ["--model", "gpt2-tiny", "--data", str(root / "text.txt")],
            "gpt2-tiny-bpe": ["--model", "gpt2-tiny", "--data", str(root / "tok")],
            "hf-llama-tiny": ["--model", "hf-llama-tiny", "--data", str(root / "tok"), "--seq-len", "32"],
            "hf-gpt2": ["--model", f"hf:{root / 'gcfg'}", "--data", str(root / "tok"), "--seq-len", "32"]}
    old = os.getcwd()
    os.chdir(root)
    try:
        for name, argv in runs.items():
            assert main(["train", "--schedule", "none", "--stages", "1", "--steps", "3",
                         "--no-progress", "--checkpoint-dir", str(root / name / "ck"), *argv]) == 0
            assert main(["export", "--checkpoint", str(root / name / "ck"),
                         "--out", str(root / name / "hf")]) == 0
    finally:
        os.chdir(old)
    return root, list(runs)


def test_every_export_loads_pads_with_eos_and_generates(runs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root, names = runs
    for name in names:
        folder = root / name / "hf"
        tok = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder).eval()
        config = json.loads((folder / "config.json").read_text())
        assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id < model.config.vocab_size, name
        assert config["eos_token_id"] == config["bos_token_id"] == tok.eos_token_id, name
        gen = json.loads((folder / "generation_config.json").read_text())
        assert gen["eos_token_id"] == tok.eos_token_id, name
        assert len(tok) <= model.config.vocab_size, name  # no id added outside the model
        tok.pad_token, tok.padding_side = tok.eos_token, "left"
        batch = tok(["def f1(x):\n", "def"], return_tensors="pt", padding=True)
        assert (batch["input_ids"][1, 0] == tok.eos_token_id) and batch["attention_mask"][1, 0] == 0
        out = model.generate(**batch, max_new_tokens=5, do_sample=False)
        assert out.shape == (2, batch["input_ids"].shape[1] + 5), name
        assert tok.decode(batch["input_ids"][0]) == "def f1(x):\n", name


def test_the_files_are_ordinary_and_the_logits_the_runs(runs):
    """Every file 0644 (as the umask allows); the preset's logits as our model computes them."""
    from transformers import AutoModelForCausalLM

    from chimera.models import build_model, get_config
    from chimera.train import checkpoint as ckpt

    root, names = runs
    umask = os.umask(0)
    os.umask(umask)
    for name in names:
        for p in (root / name / "hf").iterdir():
            assert stat.S_IMODE(p.stat().st_mode) == 0o666 & ~umask, (name, p.name)
    path = ckpt.latest(root / "gpt2-tiny-bpe" / "ck")
    ours = build_model(get_config("gpt2-tiny", vocab_size=320), 0).eval()
    ours.load_state_dict(ckpt.load_model_state(path))
    hf = AutoModelForCausalLM.from_pretrained(root / "gpt2-tiny-bpe" / "hf").eval()
    ids = torch.randint(0, 320, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids), rtol=1e-5, atol=1e-5)


def test_byte_export_encodes_text_as_its_bytes(runs):
    from transformers import AutoTokenizer

    root, _ = runs
    tok = AutoTokenizer.from_pretrained(root / "gpt2-tiny-bytes" / "hf")
    text = "héllo\n  wörld <b>"
    assert tok(text)["input_ids"] == list(text.encode("utf-8"))
    assert tok.decode(list(text.encode("utf-8"))) == text and tok.eos_token_id == 255


def test_training_an_export_on_text_uses_its_tokenizer(runs, monkeypatch, tmp_path):
    """`--model hf:EXPORTED --data TEXT` reads the text through the folder's tokenizer
    (the ids `chimera tokenize` wrote), not as bytes."""
    import numpy as np

    from chimera.train.loop import Trainer

    root, _ = runs
    seen = []
    real = Trainer.batch

    def batch(self, step):
        seen.append(real(self, step))
        return seen[-1]
    monkeypatch.setattr(Trainer, "batch", batch)
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--schedule", "none", "--stages", "1", "--steps", "1", "--no-progress",
                 "--model", f"hf:{root / 'hf-llama-tiny' / 'hf'}", "--data", str(root / "text.txt"),
                 "--seq-len", "32"]) == 0
    ids = np.fromfile(root / "tok" / "train.bin", "<u2")
    windows = np.lib.stride_tricks.sliding_window_view(ids.astype(np.int64), 32)
    for row in seen[0][0].numpy():
        assert (windows == row).all(axis=1).any()


def test_trained_weights_without_their_tokenizer_are_refused_on_text(runs, tmp_path, capsys):
    """hf:DIR with weights of 320 ids and no tokenizer.json: its ids are not bytes, so text
    is refused in one line (exit 2) instead of trained on as bytes."""
    import shutil

    root, _ = runs
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(root / "hf-llama-tiny" / "hf" / name, bare / name)
    with pytest.raises(SystemExit) as exc:
        main(["train", "--schedule", "none", "--stages", "1", "--steps", "1", "--no-progress",
              "--model", f"hf:{bare}", "--data", str(root / "text.txt"), "--seq-len", "32"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and "no tokenizer.json" in err[0], err


def test_a_llama_tokenizer_keeps_its_own_bos(tmp_path):
    """A tokenizer with <s> and </s> (Llama's) exports </s> as eos and <s> as bos, in the
    tokenizer's config and in config.json."""
    from tokenizers import AddedToken, Tokenizer, models

    from chimera.train.checkpoint import sha256_of
    from chimera.train.export_tokenizer import stamp_ids, write_tokenizer

    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "<unk>": 2}, unk_token="<unk>"))
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    tok.save(str(tmp_path / "tok.json"))
    meta = {"data": {"tokenizer": {"file": "tok.json", "sha256": sha256_of(tmp_path / "tok.json")}}}
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "config.json").write_text("{}")
    ids, notes = write_tokenizer(meta, tmp_path, tmp_path / "out", 8, 16)  # the checkpoint's copy
    stamp_ids(tmp_path / "out", ids)
    assert ids == {"eos": 4, "bos": 3} and notes == []
    special = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    assert (special["eos_token"], special["bos_token"]) == ("</s>", "<s>")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["eos_token_id"], config["bos_token_id"]) == (4, 3)
