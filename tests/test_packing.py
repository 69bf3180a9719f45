"""Documents packed into one sequence and kept apart (chimera.models.packing, ``--doc-mask``):
a packed row gives each document the per-token losses and gradients it has alone (float64,
1e-12) in chimera's GPT-2 and the Hugging Face decoders; a pipelined run equals one process
with the option on; held-out evaluation keeps documents apart too; off, the inputs are the ids
as before."""

import dataclasses
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from chimera.data.formats import DataInfo
from chimera.models.packing import document_mask, document_positions, document_segments
from chimera.train import ConfigError, TrainConfig, build
from chimera.train.equivalence import check_virtual, reference_config
from chimera.train.loop import Trainer
from chimera.train.sources import open_source

EOS, V = 0, 50
INFO = DataInfo("bin", V, False, False, eos_id=EOS)


def test_segments_positions_and_mask():
    ids = torch.tensor([[5, 6, EOS, 7, EOS, 8, 9]])
    seg = document_segments(ids, EOS)
    assert seg.tolist() == [[0, 0, 0, 1, 1, 2, 2]]
    assert document_positions(seg).tolist() == [[0, 1, 2, 0, 1, 0, 1]]
    mask = document_mask(seg)[0, 0]
    assert mask[4].tolist() == [False, False, False, True, True, False, False]
    assert mask[1].tolist() == [True, True, False, False, False, False, False]


def _row(lengths, T, seed=1, vocab=V):
    """A packed window of T + 1 ids (documents of ``lengths`` ids, each ended by EOS, the last
    cut by the window's end): inputs (1, T), targets (1, T), and the spans [start, end) of
    the inputs' documents."""
    gen = torch.Generator().manual_seed(seed)
    docs = [torch.cat([torch.randint(1, vocab, (n,), generator=gen), torch.tensor([EOS])]) for n in lengths]
    window = torch.cat(docs)[:T + 1]
    ends = torch.cumsum(torch.tensor([len(d) for d in docs]), 0).tolist()
    spans = [(lo, min(hi, T)) for lo, hi in zip([0, *ends[:-1]], ends) if lo < T]
    assert len(window) == T + 1 and spans[-1][1] == T
    return window[:-1][None], window[1:][None], spans


def _token_losses(model, x, targets):
    logits = model(x)                                                   # (1, T, V)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")


def _grads(model, losses):
    model.zero_grad(set_to_none=True)
    losses.sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _check_alone(source, lengths, T, float32=None):
    """Packed with the option vs each document run alone by the plain model (ids only);
    ``float32``: a name part of parameters whose gradients the model sums in float32."""
    model = source.whole(seed=0).double().eval()
    ids, targets, spans = _row(lengths, T)
    together = _token_losses(model, source.inputs(ids), targets)
    packed_grads = _grads(model, together)
    alone_grads: dict = {}
    for lo, hi in spans:
        alone = _token_losses(model, ids[:, lo:hi], targets[:, lo:hi])     # no segments at all
        torch.testing.assert_close(together[lo:hi].detach(), alone.detach(), rtol=0, atol=1e-12)
        for n, g in _grads(model, alone).items():
            alone_grads[n] = alone_grads.get(n, 0) + g
    for n, g in packed_grads.items():
        atol = 1e-6 if float32 is not None and float32 in n else 1e-12
        torch.testing.assert_close(g, alone_grads[n], rtol=0, atol=atol, msg=n)
    mixed = _token_losses(model, ids, targets)                          # the option off
    assert not torch.allclose(mixed[spans[1][0]:], together[spans[1][0]:].detach())


def test_gpt2_packed_row_equals_its_documents_alone():
    source = open_source("gpt2-tiny", INFO, seq_len=32)
    source.keep_documents_apart(EOS)
    _check_alone(source, (4, 9, 1, 12, 8), 32)


@pytest.mark.parametrize("model", ["hf-llama-tiny", "hf-mistral-tiny", "hf-qwen2-tiny",
                                   "hf-qwen3-tiny", "hf-gemma-tiny", "hf-phi3-tiny"])
def test_hf_packed_row_equals_its_documents_alone(model):
    """Llama; Mistral with its sliding window (32) inside a document of 40 ids; Qwen2's
    biases, Qwen3's q/k norms, Gemma's scaled embedding, Phi-3's fused projections."""
    pytest.importorskip("transformers")
    source = open_source(model, INFO, dtype=torch.float64)
    source.keep_documents_apart(EOS)
    # HF's GemmaRMSNorm computes in float32 whatever the dtype (x.float()): its weights'
    # gradients sum float32 terms, packed in another order than alone (1e-7 apart)
    _check_alone(source, (5, 40, 1, 9, 12), 64, float32="norm" if "gemma" in model else None)


def test_hf_gpt2_layers_keep_documents_apart():
    """HF's GPT-2 layers (learned positions) under ``HFModel.documents``, whatever use_cache."""
    pytest.importorskip("transformers")
    import hf_models as hm

    from chimera import hf
    from chimera.runtime.boundary import Stage

    ids, targets, spans = _row((3, 6, 2, 5), 16, vocab=hm.V)
    model = hf.load(hm.build("gpt2", "sdpa").eval())
    assert model.config.use_cache
    model.documents = True
    stage = Stage(dict(enumerate(model.layers()))).eval()
    pos = document_positions(document_segments(ids, EOS))
    with torch.no_grad():
        together = _token_losses(stage, {"input_ids": ids, "position_ids": pos}, targets)
        for lo, hi in spans:
            alone = _token_losses(stage, ids[:, lo:hi], targets[:, lo:hi])
            torch.testing.assert_close(together[lo:hi], alone, rtol=0, atol=1e-12)


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """A raw token file (no meta.json): documents of 2-30 ids, each ended by EOS."""
    rng = np.random.default_rng(0)
    docs = [np.append(rng.integers(1, V, rng.integers(2, 31)), EOS) for _ in range(300)]
    path = tmp_path_factory.mktemp("packed") / "ids.bin"
    np.concatenate(docs).astype("<u2").tofile(path)
    return dict(data=str(path), token_dtype="uint16", vocab_size=V, eos_id=EOS)


LAYOUTS = [(model, schedule, 1) for model in ("gpt2-tiny", "hf-llama-tiny")
           for schedule in ("chimera", "1f1b")] + [
    ("gpt2-tiny", "zb-v", 1),                  # split backward: I and W apart
    ("gpt2-tiny", "chimera", 2), ("hf-llama-tiny", "1f1b", 2)]  # tensor parallel: heads split


@pytest.mark.parametrize("model,schedule,tp", LAYOUTS)
def test_pipelined_run_equals_one_process_with_the_option(packed, model, schedule, tp):
    """D=2 on virtual ranks (T=2: 4 of them): the segments (GPT-2) or the restarting
    positions (HF) travel with every micro-batch to every stage."""
    if model.startswith("hf"):
        pytest.importorskip("transformers")
    cfg = TrainConfig(model=model, seq_len=32, doc_mask=True, schedule=schedule, stages=2,
                      tensor_parallel=tp, micro_batches=4, micro_batch_size=2, dtype="float64",
                      steps=2, **packed)
    r = check_virtual(cfg)
    assert not r["missing"] and r["replicas_identical"], r
    assert r["max_grad_rel_err"] < 1e-10 and r["max_loss_rel_err"] < 1e-12, r
    off = Trainer(dataclasses.replace(reference_config(cfg), doc_mask=False).preflight())
    assert off.step(0).loss != pytest.approx(r["losses"][0], rel=1e-6)  # the option matters


def _trainer(packed, **kw):
    return Trainer(TrainConfig(model="gpt2-tiny", seq_len=32, schedule="none", stages=1,
                               micro_batches=1, micro_batch_size=4, dtype="float64",
                               eval_batches=2, progress=False, **packed, **kw).preflight())


def test_held_out_evaluation_keeps_documents_apart(packed):
    on, off = _trainer(packed, doc_mask=True), _trainer(packed)
    model = on.model.eval()
    losses = []
    with torch.no_grad():
        for i in range(2):
            ids, targets = on.batch(i, "val")
            x = (ids, document_segments(ids, EOS))
            losses.append(F.cross_entropy(model(x).flatten(0, 1), targets.flatten()))
    assert on.evaluate() == pytest.approx(float(torch.stack(losses).mean()), rel=1e-12)
    assert off.evaluate() != pytest.approx(on.evaluate(), rel=1e-6)


def test_off_by_default_the_inputs_are_the_ids(packed):
    trainer = _trainer(packed)
    ids, _ = trainer.batch(0)
    assert not trainer.cfg.net.doc_mask and trainer.source.inputs(ids) is ids


def _token_folder(root, eos):
    root.mkdir()
    np.tile(np.r_[np.arange(1, 20), eos], 50).astype("<u2").tofile(root / "train.bin")
    (root / "meta.json").write_text(json.dumps({
        "format": "chimera-tokens", "dtype": "uint16", "vocab_size": V, "eos_id": eos,
        "files": {"train": "train.bin"}}))
    return str(root)


def test_doc_mask_refuses_mixed_sources_that_end_documents_differently(tmp_path):
    a, b = _token_folder(tmp_path / "a", 0), _token_folder(tmp_path / "b", 20)
    with pytest.raises(ConfigError, match="--doc-mask: the --data-mix sources end their "
                                          "documents with different ids"):
        TrainConfig(doc_mask=True, data_mix=(f"{a}:1", f"{b}:1")).preflight()
    cfg = TrainConfig(doc_mask=True, data_mix=(f"{a}:1", f"{a}:2")).preflight()
    assert build.model_source(cfg).eos_id == 0


@pytest.mark.parametrize("kw,message", [
    (dict(model="bert-tiny"), "--doc-mask: bert-tiny is not a causal decoder"),
    (dict(data=None, token_dtype=None, vocab_size=None, eos_id=None),
     "--doc-mask needs the end-of-text id"),
])
def test_doc_mask_is_refused_where_it_cannot_hold(packed, kw, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig(doc_mask=True, **{**packed, **kw}).preflight()


def test_tensor_parallel_attention_with_dropout_keeps_documents_apart():
    """The TP copy of GPT-2's attention writes SDPA out when it draws dropout: with the mask
    (and no dropout drawn) it gives SDPA's masked result."""
    from types import SimpleNamespace

    from chimera.tp.plans import _attention_with_dropout

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 8, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    ids = torch.tensor([[5, EOS, 6, 7, EOS, 8, 9, 1], [EOS, 2, 3, EOS, 4, 5, 6, 7]])
    mask = document_mask(document_segments(ids, EOS))                  # (2, 1, 8, 8)
    kept = SimpleNamespace(dropout=lambda probs, p, stream: probs)
    got = _attention_with_dropout(q, k, v, True, 0.1, kept, mask)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert not torch.allclose(got, _attention_with_dropout(q, k, v, True, 0.1, kept))
