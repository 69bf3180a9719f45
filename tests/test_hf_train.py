"""`chimera train` with Hugging Face models (`--model hf:PATH`, `hf-llama-tiny`, ...): the
trainer's pipelines against its single-process reference and that against HF's own model
(float64), checkpoints keyed by HF names resumed on another layout, export reloaded with
transformers, generate, and one-line refusals.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import shutil

import pytest

pytest.importorskip("transformers", reason="HF models need transformers (pip install '.[hf]')")
pytest.importorskip("safetensors", reason="HF models need safetensors (pip install '.[hf]')")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402
from transformers import BertConfig, GPT2Config  # noqa: E402

from chimera.cli import main  # noqa: E402
from chimera.data.formats import DataInfo  # noqa: E402
from chimera.models import get_config, layer_costs  # noqa: E402
from chimera.train import TrainConfig, build  # noqa: E402
from chimera.train import checkpoint as ckpt  # noqa: E402
from chimera.train.equivalence import check_virtual  # noqa: E402
from chimera.train.launch import _train  # noqa: E402
from chimera.train.loop import Trainer  # noqa: E402
from chimera.train.sources import open_source  # noqa: E402
from ranks import run_ranks  # noqa: E402

T = 8  # tokens per sequence in the float64 runs


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """Text to train on (bytes), and configs: a tiny GPT-2 (tied, vocabulary 300 > the data's
    256), a tiny BERT (tied decoder), a GPT-2 whose vocabulary is smaller than the data's."""
    root = tmp_path_factory.mktemp("hftrain")
    text = open(json.__file__.replace("__init__.py", "decoder.py"), "rb").read()
    (root / "text.txt").write_bytes((text * 8)[:60_000])
    quiet = dict(bos_token_id=None, eos_token_id=None)
    GPT2Config(vocab_size=300, n_embd=16, n_layer=2, n_head=4, n_positions=16, resid_pdrop=0.0,
               embd_pdrop=0.0, attn_pdrop=0.0, **quiet).save_pretrained(root / "gpt2")
    BertConfig(vocab_size=260, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
               intermediate_size=32, max_position_embeddings=16, hidden_dropout_prob=0.0,
               attention_probs_dropout_prob=0.0).save_pretrained(root / "bert")
    GPT2Config(vocab_size=100, n_embd=16, n_layer=2, n_head=4, n_positions=16,
               **quiet).save_pretrained(root / "small-vocab")
    return root


def cfg_of(root, model: str, **kw) -> TrainConfig:
    if model in ("gpt2", "bert"):
        model = f"hf:{root / model}"
    base = dict(model=model, dtype="float64", steps=3, micro_batch_size=2, seq_len=T,
                data=str(root / "text.txt"), clip=0.1, progress=False)  # clip 0.1: every step clips
    return TrainConfig(**{**base, **kw})


# -- the pipelines against the trainer's reference, float64 ------------------------------
CASES = [  # (model, schedule, D, extra)
    ("gpt2", "chimera", 2, {}), ("gpt2", "1f1b", 2, {}), ("gpt2", "chimera", 4, {}),
    ("gpt2", "1f1b", 4, {"recompute": True}),
    ("hf-llama-tiny", "chimera", 2, {}), ("hf-llama-tiny", "1f1b", 2, {}),
    ("hf-llama-tiny", "chimera", 4, {"recompute": True}), ("hf-llama-tiny", "1f1b", 4, {}),
    ("hf-llama-tiny", "chimera", 2, {"data_parallel": 2, "shard_optimizer": True}),
    ("bert", "chimera", 2, {}),
    # the Llama-like families' presets (hf-mistral-tiny: sequences longer than its window, 32)
    ("hf-qwen2-tiny", "zb-v", 2, {}), ("hf-mistral-tiny", "chimera-zb", 2, {"seq_len": 40}),
    ("hf-qwen3-tiny", "chimera", 2, {}), ("hf-phi3-tiny", "1f1b", 2, {}),
]


@pytest.mark.parametrize("model,schedule,d,extra", CASES,
                         ids=[f"{m}-{s}-D{d}{'-' + '-'.join(e) if e else ''}" for m, s, d, e in CASES])
def test_pipelines_match_the_single_process_reference(root, model, schedule, d, extra):
    """Gradients of the first step at 1e-10, the loss of each of 3 AdamW steps and the
    parameters after them; every copy of a tied weight (GPT-2's wte in the first and last
    stage, every replica) agrees with the reference's one Parameter. Clipping acts on every
    step, so the norm must count the tie once."""
    cfg = cfg_of(root, model, schedule=schedule, stages=d, micro_batches=d, **extra)
    r = check_virtual(cfg)
    assert r["missing"] == []
    assert r["max_grad_rel_err"] < 1e-10
    assert r["max_loss_rel_err"] < 1e-10
    # BERT's attention key biases start at zero and get gradients that are zero in exact
    # arithmetic (softmax ignores a shift of all scores): float64 noise, ~1e-21, that AdamW
    # turns into steps of ~1e-17, differing by run, so only their absolute error is small
    assert r["max_param_rel_err"] < 1e-10 or (model == "bert" and r["max_param_abs_err"] < 1e-15)
    assert r["replicas_identical"]
    if model == "gpt2":  # the tie: copies in both end stages, under one name
        assert r["max_replicas"] == 2 * r["min_replicas"]


@pytest.mark.parametrize("model", ["gpt2", "hf-llama-tiny", "bert", "hf-qwen2-tiny", "hf-mistral-tiny",
                                   "hf-qwen3-tiny", "hf-phi3-tiny"])
def test_the_reference_computes_hfs_own_model(root, model):
    """The trainer's single-process model is HF's: the same weights in HF's own model give
    the same loss and gradients (1e-10) on the trainer's batch (next-token targets; BERT's
    masked tokens)."""
    cfg = cfg_of(root, model, schedule="none", stages=1, micro_batches=1, micro_batch_size=4)
    trainer = Trainer(cfg)
    start = {n: p.detach().clone() for n, _, p in trainer.replica_parameters()}
    seen = {}
    log = trainer.step(0, on_grads=lambda t: seen.update(
        {n: p.grad.clone() for n, _, p in t.replica_parameters()}))
    source = trainer.source
    hf_model = getattr(transformers, source.arch)(copy.deepcopy(source.config)).double().train()
    missing, unexpected = hf_model.load_state_dict(start, strict=False)
    assert not unexpected and set(missing) <= set(hf_model.all_tied_weights_keys)  # tie targets
    inputs, targets = trainer.batch(0)
    logits = hf_model(input_ids=inputs).logits
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(log.loss, rel=1e-12)
    named = dict(hf_model.named_parameters())
    assert set(named) == set(seen)  # every parameter, HF's names, a tie once
    for name, p in named.items():
        torch.testing.assert_close(seen[name], p.grad, rtol=1e-10, atol=1e-13)


def test_a_save_pretrained_folder_gives_the_starting_weights(root, tmp_path):
    """hf:FOLDER with safetensors: every rank's every copy (the tied lm_head in the last
    stage too) and the single-process reference start from the saved tensors, bit for bit."""
    from chimera.runtime.virtual import run_virtual

    torch.manual_seed(3)
    saved = transformers.GPT2LMHeadModel(GPT2Config.from_pretrained(root / "gpt2")).double()
    saved.save_pretrained(tmp_path / "w")
    want = dict(saved.named_parameters())
    cfg = cfg_of(root, f"hf:{tmp_path / 'w'}", schedule="1f1b", stages=2, micro_batches=2)
    ranks = run_virtual(2, lambda rank: [(n, p.detach().clone())
                                         for n, _, p in Trainer(cfg).replica_parameters()])
    ref = Trainer(cfg_of(root, f"hf:{tmp_path / 'w'}", schedule="none", stages=1, micro_batches=1))
    got = [item for rank in ranks for item in rank] + [(n, p) for n, _, p in ref.replica_parameters()]
    assert {n for n, _ in got} == set(want)
    for name, p in got:
        assert torch.equal(p, want[name]), name


def test_presets_are_the_configs_they_name():
    """hf-gpt2-small is GPT-2's 124M config (at GPT-2's vocabulary; a preset takes the
    data's), tied; hf-llama-tiny a Llama with RoPE and grouped-query attention, untied."""
    ids = DataInfo(format="bin", vocab_size=50257, is_bytes=False, text=False)
    gpt2 = open_source("hf-gpt2-small", ids)
    counted = sum(p.numel() for p in gpt2.model.source.parameters())  # on meta: no memory
    assert counted == 124_439_808 and gpt2.seq_len == 1024 and gpt2.num_layers == 14
    assert gpt2.ties == (("0.wte.weight", "13.lm_head.weight"),)
    assert gpt2.key("13.lm_head.weight") == "transformer.wte.weight"
    # the balanced cut weighs layers as it does chimera's own GPT-2 of the same shape
    same = get_config("gpt2-small", vocab_size=50257)
    assert gpt2.layer_costs() == pytest.approx(layer_costs(same), rel=1e-12)
    llama = open_source("hf-llama-tiny", DataInfo(format="text", vocab_size=256, is_bytes=True,
                                                  text=True))
    c = llama.config
    assert (c.model_type, c.vocab_size, c.num_key_value_heads, c.num_attention_heads) == ("llama", 256, 2, 4)
    assert llama.ties == () and llama.kind == "gpt2" and llama.sums
    byte_text = DataInfo(format="text", vocab_size=256, is_bytes=True, text=True)
    qwen2, mistral, qwen3 = (open_source(f"hf-{f}-tiny", byte_text) for f in ("qwen2", "mistral", "qwen3"))
    assert (qwen2.arch, qwen2.config.vocab_size) == ("Qwen2ForCausalLM", 256)
    assert qwen2.ties == (("0.embed_tokens.weight", "5.lm_head.weight"),) == qwen3.ties
    assert any(n.endswith("q_proj.bias") for n in qwen2.model.source.state_dict())
    assert (mistral.arch, mistral.config.sliding_window, mistral.seq_len) == ("MistralForCausalLM", 32, 64)
    assert (qwen3.arch, qwen3.config.head_dim, qwen3.config.sliding_window) == ("Qwen3ForCausalLM", 32, None)
    assert all(callable(s.tp_plan()) for s in (qwen2, mistral, qwen3))


# -- checkpoints: HF names, a tie once, resumed on another layout ------------------------
def _run(cfg, rank):
    trainer = Trainer(cfg)
    logs = []
    _train(trainer, cfg, None, lambda t, step, log: logs.append(log))
    return [(log.step, log.loss) for log in logs]


def _resume_worker(rank, world, root):
    a = cfg_of(root, "gpt2", schedule="chimera", stages=2, steps=4, checkpoint_every=2,
               checkpoint_dir=str(root / "ck-a"))
    out = {"a": _run(a, rank)}
    if rank == 0:
        shutil.copytree(root / "ck-a" / "step-00000002", root / "ck-b" / "step-00000002")
    torch.distributed.barrier()
    b = dataclasses.replace(a, schedule="1f1b", checkpoint_dir=str(root / "ck-b"), resume=True)
    out["b"] = _run(b, rank)
    return out


@pytest.fixture(scope="module")
def resumed(root):
    """Processes: a checkpoint is written and read by torch.distributed.checkpoint."""
    out = run_ranks(functools.partial(_resume_worker, root=root), 2, processes=True)[0]
    shutil.copytree(root / "ck-a" / "step-00000002", root / "ck-ref" / "step-00000002")
    ref = cfg_of(root, "gpt2", schedule="none", stages=1, micro_batches=1, micro_batch_size=8,
                 steps=4, checkpoint_dir=str(root / "ck-ref"), resume=True)
    out["ref"] = _run(ref, 0)
    return out


@pytest.mark.slow
def test_checkpoints_are_keyed_by_hf_names_and_resume_on_any_layout(root, resumed):
    """chimera D=2 writes step 2 and 4; 1F1B D=2 and the single-process reference resume
    from step 2 and reach the same step 4 (losses and parameters, float64 1e-10). The
    checkpoint holds HF's parameter names, the tied wte/lm_head once."""
    assert [s for s, _ in resumed["a"]] == [0, 1, 2, 3]
    final = ckpt.load_model_state(root / "ck-a" / "step-00000004")
    hf_model = transformers.GPT2LMHeadModel(GPT2Config.from_pretrained(root / "gpt2"))
    assert set(final) == {n for n, _ in hf_model.named_parameters()}  # lm_head.weight: the tie
    for name in ("b", "ref"):
        assert [s for s, _ in resumed[name]] == [2, 3]
        for (_, got), (_, want) in zip(resumed[name], resumed["a"][2:]):
            assert got == pytest.approx(want, rel=1e-10)
        other = ckpt.load_model_state(root / f"ck-{name}" / "step-00000004")
        for key, value in final.items():
            torch.testing.assert_close(other[key], value, rtol=1e-10, atol=1e-12)


# -- the demo: tokenize, train, export, reload, generate -----------------------------------
@pytest.fixture(scope="module")
def demo(root, tmp_path_factory):
    """`chimera tokenize` on local text; `chimera train --model hf-llama-tiny` with
    --eval-every (in this process, one stage: the pipelines are checked above); `chimera
    export`."""
    out = tmp_path_factory.mktemp("demo")
    assert main(["tokenize", "--data", str(root / "text.txt"), "--vocab-size", "300",
                 "--out", str(out / "tok"), "--no-progress"]) == 0
    assert main(["train", "--model", "hf-llama-tiny", "--schedule", "none", "--stages", "1",
                 "--data", str(out / "tok"), "--seq-len", "16",
                 "--steps", "4", "-B", "2", "--eval-every", "2", "--eval-batches", "1",
                 "--checkpoint-dir", str(out / "ck"), "--log-json", str(out / "log.jsonl"),
                 "--no-progress", "--png", str(out / "t.png"), "--trace", str(out / "t.json")]) == 0
    assert main(["export", "--checkpoint", str(out / "ck"), "--out", str(out / "hf")]) == 0
    return out


def test_demo_trains_with_held_out_loss(demo):
    logs = [json.loads(line) for line in (demo / "log.jsonl").read_text().splitlines()]
    assert [log["step"] for log in logs] == [0, 1, 2, 3]
    held = [log["val_loss"] for log in logs if "val_loss" in log]
    assert len(held) == 2 and all(0 < v < 10 for v in held)


def test_export_reloads_with_transformers_same_logits(demo):
    """AutoModelForCausalLM.from_pretrained(export) gives the logits of the checkpoint's
    model (the run's own layers, loaded by chimera generate) to 1e-6 in float32."""
    from chimera.train.generate import load

    assert sorted(p.name for p in (demo / "hf").iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "special_tokens_map.json",
        "tokenizer.json", "tokenizer_config.json"]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(demo / "hf").eval()
    assert type(reloaded).__name__ == "LlamaForCausalLM" and reloaded.config.vocab_size == 300
    ours = load(demo / "ck")
    ids = torch.randint(0, 300, (3, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = ours.model(ids), reloaded(input_ids=ids).logits
    assert want.dtype == got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_generate_continues_with_the_runs_tokenizer(demo, capsys):
    from chimera.train.generate import generate

    out = generate(demo / "ck", "def ", max_new_tokens=5, temperature=0)
    assert out.codec.endswith("tokenizer.json") and len(out.new_ids) == 5
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(demo / "ck"), "--prompt", "def ",
                 "--max-new-tokens", "5", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.strip() == out.text.strip()


@pytest.mark.parametrize("preset,arch", [("hf-qwen2-tiny", "Qwen2ForCausalLM"),
                                         ("hf-mistral-tiny", "MistralForCausalLM"),
                                         ("hf-qwen3-tiny", "Qwen3ForCausalLM"),
                                         ("hf-gemma-tiny", "GemmaForCausalLM"),
                                         ("hf-phi3-tiny", "Phi3ForCausalLM")])
def test_family_presets_train_export_and_reload(root, tmp_path, preset, arch):
    """`chimera train --model hf-<family>-tiny` (sequences of 40: past Mistral's window of 32)
    and `chimera export`: AutoModelForCausalLM loads the family's class with the
    checkpoint's logits (the run's own layers), 1e-6 in float32."""
    from chimera.train.generate import load

    assert main(["train", "--model", preset, "--schedule", "none", "--stages", "1",
                 "--data", str(root / "text.txt"), "--seq-len", "40", "--steps", "2", "-B", "2",
                 "--checkpoint-dir", str(tmp_path / "ck"), "--no-progress"]) == 0
    assert main(["export", "--checkpoint", str(tmp_path / "ck"), "--out", str(tmp_path / "hf")]) == 0
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(reloaded).__name__ == arch
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = load(tmp_path / "ck").model(ids), reloaded(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


# -- BERT with its tokenizer's [MASK] --------------------------------------------------------
@pytest.fixture(scope="module")
def bert_tok(root):
    """A WordPiece tokenizer.json with BERT's special tokens ([MASK] is id 4), and a tiny
    BertForMaskedLM config of exactly its vocabulary (no room for an appended mask id)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator([(root / "text.txt").read_text()], trainers.WordPieceTrainer(
        vocab_size=300, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]))
    (root / "bert-tok").mkdir()
    tok.save(str(root / "bert-tok" / "tokenizer.json"))
    BertConfig(vocab_size=tok.get_vocab_size(), hidden_size=16, num_hidden_layers=2,
               num_attention_heads=4, intermediate_size=32, max_position_embeddings=16,
               hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
               ).save_pretrained(root / "bert-tok")
    return root / "bert-tok", tok.get_vocab_size()


def test_bert_pipeline_masks_with_the_tokenizers_mask(root, bert_tok):
    """hf:BERT with --tokenizer: the model's vocabulary is the tokenizer's (the config has
    no room for one more id), the masked inputs hold [MASK], and chimera D=2 matches the
    single-process reference (float64)."""
    folder, vocab = bert_tok
    cfg = cfg_of(root, f"hf:{folder}", tokenizer=str(folder / "tokenizer.json"),
                 schedule="chimera", stages=2, micro_batches=2)
    assert (build.mask_id(cfg.preflight()), build.model_source(cfg).vocab_size) == (4, vocab)
    inputs, targets = Trainer(dataclasses.replace(cfg, schedule="none", stages=1)).batch(0)
    assert (inputs[targets != -100] == 4).any() and int(inputs.max()) < vocab
    r = check_virtual(cfg)
    assert r["max_grad_rel_err"] < 1e-10 and r["max_loss_rel_err"] < 1e-10


def test_bert_export_keeps_its_mask_token(root, bert_tok, tmp_path, capsys):
    """The checkpoint records the mask id; export copies the tokenizer whose [MASK] it is,
    with no note; a tokenizer without a mask token gets a one-line note."""
    from chimera.train.export import _mask_note

    folder, _ = bert_tok
    tok = str(folder / "tokenizer.json")
    assert main(["train", "--model", f"hf:{folder}", "--tokenizer", tok, "--schedule", "none",
                 "--stages", "1", "--steps", "1", "-B", "2", "--seq-len", str(T),
                 "--data", str(root / "text.txt"), "--checkpoint-dir", str(tmp_path / "ck"),
                 "--no-progress", "--json"]) == 0
    meta = ckpt.verify(ckpt.latest(tmp_path / "ck"))
    assert meta["data"]["mask_id"] == 4
    assert main(["export", "--checkpoint", str(tmp_path / "ck"), "--out", str(tmp_path / "o")]) == 0
    assert "chimera export:" not in capsys.readouterr().err  # no note
    assert transformers.BertForMaskedLM.from_pretrained(tmp_path / "o").config.vocab_size == bert_tok[1]
    assert _mask_note({"data": {"mask_id": 4}}, tok) == []
    from tokenizers import Tokenizer, models

    plain = tmp_path / "plain.json"
    Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a")).save(str(plain))
    assert _mask_note({"data": {"mask_id": 2}}, str(plain)) == [
        "BERT was trained with mask id 2, tokenizer.json has no mask token: add a mask token "
        "at id 2 to use them together"]


# -- refusals, one line ------------------------------------------------------------------
def refused(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize("argv,words", [
    (["--model", "hf:{root}/small-vocab"], ["vocab_size 100", "256"]),
    (["--model", "hf:{root}/gpt2", "--shard-optimizer"], ["--shard-optimizer", "transformer.wte.weight"]),
    (["--model", "hf:{root}/nothing-here"], ["no such file"]),
    (["--model", "hf:"], ["config.json"]),
    (["--model", "hf-llama-tiny", "--seq-len", "512"], ["--seq-len 512", "256"]),
    (["--model", "hf-llama-tiny", "--stages", "4", "--partition", "0-1,2-5"], ["--partition"]),
    (["--model", "hf-llama-tiny", "--stages", "8"], ["6 layers"]),
])
def test_train_refuses_in_one_line(root, capsys, argv, words):
    argv = [a.replace("{root}", str(root)) for a in argv]
    line = refused(capsys, "train", "--data", str(root / "text.txt"), "--no-progress", *argv)
    assert line.startswith("chimera train: ")
    for word in words:
        assert word in line, line


def test_export_refuses_bert_presets_and_a_used_folder(root, tmp_path, capsys):
    assert main(["train", "--schedule", "none", "--stages", "1", "--steps", "1", "-B", "2",
                 "--model", "bert-tiny", "--data", str(root / "text.txt"), "--checkpoint-dir",
                 str(tmp_path / "ck"), "--no-progress", "--json"]) == 0
    line = refused(capsys, "export", "--checkpoint", str(tmp_path / "ck"), "--out", str(tmp_path / "o"))
    assert "bert-tiny" in line and "no Hugging Face twin" in line
    assert not (tmp_path / "o").exists()
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x").write_text("x")
    line = refused(capsys, "export", "--checkpoint", str(tmp_path / "ck"), "--out", str(tmp_path / "used"))
    assert "not an empty folder" in line
