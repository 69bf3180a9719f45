"""The key/value-cached decoders of `chimera generate`: logits equal to the model run on the
whole (left-padded) sequence, one position per layer for each new token, a batch equal to
its rows run alone; and the samplers' top-p."""

import pytest
import torch

from chimera.train import decode
from chimera.train.generate import Loaded, Settings, left_pad, pick, sample
from chimera.train.sources import open_source
from chimera.data.formats import DataInfo

ROWS = [[5, 9, 2, 7, 7, 1], [3], [8, 8, 4]]


def preset(vocab=64):
    info = DataInfo("bin", vocab, False, False)
    source = open_source("gpt2-tiny", info)
    return source, source.whole(seed=0).double().eval()


def hf(arch):
    import transformers
    from chimera.hf.source import HFSource
    from transformers import GPT2Config

    llama_like = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    windows = {"MistralForCausalLM": dict(sliding_window=3),  # shorter than the rows grow
               "Qwen3ForCausalLM": dict(head_dim=8, use_sliding_window=True, sliding_window=3,
                                        max_window_layers=1),
               "GemmaForCausalLM": dict(head_dim=4), "Phi3ForCausalLM": dict(sliding_window=3, pad_token_id=None)}
    if arch == "GPT2LMHeadModel":
        config = GPT2Config(vocab_size=64, n_embd=16, n_layer=2, n_head=2, n_positions=32)
    else:
        config_class = getattr(transformers, arch).config_class
        config = config_class(**llama_like, **windows.get(arch, {}))
    source = HFSource("hf-test", arch, config, 32, 64, torch.float64)
    return source, source.whole(seed=0).double().eval()


def full_logits(model, row):
    with torch.no_grad():
        return model(torch.tensor([row]))[0, -1]


@pytest.mark.parametrize("which", ["preset", "GPT2LMHeadModel", "LlamaForCausalLM", "Qwen2ForCausalLM",
                                   "MistralForCausalLM", "Qwen3ForCausalLM", "GemmaForCausalLM",
                                   "Phi3ForCausalLM"])
def test_cached_steps_give_the_whole_sequences_logits(which):
    source, model = preset() if which == "preset" else hf(which)
    loaded = Loaded(model, 32, 64, {}, None, source)
    decoder = loaded.decoder()
    ids, mask = left_pad(ROWS, 32)
    rows = [list(r) for r in ROWS]
    with torch.no_grad():
        logits = decoder.prefill(ids, mask)
        for step in range(4):
            for b, row in enumerate(rows):
                torch.testing.assert_close(logits[b], full_logits(model, row), rtol=1e-9, atol=1e-9)
            nxt = torch.tensor([(3 * step + b) % 64 for b in range(len(rows))])
            for b, row in enumerate(rows):
                row.append(int(nxt[b]))
            logits = decoder.step(nxt)


def test_each_new_token_is_one_position_per_layer():
    source, model = preset()
    seen = []
    for block in list(model.children())[1:-1]:
        block.attn.qkv.register_forward_hook(lambda m, i, o: seen.append(i[0].shape[1]))
    loaded = Loaded(model, 32, 64, {}, None, source)
    new = sample(loaded, ROWS, Settings(max_new_tokens=5, temperature=0))
    assert seen == [6] * 6 + [1] * 6 * 4  # the prompts once, then one position a token (4 steps)
    assert all(len(n) == 5 for n in new)


def test_a_batch_is_its_rows_alone_and_stops_at_the_stop_token():
    source, model = preset()
    loaded = Loaded(model, 32, 64, {}, None, source)
    together = sample(loaded, ROWS, Settings(max_new_tokens=40, temperature=0))  # past the context
    alone = [sample(loaded, [r], Settings(max_new_tokens=40, temperature=0))[0] for r in ROWS]
    assert together == alone
    stop = together[0][3]
    cut = sample(loaded, ROWS[:1], Settings(max_new_tokens=40, temperature=0, stop=stop))[0]
    assert cut == together[0][:together[0].index(stop)]


def test_top_p_keeps_the_fewest_likely_tokens_that_reach_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64))
    gen = torch.Generator().manual_seed(0)
    assert {pick(logits, 1.0, None, gen, top_p=0.4) for _ in range(200)} == {0}
    assert {pick(logits, 1.0, None, gen, top_p=0.75) for _ in range(400)} == {0, 1}
    assert {pick(logits, 1.0, None, gen, top_p=1.0) for _ in range(2000)} == {0, 1, 2, 3}


def test_settings_are_refused_in_one_line():
    for kw, words in ((dict(max_new_tokens=10**12), "--max-new-tokens"), (dict(top_p=0.0), "--top-p"),
                      (dict(top_p=float("nan")), "--top-p"), (dict(top_k=0), "--top-k")):
        with pytest.raises(ValueError, match=words):
            Settings(**kw).check()
