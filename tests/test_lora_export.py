"""`chimera train --lora-rank` / `--freeze`, checkpoints and `chimera export` of adapters: the
merged folder (AutoModelForCausalLM) gives the logits of peft's PeftModel over the base export
and the adapter folder; resume keeps the adapters; a resume that changes what trains is
refused. Single-process runs (``--schedule none``, in this process); the pipelined gradients
are tests/test_lora.py's."""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("transformers", reason="chimera export needs transformers (pip install '.[hf]')")
peft = pytest.importorskip("peft", reason="the adapter folder is checked with peft (test extra)")

import torch  # noqa: E402

from chimera.cli import main  # noqa: E402
from chimera.errors import UserError  # noqa: E402
from chimera.train import checkpoint as ckpt  # noqa: E402

TEXT = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(200))
LORA = ["--lora-rank", "4", "--lora-alpha", "8"]
# (model flags, extra flags): Llama's q/v projections (the default targets); HF GPT-2's
# Conv1D c_attn (the default) and c_proj; a GPT-2 preset's attn.qkv with its embedding frozen
RUNS = {"llama": (["--model", "hf-llama-tiny", "--seq-len", "16"], LORA),
        "hf-gpt2": (["--seq-len", "16"], LORA + ["--lora-targets", "*.c_attn", "*.attn.c_proj"]),
        "preset": (["--model", "gpt2-tiny", "--seq-len", "16"], LORA + ["--freeze", "0.*"])}


def _train(root, name: str, *extra: str) -> int:
    model, tuning = RUNS[name]
    if name == "hf-gpt2":
        model = ["--model", f"hf:{root / 'gcfg'}", *model]
    return main(["train", "--schedule", "none", "--stages", "1", "--no-progress", "--data",
                 str(root / "text.txt"), "-B", "2", "--checkpoint-dir", str(root / name / "ck"),
                 *model, *tuning, *extra])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from transformers import GPT2Config

    root = tmp_path_factory.mktemp("lora-export")
    (root / "text.txt").write_text(TEXT)
    GPT2Config(vocab_size=257, n_embd=16, n_layer=2, n_head=2, n_positions=32).save_pretrained(root / "gcfg")
    old = os.getcwd()
    os.chdir(root)
    try:
        for name in RUNS:
            assert _train(root, name, "--steps", "2") == 0
            assert _train(root, name, "--steps", "3", "--resume") == 0  # adapters and AdamW back
            for how in ("merged", "base", "adapter"):
                flags = {"merged": [], "base": ["--no-merge-lora"], "adapter": ["--adapter-only"]}[how]
                assert main(["export", "--checkpoint", str(root / name / "ck"),
                             "--out", str(root / name / how), *flags]) == 0
    finally:
        os.chdir(old)
    return root


@pytest.mark.parametrize("name", list(RUNS))
def test_merged_export_equals_peft_on_the_base_and_adapters(runs, name):
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(runs / name / "merged").eval()
    base = AutoModelForCausalLM.from_pretrained(runs / name / "base").eval()
    ids = torch.randint(0, 257, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, before = merged(ids).logits, base(ids).logits
        got = peft.PeftModel.from_pretrained(base, runs / name / "adapter").eval()(ids).logits
    assert torch.allclose(got, want, atol=2e-5, rtol=1e-5), (got - want).abs().max()
    assert (want - before).abs().max() > 1e-4  # the adapters trained: merging changed the model
    files = sorted(p.name for p in (runs / name / "adapter").iterdir())
    assert files == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((runs / name / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0
    assert config["fan_in_fan_out"] == (name != "llama")  # HF GPT-2 stores Conv1D in x out


def test_checkpoint_holds_adamw_state_of_the_adapters_only(runs):
    """Frozen weights are saved (the base) but have no optimizer state; the resumed run
    continued from the adapters it saved (step 3 of 3)."""
    for name in RUNS:
        folder = ckpt.latest(runs / name / "ck")
        keys = ckpt.read_index(folder)
        optim = {k.split(".", 1)[1].rsplit(".", 1)[0] for k in keys if k.startswith("optim.")}
        model = {k[len("model."):] for k in keys if k.startswith("model.")}
        assert optim and all(".lora_" in k for k in optim), (name, sorted(optim)[:3])
        assert optim == {k for k in model if ".lora_" in k}, name
        assert json.loads((folder / "meta.json").read_text())["step"] == 3


def test_resume_refuses_a_change_of_what_trains(runs, capsys):
    old = os.getcwd()
    os.chdir(runs)
    try:
        with pytest.raises(SystemExit) as exit:
            _train(runs, "llama", "--steps", "4", "--resume", "--lora-rank", "8")
    finally:
        os.chdir(old)
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert "what trains" in err and "'rank': 4" in err and "'rank': 8" in err


def test_adapter_only_without_adapters_is_refused(runs, tmp_path, capsys):
    old = os.getcwd()
    os.chdir(runs)
    try:
        assert main(["train", "--schedule", "none", "--stages", "1", "--no-progress", "--steps",
                     "1", "--seq-len", "16", "--data", str(runs / "text.txt"), "-B", "2",
                     "--checkpoint-dir", str(tmp_path / "ck")]) == 0
    finally:
        os.chdir(old)
    with pytest.raises(SystemExit) as exit:
        main(["export", "--checkpoint", str(tmp_path / "ck"), "--out", str(tmp_path / "a"),
              "--adapter-only"])
    assert exit.value.code == 2 and "no LoRA adapters" in capsys.readouterr().err
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("name", ["llama", "preset"])
def test_generate_loads_the_adapters_merged(runs, name):
    """``chimera generate``'s model of a LoRA checkpoint computes the merged export's logits."""
    from transformers import AutoModelForCausalLM

    from chimera.train.generate import load

    loaded = load(runs / name / "ck")
    merged = AutoModelForCausalLM.from_pretrained(runs / name / "merged").eval()
    ids = torch.randint(0, 257, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = loaded.model(ids), merged(ids).logits
    got = got.logits if hasattr(got, "logits") else got
    assert torch.allclose(got, want, atol=2e-5, rtol=1e-5), (got - want).abs().max()


@pytest.mark.slow
def test_pipelined_sharded_run_resumes_on_another_schedule_and_exports(run_cli, tmp_path):
    """Spawned ranks: LoRA on chimera with the sharded optimizer (state of the adapters only,
    sliced over each stage's replicas), a checkpoint resumed on 1F1B unsharded, exported
    merged and as adapters that peft loads onto the base export with the same logits."""
    from transformers import AutoModelForCausalLM

    (tmp_path / "text.txt").write_text(TEXT)
    common = ["train", "--model", "hf-llama-tiny", "--seq-len", "16", "--data", tmp_path / "text.txt",
              "--lora-rank", "4", "-D", "2", "--no-progress", "--png", "", "--trace", "",
              "--checkpoint-dir", tmp_path / "ck"]
    first = run_cli(*common, "--steps", "2", "--shard-optimizer", timeout=600)
    assert first.returncode == 0, first.stderr
    assert "(sharded over each stage's replicas)" in first.stdout
    second = run_cli(*common, "--steps", "3", "--schedule", "1f1b", "--resume", timeout=600)
    assert second.returncode == 0, second.stderr
    for out, flags in (("merged", []), ("base", ["--no-merge-lora"]), ("adapter", ["--adapter-only"])):
        done = run_cli("export", "--checkpoint", tmp_path / "ck", "--out", tmp_path / out, *flags)
        assert done.returncode == 0, done.stderr
    ids = torch.randint(0, 257, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()(ids).logits
        base = AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval()
        got = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()(ids).logits
    assert torch.allclose(got, want, atol=2e-5, rtol=1e-5)


def test_preflight_shards_a_frozen_tie_and_refuses_lora_with_tensor_parallel(runs):
    """GPT-2's tied embedding and head: --shard-optimizer refuses the tie while it trains, not
    once it is frozen (LoRA, or --freeze naming either copy); LoRA with -T 2 is refused
    before any process starts."""
    from chimera.train.config import ConfigError, TrainConfig

    data = str(runs / "text.txt")
    sharded = dict(model=f"hf:{runs / 'gcfg'}", seq_len=16, data=data, stages=2,
                   shard_optimizer=True, steps=1)
    with pytest.raises(UserError, match="tied across stages"):
        TrainConfig(**sharded).preflight()
    TrainConfig(**sharded, lora_rank=4).preflight()
    TrainConfig(**sharded, freeze=("*.lm_head.*",)).preflight()
    TrainConfig(**sharded, freeze=("0.wte.*",)).preflight()
    with pytest.raises(ConfigError, match="--lora-rank with --tensor-parallel 2 is not supported"):
        TrainConfig(model="gpt2-tiny", data=data, tensor_parallel=2, lora_rank=4).preflight()


def test_bf16_master_with_frozen_weights_loads_in_one_dtype(runs, tmp_path):
    """bf16-master saves the trained parameters' float32 masters and the frozen ones in bf16:
    ``chimera generate`` reads both (the frozen exactly) into one float32 model."""
    from chimera.train.generate import load

    old = os.getcwd()
    os.chdir(runs)
    try:
        assert main(["train", "--schedule", "none", "--stages", "1", "--no-progress", "--steps",
                     "1", "--seq-len", "16", "--data", str(runs / "text.txt"), "-B", "2",
                     "--dtype", "bf16-master", "--freeze", "0.*",
                     "--checkpoint-dir", str(tmp_path / "ck")]) == 0
    finally:
        os.chdir(old)
    index = ckpt.read_index(ckpt.latest(tmp_path / "ck"))
    assert {index[k][1] for k in index if k.startswith("model.")} == {torch.bfloat16, torch.float32}
    assert {p.dtype for p in load(tmp_path / "ck").model.parameters()} == {torch.float32}


@pytest.mark.slow
def test_trainer_with_lora_or_frozen_weights_equals_one_process():
    """``chimera train``'s own check (spawned gloo ranks, float64): LoRA on chimera, frozen
    layers with the sharded optimizer on zb-v, and frozen sharded layers (a vocabulary-parallel
    embedding, column-parallel qkv) at T = 2, against the single-process run of the same
    config: gradients, losses, parameters after 3 AdamW steps, identical replicas."""
    from chimera.train import TrainConfig
    from chimera.train.equivalence import check_equivalence

    common = dict(model="gpt2-tiny", stages=2, micro_batches=4, dtype="float64", steps=3,
                  progress=False)
    reports = check_equivalence([
        TrainConfig(schedule="chimera", lora_rank=4, lora_targets=("*.attn.qkv", "*.mlp.fc"), **common),
        TrainConfig(schedule="zb-v", freeze=("0.*", "*.ln1.*"), shard_optimizer=True, **common)])
    reports += check_equivalence([TrainConfig(schedule="1f1b", tensor_parallel=2,
                                              freeze=("0.*", "*.attn.qkv.*"), **common)])
    for report in reports:
        assert not report["missing"] and report["replicas_identical"], report["config"]
        assert report["max_grad_rel_err"] < 1e-10 and report["max_loss_rel_err"] < 1e-10
        assert report["max_param_rel_err"] < 1e-10, report["max_param_rel_err"]
