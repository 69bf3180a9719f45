"""chimera.hf: HF GPT-2 (tied), Llama (RoPE, GQA, causal mask) and BERT (MLM) as pipelines,
against HF's own model trained in one process (float64), export and reload, partial loads.

One run per world size (virtual ranks: the transport is not the subject here) executes every
case; the tests below read its results.
"""

from __future__ import annotations

import functools
import json

import pytest

pytest.importorskip("transformers", reason="chimera.hf needs transformers (pip install '.[hf]')")
pytest.importorskip("safetensors", reason="chimera.hf needs safetensors (pip install '.[hf]')")

import torch  # noqa: E402
import transformers  # noqa: E402

import hf_models as hm  # noqa: E402
from ranks import run_ranks  # noqa: E402
from chimera import hf  # noqa: E402
from chimera.runtime.boundary import call_layer  # noqa: E402
from chimera.runtime.context import ExecOptions  # noqa: E402
from limits import limit

ARCHS = ("gpt2", "llama", "bert")
N, B = 4, 2  # micro-batches, micro-batch size
MAIN2 = ([(a, s, 2, 1) for a in ARCHS for s in ("chimera", "1f1b")]  # (arch, schedule, D, W)
         + [("gpt2", "zb-h1", 2, 1), ("llama", "zb-h1", 2, 1)])
MAIN4 = [(a, s, 4, 1) for a in ARCHS for s in ("chimera", "1f1b")] + [("llama", "chimera", 2, 2)]
RECOMPUTE = {("llama", "1f1b", 4, 1), ("bert", "chimera", 4, 1)}  # activation checkpointing


def _name(arch, schedule, d, w) -> str:
    return f"{arch}-{schedule}-{d}-{w}"


def _main_case(folders: dict, arch: str, schedule: str, d: int, w: int) -> dict:
    model = hf.load(folders[arch], dtype=torch.float64, attn_implementation=hm.ATTN[arch])
    pipe = model.pipeline(schedule=schedule, stages=d, data_parallel=w, micro_batches=N,
                          micro_batch_size=B,
                          options=ExecOptions(recompute=(arch, schedule, d, w) in RECOMPUTE))
    return hm.pipelined(model, pipe, arch, N * B * w)


def _export_case(folders: dict, arch: str, out: str) -> dict:
    """float32: one step, the pipeline's evaluation logits, then save_pretrained."""
    model = hf.load(folders[arch], attn_implementation=hm.ATTN[arch])
    pipe = model.pipeline(schedule="chimera", stages=2, micro_batches=N, micro_batch_size=B)
    opt = torch.optim.AdamW(pipe.parameters(), lr=hm.LR)
    pipe.step(*hm.batch(arch, 0, N * B))
    opt.step()
    inputs, labels = hm.batch(arch, 9, N * B)
    _, logits = pipe.eval().eval_step(inputs, labels, return_outputs=True)
    written = model.save_pretrained(pipe, f"{out}/{arch}")
    return {"logits": logits, "written": None if written is None else str(written)}


def _worker2(rank: int, world: int, folders: dict, out: str) -> dict:
    res = {_name(*c): _main_case(folders, *c) for c in MAIN2}
    res["export"] = {a: _export_case(folders, a, out + ".export") for a in ARCHS}
    return res


def _worker4(rank: int, world: int, folders: dict, out: str) -> dict:
    return {_name(*c): _main_case(folders, *c) for c in MAIN4}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Per architecture: the folder save_pretrained wrote (float64) and the model object."""
    return hm.saved(tmp_path_factory.mktemp("hf"), ARCHS)


def _run(tmp_path_factory, saved, worker, world: int) -> list[dict]:
    out = str(tmp_path_factory.mktemp("hfrun") / "res")
    folders = {a: f for a, (f, _) in saved.items()}
    return run_ranks(functools.partial(worker, folders=folders, out=out), world)


@pytest.fixture(scope="module")
def world2(tmp_path_factory, saved):
    return _run(tmp_path_factory, saved, _worker2, 2)


@pytest.fixture(scope="module")
def world4(tmp_path_factory, saved):
    return _run(tmp_path_factory, saved, _worker4, 4)


@pytest.fixture(scope="module")
def refs(saved):
    import copy

    return {(a, w): hm.reference(copy.deepcopy(saved[a][1]), a, N * B * w)
            for a in ARCHS for w in (1, 2) if w == 1 or a == "llama"}


@pytest.mark.parametrize("case", [_name(*c) for c in MAIN2])
def test_hf_model_trains_as_hf_in_one_process_d2(world2, refs, case):
    """Padded batches, a new sequence length mid-run, ties, GQA/RoPE, token types: the
    gradients of each of 3 AdamW steps and the parameters after them, at 1e-10."""
    hm.check_pipelined([r[case] for r in world2], refs[(case.split("-")[0], 1)])


@pytest.mark.parametrize("case", [_name(*c) for c in MAIN4])
def test_hf_model_trains_as_hf_in_one_process_d4(world4, refs, case):
    arch, w = case.split("-")[0], int(case.split("-")[-1])
    hm.check_pipelined([r[case] for r in world4], refs[(arch, w)])


def _expected_reads(saved_folder: str, model: hf.HFModel, held: list[int]) -> set[str]:
    """The file's keys of the held layers, plus the source of a tie a held layer ends."""
    from safetensors import safe_open

    with safe_open(f"{saved_folder}/model.safetensors", framework="pt") as f:
        keys = set(f.keys())
    layer = lambda k: int(model.pipeline_name(k).split(".", 1)[0])  # noqa: E731
    want = {k for k in keys if layer(k) in held}
    want |= {src for tgt, src in model.hf_ties.items() if layer(tgt) in held and tgt not in keys}
    return want


def test_each_rank_reads_only_the_tensors_of_its_stages(world2, world4, saved):
    """1F1B D=2: rank 0 holds stage 0, rank 1 stage 1; chimera D=4: rank r holds stages r and
    3-r. Each reads exactly its layers' keys (the head also its tie's source), nothing else
    (sizing the partition read nothing)."""
    for arch in ARCHS:
        model = hf.load(saved[arch][0])
        for runs, case in ((world2, _name(arch, "1f1b", 2, 1)), (world4, _name(arch, "chimera", 4, 1)),
                           (world4, _name(arch, "1f1b", 4, 1))):
            for rank, res in enumerate(r[case] for r in runs):
                want = _expected_reads(saved[arch][0], model, res["held"])
                assert set(res["read"]) == want, (case, rank)
                assert len(res["held"]) < model.num_layers, (case, rank)


def test_export_reloads_with_transformers_same_logits(world2, saved):
    """save_pretrained from the trained pipeline (float32): from_pretrained gives the logits
    the pipeline evaluated, 1e-6; the folder holds what HF's own save_pretrained writes."""
    from safetensors import safe_open

    for arch in ARCHS:
        written = world2[0]["export"][arch]["written"]
        assert written and world2[1]["export"][arch]["written"] is None
        cls = getattr(transformers, hm.CLASSES[arch])
        model = cls.from_pretrained(written, attn_implementation=hm.ATTN[arch]).eval()
        inputs, _ = hm.batch(arch, 9, N * B)
        with torch.no_grad():
            logits = model(**inputs).logits
        assert logits.dtype == torch.float32
        for rank in range(2):
            got = world2[rank]["export"][arch]["logits"]
            assert torch.allclose(got, logits, rtol=1e-6, atol=1e-6), (arch, (got - logits).abs().max())
        with safe_open(f"{written}/model.safetensors", framework="pt") as f, \
                safe_open(f"{saved[arch][0]}/model.safetensors", framework="pt") as g:
            assert set(f.keys()) == set(g.keys()), arch
        assert json.load(open(f"{written}/config.json"))["architectures"] == [hm.CLASSES[arch]]


@pytest.mark.slow
def test_hf_example_runs():
    import os
    import subprocess
    import sys

    root = os.path.join(os.path.dirname(__file__), "..")
    r = subprocess.run([sys.executable, os.path.join(root, "examples", "hf_llama.py")],
                       capture_output=True, text=True, timeout=limit(300),
                       env={**os.environ, "PYTHONPATH": os.path.join(root, "src")})
    assert r.returncode == 0, r.stderr
    assert "transformers reloads the export: its logits match" in r.stdout, r.stdout


# -- one process ----------------------------------------------------------------------------
def _forward(layers, x):
    for layer in layers:
        x = call_layer(layer, x)
    return x


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("arch", ARCHS)
def test_layers_compute_hf_forward(arch, attn, tmp_path):
    """The layers, from the model object and from its saved folder, give HF's logits on a
    right-padded batch (and a left-padded one with sdpa; eager float64 HF itself gives NaN
    on rows with no visible key)."""
    model = hm.build(arch, attn).eval()
    model.save_pretrained(tmp_path)
    for left in ((False, True) if attn == "sdpa" else (False,)):
        inputs, _ = hm.batch(arch, 5, 6, left=left)
        with torch.no_grad():
            want = model(**inputs).logits
            for source in (model, str(tmp_path)):
                loaded = hf.load(source, dtype=torch.float64, attn_implementation=attn)
                layers = [m.eval() for m in loaded.layers()]
                assert torch.allclose(_forward(layers, inputs), want, rtol=0, atol=1e-13), (source, left)


def test_packed_sequences_and_prefixless_keys(tmp_path):
    """Position ids that restart, no mask (packed sequences): as HF's forward, block-diagonal
    attention with config.use_cache=False, plain causal (HF makes a cache, which skips the
    detection) with use_cache=True; the original GPT-2 files' keys (no "transformer." prefix) load."""
    ids = torch.randint(4, hm.V, (2, 8), generator=torch.Generator().manual_seed(0))
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 0, 1]])
    got = {}
    for arch in ("llama", "gpt2"):
        for use_cache in (True, False):
            model = hm.build(arch, "sdpa").eval()
            model.config.use_cache = use_cache
            layers = [m.eval() for m in hf.load(model).layers()]
            with torch.no_grad():
                want = model(input_ids=ids, position_ids=pos).logits
                got[use_cache] = _forward(layers, {"input_ids": ids, "position_ids": pos})
            assert torch.equal(got[use_cache], want), (arch, use_cache)
        assert not torch.allclose(got[True], got[False]), arch  # the packing mattered
    from safetensors.torch import save_file

    gpt2 = hm.build("gpt2", "eager").eval()
    state = {k.removeprefix("transformer."): v for k, v in gpt2.state_dict().items()
             if k != "lm_head.weight"}
    save_file(state, str(tmp_path / "model.safetensors"))
    gpt2.config.save_pretrained(tmp_path)
    inputs, _ = hm.batch("gpt2", 2, 3)
    loaded = hf.load(tmp_path, dtype=torch.float64, attn_implementation="eager")
    with torch.no_grad():
        assert torch.equal(_forward([m.eval() for m in loaded.layers()], inputs), gpt2(**inputs).logits)
    assert "wte.weight" in loaded.read_keys


def test_causal_mask_is_applied():
    """The trap: Llama's eager decoder layers called one by one without a mask attend to the
    future. Changing the last token leaves every earlier logit of the layers unchanged (and
    BERT's, bidirectional, changes)."""
    for arch, causal in (("llama", True), ("gpt2", True), ("bert", False)):
        layers = [m.eval() for m in hf.load(hm.build(arch, "eager")).layers()]
        inputs, _ = hm.batch(arch, 3, 4)
        inputs["attention_mask"][:] = 1
        other = {k: v.clone() for k, v in inputs.items()}
        other["input_ids"][:, -1] = (other["input_ids"][:, -1] + 1) % hm.V
        with torch.no_grad():
            a, b = _forward(layers, inputs), _forward(layers, other)
        assert torch.equal(a[:, :-1], b[:, :-1]) == causal, arch


def test_loss_is_hfs_loss_in_float32():
    """loss_fn / token_count is HF's own labels= loss (float32, where HF computes it), with
    HF's labels or with targets already shifted (labels_shifted=True)."""
    for arch in ARCHS:
        model = hm.build(arch, dtype=torch.float32).eval()
        inputs, labels = hm.batch(arch, 4, 6)
        with torch.no_grad():
            out = model(**inputs, labels=labels)
        m = hf.load(model)
        ours = m.loss_fn(out.logits, labels) / m.token_count(labels)
        assert torch.allclose(ours, out.loss, rtol=1e-6, atol=0), arch
        if arch != "bert":  # targets already the next tokens (chimera train's batches): no shift
            m = hf.load(model, labels_shifted=True)
            with torch.no_grad():
                logits = model(**{k: v[:, :-1] for k, v in inputs.items()}).logits
            ours = m.loss_fn(logits, labels[:, 1:]) / m.token_count(labels[:, 1:])
            assert torch.allclose(ours, out.loss, rtol=1e-6, atol=0), arch


def test_sharded_checkpoint_and_config_only(tmp_path):
    """A sharded folder (index.json) loads the same layers; a config.json alone (file or
    folder) builds HF-initialized layers, the same on every call (seeded per layer)."""
    model = hm.build("llama").eval()
    model.save_pretrained(tmp_path / "sharded", max_shard_size="8KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    inputs, _ = hm.batch("llama", 5, 3)
    with torch.no_grad():
        want = model(**inputs).logits
        got = _forward([m.eval() for m in hf.load(tmp_path / "sharded", dtype=torch.float64,
                                                   attn_implementation="eager").layers()], inputs)
    assert torch.allclose(got, want, rtol=0, atol=1e-13)
    model.config.save_pretrained(tmp_path / "cfg")
    for source in (tmp_path / "cfg", tmp_path / "cfg" / "config.json"):
        a, b = (nn_state(hf.load(source).layers()) for _ in range(2))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert all(v.dtype == torch.float32 for v in a.values() if v.is_floating_point())


def nn_state(layers) -> dict:
    return torch.nn.Sequential(*layers).state_dict()


def test_export_in_one_process_reloads(tmp_path):
    """hf_state_dict/save_pretrained from a plain state dict (no processes): HF's keys, ties
    once, and from_pretrained reproduces the logits exactly."""
    for arch in ARCHS:
        model = hm.build(arch, "eager").eval()
        m = hf.load(model)
        m.save_pretrained(nn_state(m.layers()), tmp_path / arch)
        again = getattr(transformers, hm.CLASSES[arch]).from_pretrained(
            tmp_path / arch, dtype=torch.float64, attn_implementation="eager").eval()
        inputs, _ = hm.batch(arch, 1, 4)
        with torch.no_grad():
            assert torch.equal(again(**inputs).logits, model(**inputs).logits), arch


def test_refused_with_one_line(tmp_path):
    """Unsupported architectures and configs, non-local or non-safetensors sources, weights
    that do not fit the config: a ValueError naming the problem (and what is supported)."""
    from transformers import BertForSequenceClassification, Gemma2Config, MixtralConfig

    for cfg, words in ((Gemma2Config(), "model_type 'gemma2'"), (MixtralConfig(), "model_type 'mixtral'")):
        for arch in (None, "LlamaForCausalLM"):
            supported = (".*supports GPT2LMHeadModel, LlamaForCausalLM, Qwen2ForCausalLM, "
                         "MistralForCausalLM, Qwen3ForCausalLM, GemmaForCausalLM, Phi3ForCausalLM, "
                         "BertForMaskedLM")
            with pytest.raises(ValueError, match=words + supported):
                hf.load(cfg, architecture=arch)
    llama = hm.config("llama", "eager")
    bad = [(dict(sliding_window=8), "sliding-window"), (dict(num_local_experts=4), "mixture-of-experts"),
           (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
            "rope_type 'dynamic'")]
    for change, words in bad:
        cfg = hm.config("llama", "eager")
        for k, v in change.items():
            setattr(cfg, k, v)
        with pytest.raises(ValueError, match=words):
            hf.load(cfg)
    bert = hm.config("bert", "eager")
    bert.is_decoder = True
    with pytest.raises(ValueError, match="is_decoder=True"):
        hf.load(bert)
    with pytest.raises(ValueError, match="BertForSequenceClassification is not supported"):
        hf.load(BertForSequenceClassification(hm.config("bert", "eager")))
    named = hm.config("bert", "eager")
    named.architectures = ["BertForSequenceClassification"]
    with pytest.raises(ValueError, match="architecture BertForSequenceClassification is not supported"):
        hf.load(named)
    with pytest.raises(ValueError, match="'flash_attention_2' is not supported"):
        hf.load(llama, attn_implementation="flash_attention_2")
    with pytest.raises(ValueError, match="no such file or folder .*local files only"):
        hf.load(tmp_path / "meta-llama/Llama-2-7b")
    (tmp_path / "bin").mkdir()
    hm.config("gpt2", "eager").save_pretrained(tmp_path / "bin")
    (tmp_path / "bin" / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="only safetensors weights are read, found pytorch_model.bin"):
        hf.load(tmp_path / "bin")
    small = hm.build("gpt2")
    small.save_pretrained(tmp_path / "gpt2")
    wide = hm.config("gpt2", "eager")
    wide.n_embd = 32
    wide.save_pretrained(tmp_path / "gpt2")
    with pytest.raises(ValueError, match="has shape .* the config makes"):
        hf.load(tmp_path / "gpt2").layers()
    from safetensors.torch import save_file

    state = {k: v for k, v in small.state_dict().items()
             if k not in ("lm_head.weight", "transformer.ln_f.bias")}
    save_file(state, str(tmp_path / "gpt2" / "model.safetensors"))
    small.config.save_pretrained(tmp_path / "gpt2")
    with pytest.raises(ValueError, match="no tensor transformer.ln_f.bias .*do not match the config"):
        hf.load(tmp_path / "gpt2").layers()
    with pytest.raises(ValueError, match="labels must be \\(batch, length\\)"):
        hf.causal_lm_loss(torch.zeros(2, 5, hm.V), torch.zeros(2, 4, dtype=torch.long))
    layer0 = hf.load(hm.build("llama")).make_layer(0)
    with pytest.raises(ValueError, match="4-D masks are not supported"):
        layer0(torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 1, 3, 3))
    with pytest.raises(ValueError, match="unexpected key\\(s\\) \\['token_type_ids'\\]"):
        zeros = torch.zeros(1, 3, dtype=torch.long)
        layer0({"input_ids": zeros, "token_type_ids": zeros})
