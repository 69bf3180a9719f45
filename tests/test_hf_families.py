"""chimera.hf's Llama-like families beyond Llama, against HF's own model in float64: Qwen2
(q/k/v biases, a tied head), Mistral (sliding-window attention, a window of 4 in sequences
of up to 8), Qwen3 (q/k norms, head_dim apart from hidden / heads, a full and a sliding
layer), Gemma (an embedding scaled inside its module, RMSNorm by 1 + w, GELU, tied) and
Phi-3 (fused qkv and gate/up projections, partial rotary embeddings). Each is loaded from a save_pretrained folder, gives AutoModelForCausalLM's logits,
trains on every schedule as HF's model in one process, and exports back to a folder that
AutoModelForCausalLM loads with the same logits.

One run of virtual ranks per family (the transport is not the subject here) executes every
schedule; the tests below read its results.
"""

from __future__ import annotations

import copy
import functools

import pytest

pytest.importorskip("transformers", reason="chimera.hf needs transformers (pip install '.[hf]')")
pytest.importorskip("safetensors", reason="chimera.hf needs safetensors (pip install '.[hf]')")

import torch  # noqa: E402
from torch import nn  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import hf_models as hm  # noqa: E402
from ranks import run_ranks  # noqa: E402
from chimera import hf  # noqa: E402
from chimera.errors import UserError  # noqa: E402
from chimera.hf import layers as L  # noqa: E402
from chimera.runtime.boundary import call_layer  # noqa: E402

SCHEDULES = ("chimera", "1f1b", "zb-v", "chimera-zb")
N, B = 4, 2  # micro-batches, micro-batch size; D = 2


def _forward(layers, x):
    for layer in layers:
        x = call_layer(layer, x)
    return x


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Per family: the folder save_pretrained wrote (float64) and the model object."""
    root = tmp_path_factory.mktemp("families")
    out = {}
    for arch in hm.FAMILIES:
        model = hm.build(arch)
        model.save_pretrained(root / arch)
        out[arch] = (str(root / arch), model)
    return out


def _worker(rank: int, world: int, arch: str, folder: str, out: str) -> dict:
    res = {}
    for schedule in SCHEDULES:
        model = hf.load(folder, dtype=torch.float64, attn_implementation=hm.ATTN[arch])
        pipe = model.pipeline(schedule=schedule, stages=2, micro_batches=N, micro_batch_size=B)
        res[schedule] = hm.pipelined(model, pipe, arch, N * B)
        if schedule == "chimera":  # the trained pipeline's logits, and its export
            inputs, labels = hm.batch(arch, 9, N * B)
            _, logits = pipe.eval().eval_step(inputs, labels, return_outputs=True)
            res["export"] = {"logits": logits, "written": model.save_pretrained(pipe, out)}
    return res


@pytest.fixture(scope="module")
def runs(tmp_path_factory, saved):
    """family -> the two ranks' results (D=2, every schedule), and HF's one-process run."""
    out = {}
    for arch in hm.FAMILIES:
        folder = str(tmp_path_factory.mktemp(f"{arch}-run") / "export")
        ranks = run_ranks(functools.partial(_worker, arch=arch, folder=saved[arch][0], out=folder), 2)
        out[arch] = (ranks, hm.reference(copy.deepcopy(saved[arch][1]), arch, N * B))
    return out


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("arch", hm.FAMILIES)
def test_family_trains_as_hf_in_one_process(runs, arch, schedule):
    """Padded batches, a shorter sequence mid-run: the gradients of each of 3 AdamW steps,
    the losses and the parameters after them, on every rank's every copy (a tied head under
    both names), at 1e-10 (Gemma: 1e-5, its norms compute in float32, see hm.TOL32)."""
    ranks, ref = runs[arch]
    hm.check_pipelined([r[schedule] for r in ranks], ref, hm.tolerance(arch))
    assert {n for r in ranks for n, _ in r[schedule]["params"]} == set(ref["params"])


@pytest.mark.parametrize("arch", hm.FAMILIES)
def test_family_export_reloads_with_auto_model(runs, arch):
    """The trained pipeline's save_pretrained folder (rank 0 writes): AutoModelForCausalLM
    builds the family's own class from it and gives the pipeline's evaluation logits."""
    ranks, _ = runs[arch]
    written = ranks[0]["export"]["written"]
    assert written is not None and ranks[1]["export"]["written"] is None
    again = AutoModelForCausalLM.from_pretrained(written, dtype=torch.float64,
                                                 attn_implementation=hm.ATTN[arch]).eval()
    assert type(again).__name__ == hm.CLASSES[arch]
    inputs, _ = hm.batch(arch, 9, N * B)
    with torch.no_grad():
        want = again(**inputs).logits
    for rank in range(2):
        assert torch.allclose(ranks[rank]["export"]["logits"], want, **hm.TOL), rank


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("arch", hm.FAMILIES)
def test_family_layers_compute_auto_models_logits(arch, attn, tmp_path):
    """From the model object and from its folder: AutoModelForCausalLM's logits on a
    right-padded and a left-padded batch, at 1e-13 (eager HF gives NaN where a sliding
    window holds padding only; the layers give NaN at the same places)."""
    model = hm.build(arch, attn).eval()
    model.save_pretrained(tmp_path)
    auto = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64,
                                                attn_implementation=attn).eval()
    for left in (False, True):
        inputs, _ = hm.batch(arch, 5, 6, left=left)
        with torch.no_grad():
            want = auto(**inputs).logits
            for source in (model, str(tmp_path)):
                loaded = hf.load(source, dtype=torch.float64, attn_implementation=attn)
                got = _forward([m.eval() for m in loaded.layers()], inputs)
                assert torch.allclose(got, want, rtol=0, atol=1e-13, equal_nan=True), (source, left)


def test_sliding_window_is_honoured_where_the_family_has_it():
    """Mistral slides on every layer, Qwen3 on the layers config.layer_types names (from
    max_window_layers on), Qwen2 without use_sliding_window on none. The window changes the
    logits (the same weights with a window as long as the sequence give others), and a token
    more than 2 windows back (2 sliding layers) cannot reach a later position."""
    kinds = {arch: [type(m).__name__ for m in hf.load(hm.build(arch)).layers()] for arch in hm.FAMILIES}
    assert kinds["mistral"] == ["LlamaEmbed", "SlidingBlock", "SlidingBlock", "LlamaHead"]
    assert kinds["qwen3"] == ["LlamaEmbed", "LlamaBlock", "SlidingBlock", "LlamaHead"]
    assert kinds["qwen2"] == kinds["gemma"] == kinds["phi3"] == ["LlamaEmbed", "LlamaBlock", "LlamaBlock",
                                                                 "LlamaHead"]
    model = hm.build("mistral", "sdpa").eval()
    ids = torch.randint(4, hm.V, (2, hm.T), generator=torch.Generator().manual_seed(1))
    layers = [m.eval() for m in hf.load(model).layers()]
    wide = copy.deepcopy(model)
    wide.config.sliding_window = hm.T
    wide_layers = [m.eval() for m in hf.load(wide).layers()]
    other = ids.clone()
    other[:, 0] = (other[:, 0] + 1) % hm.V
    with torch.no_grad():
        got, full = _forward(layers, ids), _forward(wide_layers, ids)
        assert torch.equal(full, wide(input_ids=ids).logits)
        assert not torch.allclose(got, full)
        reach = 2 * (hm.WINDOW - 1)  # positions 0..6 can see token 0 through two layers
        changed = _forward(layers, other)
        assert torch.equal(changed[:, reach + 1:], got[:, reach + 1:])
        assert not torch.allclose(changed[:, reach], got[:, reach])


def test_export_in_one_process_equals_auto_model(tmp_path):
    """save_pretrained from a plain state dict (no processes): the file holds HF's own keys
    (Qwen2's tie once, its biases), and AutoModelForCausalLM reproduces the logits exactly."""
    from safetensors import safe_open

    for arch in hm.FAMILIES:
        model = hm.build(arch).eval()
        m = hf.load(model)
        m.save_pretrained(nn.Sequential(*m.layers()).state_dict(), tmp_path / arch)
        model.save_pretrained(tmp_path / f"{arch}-hf")
        with safe_open(f"{tmp_path / arch}/model.safetensors", framework="pt") as f, \
                safe_open(f"{tmp_path / arch}-hf/model.safetensors", framework="pt") as g:
            assert set(f.keys()) == set(g.keys()), arch
        again = AutoModelForCausalLM.from_pretrained(tmp_path / arch, dtype=torch.float64,
                                                     attn_implementation=hm.ATTN[arch]).eval()
        inputs, _ = hm.batch(arch, 1, 4)
        with torch.no_grad():
            assert torch.equal(again(**inputs).logits, model(**inputs).logits), arch
        biases = [k for k in m.hf_state_dict(nn.Sequential(*m.layers()).state_dict()) if "proj.bias" in k]
        assert len(biases) == (6 if arch == "qwen2" else 0), arch  # q, k, v in 2 layers


def test_families_refused_and_checked_in_one_line():
    """A family chimera.hf does not build is named with the supported list; window settings
    that do not describe the layers are refused; BERT refuses tensor parallelism naming the
    architectures that have a plan, and every family's plan names each of its projections."""
    from transformers import Gemma2Config, Olmo2Config

    supported = ("GPT2LMHeadModel, LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM, "
                 "Qwen3ForCausalLM, GemmaForCausalLM, Phi3ForCausalLM, BertForMaskedLM")
    for cfg, words in ((Olmo2Config(), "model_type 'olmo2'"), (Gemma2Config(), "model_type 'gemma2'")):
        with pytest.raises(UserError, match=f"^{words} is not supported \\(chimera.hf supports {supported}\\)$"):
            hf.load(cfg)
    named = Gemma2Config()
    named.architectures = ["Gemma2ForCausalLM"]
    with pytest.raises(UserError, match=f"architecture Gemma2ForCausalLM is not supported \\(chimera.hf supports {supported};"):
        hf.load(named)
    bad = hm.config("qwen3", "sdpa")
    bad.layer_types = ["full_attention", "chunked_attention"]
    with pytest.raises(UserError, match="layer_types \\['chunked_attention'\\] not supported"):
        hf.load(bad)
    bad = hm.config("mistral", "sdpa")
    bad.sliding_window = 0
    with pytest.raises(UserError, match="sliding_window must be a positive integer"):
        hf.load(bad)
    llama = hm.config("llama", "eager")
    llama.sliding_window = 4
    with pytest.raises(UserError, match="not supported for LlamaForCausalLM .*MistralForCausalLM"):
        hf.load(llama)
    bert = hf.load(hm.build("bert"))
    with pytest.raises(UserError, match="^tensor parallel: BERT has no tensor-parallel plan yet; GPT2LMHeadModel, "
                       "LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM, Qwen3ForCausalLM, "
                       "GemmaForCausalLM, Phi3ForCausalLM have one$"):
        bert.tp_plan(1, bert.make_layer(1))
    from chimera import tp

    for arch in hm.FAMILIES:  # every projection of the layer is planned
        model = hf.load(hm.build(arch))
        for index in range(model.num_layers):
            layer = model.make_layer(index)
            tp.resolve(layer, model.tp_plan(index, layer), 2)
        if arch == "gemma":  # its scaled embedding and the tied head stay whole
            assert [model.tp_plan(i, model.make_layer(i)) for i in (0, 3)] == [{}, {}]
        block = model.make_layer(1)
        assert isinstance(block, L.LlamaBlock)
        covered = {n for n in tp.resolve(block, model.tp_plan(1, block), 2)}
        linear = {n for n, m in block.named_modules() if isinstance(m, nn.Linear)}
        assert linear <= covered, linear - covered
        if arch == "qwen3":  # q, k, v gathered: the q/k norms see every head
            plan = model.tp_plan(1, block)
            assert {plan[f"layer.self_attn.{p}_proj"] for p in "qkv"} == {"colwise_gather_output"}


def test_raw_hf_decoder_layers_in_a_pipeline_point_to_chimera_hf():
    """HF decoder layers handed to Pipeline as plain layers (they take hidden states and a
    mask, return a tensor or a tuple, and attend to the future without a causal mask): one
    line that says to use chimera.hf."""
    from chimera.runtime.virtual import run_virtual
    import chimera.api as chimera

    model = hm.build("llama")

    def rank(_):
        layers = [copy.deepcopy(model.model.embed_tokens), *copy.deepcopy(model.model.layers),
                  copy.deepcopy(model.lm_head)]
        with pytest.raises(UserError) as info:
            chimera.Pipeline(layers, nn.functional.cross_entropy, "1f1b", stages=2)
        return str(info.value)

    for said in run_virtual(2, rank):
        assert "LlamaDecoderLayer" in said and "chimera.hf" in said and "\n" not in said, said
