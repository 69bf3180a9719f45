"""`chimera generate`: a checkpoint samples deterministically; greedy is the argmax of the
model's own logits; bad input is refused in one line. (The checkpoint is trained in this
process: a checkpoint is one format whichever layout wrote it, test_checkpoint.py.)"""

import contextlib
import io
import json
import os
import shutil

import pytest
import torch

from chimera.cli import main
from chimera.models import build_model, get_config
from chimera.train import TrainConfig
from chimera.train import checkpoint as ckpt
from chimera.train.generate import generate

TEXT = "the quick brown fox jumps over the lazy dog. " * 400


@pytest.fixture(autouse=True)
def one_thread():
    """As `chimera generate` runs (--threads 1): a tiny model decodes fastest on one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """`chimera train` in this process (one stage), a checkpoint every 10 steps, held-out
    loss too."""
    root = tmp_path_factory.mktemp("run")
    (root / "rep.txt").write_text(TEXT)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["train", "--schedule", "none", "--stages", "1", "--data", str(root / "rep.txt"),
                     "--steps", "30", "--eval-every", "10", "--eval-batches", "2",
                     "--checkpoint-dir", str(root / "ck"), "--checkpoint-every", "10",
                     "--log-json", str(root / "log.jsonl"), "--no-progress",
                     "--png", str(root / "t.png"), "--trace", str(root / "t.json")])
    assert code == 0
    return root, out.getvalue()


def direct_greedy(path, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding written out: the single-device model, argmax of its last logits."""
    model = build_model(get_config("gpt2-tiny"), 0)
    model.load_state_dict(ckpt.load_model_state(path))
    model.eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids[-32:]]))  # (1, T, 256)
            ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt):]


def refused(capsys, *args) -> str:
    """Run the CLI in this process; it must exit 2 with one line on stderr."""
    with pytest.raises(SystemExit) as exc:
        main(["generate", *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("chimera generate"), err
    return err[0]


def test_train_reports_the_held_out_loss(run):
    root, stdout = run
    assert "held-out loss" in stdout
    lines = [json.loads(l) for l in (root / "log.jsonl").read_text().splitlines()]
    held = [(l["step"], l["val_loss"]) for l in lines if "val_loss" in l]
    assert [s for s, _ in held] == [9, 19, 29]
    assert held[-1][1] < held[0][1]


def test_greedy_is_the_argmax_of_the_models_logits(run):
    root, _ = run
    out = generate(root / "ck", "the quick brown ", max_new_tokens=24, temperature=0)
    assert out.step == 30 and out.checkpoint.endswith("step-00000030")  # the newest
    assert out.prompt_ids == list(b"the quick brown ")
    assert out.new_ids == direct_greedy(root / "ck" / "step-00000030", out.prompt_ids, 24)
    assert out.text == "the quick brown " + out.completion
    top1 = generate(root / "ck", "the quick brown ", 24, temperature=1.0, top_k=1, seed=5)
    assert top1.new_ids == out.new_ids  # the one most likely token, whatever the draw


@pytest.mark.slow
def test_the_command_prints_the_same_continuation(run, run_cli):
    root, _ = run
    r = run_cli("generate", "--checkpoint", str(root / "ck" / "step-00000010"), "--prompt",
                "the lazy", "--temperature", "0", "--max-new-tokens", "16", "--json")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["step"] == 10 and got["tokens"] == "bytes" and got["cropped"] == 0
    assert got["new_ids"] == direct_greedy(root / "ck" / "step-00000010", list(b"the lazy"), 16)
    plain = run_cli("generate", "--checkpoint", str(root / "ck" / "step-00000010"), "--prompt",
                    "the lazy", "--temperature", "0", "--max-new-tokens", "16")
    assert plain.stdout == got["text"] + "\n"


def test_sampling_is_deterministic_with_a_seed(run):
    root, _ = run
    a = generate(root / "ck", "the ", 40, temperature=2.0, seed=1)
    b = generate(root / "ck", "the ", 40, temperature=2.0, seed=1)
    c = generate(root / "ck", "the ", 40, temperature=2.0, seed=2)
    assert a.new_ids == b.new_ids and a.text == b.text
    assert a.new_ids != c.new_ids  # T=2 flattens the distribution: 40 equal draws won't happen
    assert all(0 <= i < 256 for i in a.new_ids)


def test_a_long_prompt_keeps_its_last_context_tokens(run, capsys):
    root, _ = run
    prompt = "over the lazy dog. " * 4  # 76 bytes, context 32
    out = generate(root / "ck", prompt, 10, temperature=0)
    assert out.cropped == 76 - 32 and "cropped 44 from the left" in out.notes[0]
    assert out.new_ids == generate(root / "ck", prompt[-32:], 10, temperature=0).new_ids
    assert out.text.startswith(prompt)  # the whole prompt is printed
    main(["generate", "--checkpoint", str(root / "ck"), "--prompt", prompt,
          "--max-new-tokens", "3"])
    assert "cropped 44 from the left" in capsys.readouterr().err


def test_missing_empty_and_corrupt_checkpoints_are_refused(run, tmp_path, capsys):
    root, _ = run
    assert "no such directory" in refused(capsys, "--checkpoint", str(tmp_path / "nope"), "--prompt", "x")
    (tmp_path / "empty").mkdir()
    assert "no checkpoint in it" in refused(capsys, "--checkpoint", str(tmp_path / "empty"),
                                            "--prompt", "x")
    bad = tmp_path / "bad" / "step-00000030"
    shutil.copytree(root / "ck" / "step-00000030", bad)
    shard = next(p for p in bad.iterdir() if p.suffix == ".distcp")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert "is corrupt" in refused(capsys, "--checkpoint", str(tmp_path / "bad"), "--prompt", "x")
    (bad / "meta.json").write_text("{not json")
    assert "unreadable meta.json" in refused(capsys, "--checkpoint", str(bad), "--prompt", "x")


def test_bad_prompts_and_settings_are_refused(run, capsys):
    root, _ = run
    ck = str(root / "ck")
    assert "--prompt is empty" in refused(capsys, "--checkpoint", ck, "--prompt", "")
    assert "--temperature" in refused(capsys, "--checkpoint", ck, "--prompt", "x", "--temperature", "-1")
    assert "--temperature" in refused(capsys, "--checkpoint", ck, "--prompt", "x", "--temperature", "nan")
    assert "--top-k" in refused(capsys, "--checkpoint", ck, "--prompt", "x", "--top-k", "0")
    assert "--max-new-tokens" in refused(capsys, "--checkpoint", ck, "--prompt", "x",
                                         "--max-new-tokens", "0")


def test_a_bert_checkpoint_is_refused(tmp_path, capsys):
    from chimera.train.launch import launch

    (tmp_path / "rep.txt").write_text(TEXT)
    launch(TrainConfig(model="bert-tiny", schedule="none", stages=1, steps=1, progress=False,
                       data=str(tmp_path / "rep.txt"), checkpoint_dir=str(tmp_path / "ck")))
    line = refused(capsys, "--checkpoint", str(tmp_path / "ck"), "--prompt", "x")
    assert "BERT masked-LM" in line and "GPT-2" in line


# -- the tokenizer hook --------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    """A byte-level BPE of at most 200 tokens (ids fit the byte model's 256), trained here."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.train_from_iterator([TEXT], tokenizers.trainers.BpeTrainer(vocab_size=200))
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path, tok


def _with_tokenizer(root, tmp_path, record):
    """A copy of the run's checkpoint whose meta.json records ``record`` as its tokenizer
    (what a run with a tokenizer writes; meta.json is not among its own hashed files)."""
    step = tmp_path / "ck" / "step-00000030"
    shutil.copytree(root / "ck" / "step-00000030", step)
    meta = json.loads((step / "meta.json").read_text())
    meta["data"]["tokenizer"] = record
    (step / "meta.json").write_text(json.dumps(meta))
    return step


def test_the_recorded_tokenizer_encodes_and_decodes(run, tokenizer_file, tmp_path, capsys):
    root, _ = run
    path, tok = tokenizer_file
    record = ckpt.tokenizer_record(type("Cfg", (), {"tokenizer": str(path)})())
    assert record == {"file": "tokenizer.json", "source": str(path.resolve()),
                      "sha256": ckpt.sha256_of(path)}
    # a checkpoint written before it kept a copy names the file (tests/test_portable.py: a copy)
    step = _with_tokenizer(root, tmp_path, {"path": record["source"], "sha256": record["sha256"]})
    out = generate(step, "the quick", 5, temperature=0)
    assert out.codec == str(path.resolve())
    assert out.prompt_ids == tok.encode("the quick").ids and len(out.prompt_ids) < 9
    assert out.text == tok.decode(out.prompt_ids + out.new_ids)
    assert all(i < tok.get_vocab_size() for i in out.new_ids)  # only ids it can decode
    path.write_text(path.read_text().replace('"vocab"', '"vocab" ', 1))  # any edit
    assert "changed since the run" in refused(capsys, "--checkpoint", str(step), "--prompt", "x")
    assert generate(step, "the quick", 5, temperature=0, tokenizer=str(path)).new_ids == out.new_ids
    os.remove(path)
    assert "is gone" in refused(capsys, "--checkpoint", str(step), "--prompt", "x")


def test_a_tokenizer_larger_than_the_model_is_refused(run, tmp_path, capsys):
    tokenizers = pytest.importorskip("tokenizers")
    root, _ = run
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel()
    tok.train_from_iterator([TEXT + "".join(chr(c) for c in range(256, 600))],
                            tokenizers.trainers.BpeTrainer(vocab_size=400))
    tok.save(str(tmp_path / "big.json"))
    line = refused(capsys, "--checkpoint", str(root / "ck"), "--prompt", "x", "--tokenizer",
                   str(tmp_path / "big.json"))
    assert "more than the model's vocabulary of 256" in line


@pytest.mark.slow
def test_a_batch_of_prompts_a_stop_token_and_the_start_up_time(run, run_cli):
    """Several --prompt run as one batch, each as it would alone; --stop-token ends a row
    (not printed); stderr reports the start-up time."""
    root, _ = run
    ck = str(root / "ck")
    alone = [generate(ck, p, 12, temperature=0).new_ids for p in ("the lazy", "fox")]
    r = run_cli("generate", "--checkpoint", ck, "--prompt", "the lazy", "--prompt", "fox",
                "--temperature", "0", "--max-new-tokens", "12", "--json")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [row["new_ids"] for row in rows] == alone and not any(row["stopped"] for row in rows)
    assert "start-up" in r.stderr and rows[0]["startup_s"] > 0
    stop = bytes([alone[0][4]]).decode()
    cut = generate(ck, "the lazy", 12, temperature=0, stop=stop)
    assert cut.stopped and cut.new_ids == alone[0][:alone[0].index(alone[0][4])]


@pytest.mark.slow
def test_unbounded_lengths_invalid_utf8_and_bad_top_p_are_refused(run, cli_env, capsys):
    root, _ = run
    ck = str(root / "ck")
    assert "--max-new-tokens" in refused(capsys, "--checkpoint", ck, "--prompt", "x",
                                         "--max-new-tokens", "1000000000000")
    assert "--top-p" in refused(capsys, "--checkpoint", ck, "--prompt", "x", "--top-p", "0")
    assert "--top-p" in refused(capsys, "--checkpoint", ck, "--prompt", "x", "--top-p", "nan")
    assert "--stop-token" in refused(capsys, "--checkpoint", ck, "--prompt", "x", "--stop-token", "ab")
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "chimera", "generate", "--checkpoint", ck,
                        "--prompt", b"ab\xffcd"], capture_output=True, env=cli_env)
    err = r.stderr.decode().strip().splitlines()
    assert r.returncode == 2 and len(err) == 1 and "not valid UTF-8" in err[0], err
