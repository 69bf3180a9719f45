"""Models as flat layer lists: shapes, init, names, partitioning, split gradients."""

import itertools
import random

import pytest
import torch
from torch import nn

from chimera.models import (
    PRESETS, ModelConfig, build_layers, build_model, build_stage, flops_per_token,
    get_config, layer_costs, layer_names, layer_param_counts, layer_param_names, loss_fn,
    param_count, parse_partition, partition, partition_from_sizes, stage_param_names)
from chimera.models.bert import BERT_LAYERS
from chimera.models.gpt2 import GPT2_LAYERS

TINY = ("gpt2-tiny", "bert-tiny")


def _tokens(cfg, batch=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=g)


def _targets(cfg, batch=3):
    targets = _tokens(cfg, batch, seed=1)
    if cfg.kind == "bert":
        targets[:, ::2] = -100
    return targets


# ---------------------------------------------------------------------------------------
# Config

@pytest.mark.parametrize("field, value, message", [
    ("kind", "llama", "kind must be one of"),
    ("n_layer", 0, "n_layer must be a positive integer"),
    ("d_model", 30, "divisible by n_head"),
    ("seq_len", -1, "seq_len must be a positive integer"),
    ("vocab_size", 1, "vocab_size"),
    ("dropout", 1.0, "dropout"),
    ("mlp_ratio", 0, "mlp_ratio"),
])
def test_config_validation(field, value, message):
    kwargs = dict(kind="gpt2", n_layer=2, d_model=32, n_head=4, seq_len=8)
    kwargs[field] = value
    with pytest.raises(ValueError, match=message):
        ModelConfig(**kwargs)


def test_get_config_presets_and_overrides():
    assert get_config("gpt2-paper") == ModelConfig("gpt2", 64, 1280, 20, 632)
    assert get_config("bert-48").n_layer == 48
    assert get_config("gpt2-tiny", vocab_size=512).vocab_size == 512
    with pytest.raises(ValueError, match="gpt2-tiny"):
        get_config("gpt3")
    with pytest.raises(TypeError):
        PRESETS["mine"] = PRESETS["gpt2-tiny"]          # presets are read-only


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_param_counts_match_modules(name):
    cfg = get_config(name)
    embed, block, head = GPT2_LAYERS if cfg.kind == "gpt2" else BERT_LAYERS
    with torch.device("meta"):                            # sizes only, no memory
        layers = [embed(cfg)] + [block(cfg)] * cfg.n_layer + [head(cfg)]
    counts = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    assert counts == layer_param_counts(cfg) and sum(counts) == param_count(cfg)
    names = stage_param_names(cfg, range(cfg.n_layer + 2))
    assert len(set(names.values())) == sum(len(list(layer.parameters())) for layer in layers)


def test_flops_per_token():
    cfg = get_config("gpt2-small")
    flops = flops_per_token(cfg)
    counts = layer_param_counts(cfg)
    assert len(flops) == cfg.n_layer + 2
    assert flops[1] == 2 * counts[1] + 4 * cfg.seq_len * cfg.d_model
    assert flops[-1] == 2 * counts[-1] and 0 < flops[0] < flops[1]
    costs = layer_costs(cfg)
    assert costs[1:-1] == [1.0] * cfg.n_layer and 0 < costs[0] < costs[-1] < 1


# ---------------------------------------------------------------------------------------
# Layers, shapes, names

@pytest.mark.parametrize("name", TINY)
def test_layer_shapes(name):
    cfg = get_config(name)
    layers = build_layers(cfg, seed=0)
    assert len(layers) == cfg.n_layer + 2
    x = _tokens(cfg)
    for layer in layers[:-1]:
        x = layer(x)
        assert x.shape == (3, cfg.seq_len, cfg.d_model)
    assert layers[-1](x).shape == (3, cfg.seq_len, cfg.vocab_size)
    short = _tokens(cfg)[:, :5]                            # shorter sequences are fine
    assert build_model(cfg, 0)(short).shape == (3, 5, cfg.vocab_size)


def test_embedding_rejects_bad_input():
    cfg = get_config("gpt2-tiny")
    embed = build_layers(cfg, 0, [0])[0]
    with pytest.raises(ValueError, match="exceeds the model's seq_len"):
        embed(torch.zeros(1, cfg.seq_len + 1, dtype=torch.long))
    with pytest.raises(ValueError, match="int64 token ids"):
        embed(torch.zeros(1, 4))
    with pytest.raises(ValueError, match="out of range"):
        build_layers(cfg, 0, [cfg.n_layer + 2])


@pytest.mark.parametrize("name", TINY)
def test_attention_direction(name):
    cfg = get_config(name)
    model = build_model(cfg, 0)
    x = _tokens(cfg)
    y = x.clone()
    y[:, -1] = (y[:, -1] + 1) % cfg.vocab_size            # change only the last token
    with torch.no_grad():
        same_prefix = torch.equal(model(x)[:, :-1], model(y)[:, :-1])
    assert same_prefix == (cfg.kind == "gpt2")             # causal vs bidirectional


@pytest.mark.parametrize("name", TINY)
def test_state_dict_names(name):
    cfg = get_config(name)
    model = build_model(cfg, 0)
    keys = list(model.state_dict())
    assert layer_param_names(cfg) == layer_names(cfg)
    assert layer_names(cfg)[:2] == ["embed", "blocks.0"] and layer_names(cfg)[-1] == "head"
    assert "embed.tok.weight" in keys and "blocks.1.attn.qkv.weight" in keys
    assert ("head.lm_head.weight" if cfg.kind == "gpt2" else "head.decoder.weight") in keys
    for index, prefix in enumerate(layer_names(cfg)):
        local = [n for n, _ in model.layers[index].named_parameters()]
        assert [k for k in keys if k.startswith(prefix + ".")] == [f"{prefix}.{n}" for n in local]


def test_stage_param_names_map_to_model_weights():
    cfg = get_config("gpt2-tiny")
    model_state = build_model(cfg, 7).state_dict()
    rng = range(2, 6)
    stage = nn.Sequential(*build_layers(cfg, 7, rng))
    mapping = stage_param_names(cfg, rng)
    assert set(mapping) == set(dict(stage.named_parameters()))
    for local, tensor in stage.state_dict().items():
        assert torch.equal(tensor, model_state[mapping[local]])


# ---------------------------------------------------------------------------------------
# Initialization

@pytest.mark.parametrize("name", TINY)
def test_init_deterministic_and_partition_independent(name):
    cfg = get_config(name)
    rng_state = torch.get_rng_state()
    a = build_model(cfg, seed=3).state_dict()
    b = build_model(cfg, seed=3).state_dict()
    assert torch.equal(rng_state, torch.get_rng_state())   # global RNG untouched
    assert all(torch.equal(a[k], b[k]) for k in a)
    c = build_model(cfg, seed=4).state_dict()
    assert not torch.equal(a["blocks.0.attn.qkv.weight"], c["blocks.0.attn.qkv.weight"])
    partial = build_layers(cfg, 3, [4, 2])                  # any subset, any order
    full = build_layers(cfg, 3)
    for got, index in zip(partial, [4, 2]):
        for (_, p), (_, q) in zip(got.named_parameters(), full[index].named_parameters()):
            assert torch.equal(p, q)


def test_init_statistics():
    cfg = ModelConfig("gpt2", n_layer=8, d_model=128, n_head=4, seq_len=16)
    state = build_model(cfg, 0).state_dict()
    assert state["blocks.0.attn.qkv.weight"].std() == pytest.approx(0.02, rel=0.05)
    assert state["blocks.0.mlp.proj.weight"].std() == pytest.approx(0.02 / 4, rel=0.05)
    assert state["embed.pos.weight"].std() == pytest.approx(0.02, rel=0.1)
    assert torch.all(state["blocks.0.ln1.weight"] == 1)
    assert torch.all(state["blocks.0.attn.qkv.bias"] == 0)


# ---------------------------------------------------------------------------------------
# Numerics: sequential == model, split gradients == unsplit, float64

@pytest.mark.parametrize("name", TINY)
def test_sequential_layers_equal_model(name):
    cfg = get_config(name)
    model = build_model(cfg, 0)
    x = _tokens(cfg)
    h = x
    for layer in build_layers(cfg, 0):
        h = layer(h)
    assert torch.equal(h, model(x))


@pytest.mark.parametrize("name", TINY)
def test_split_gradients_equal_unsplit(name):
    cfg = get_config(name)
    x, targets, loss = _tokens(cfg), _targets(cfg), loss_fn(cfg)
    reference = build_model(cfg, 0).to(torch.float64)
    loss(reference(x), targets).backward()
    layers = [layer.to(torch.float64) for layer in build_layers(cfg, 0)]
    stage_a, stage_b = (build_stage(layers, r) for r in partition_from_sizes([cfg.n_layers_total // 2, cfg.n_layers_total - cfg.n_layers_total // 2]))
    out_a = stage_a(x)
    handoff = out_a.detach().requires_grad_(True)          # what crosses the wire
    loss(stage_b(handoff), targets).backward()
    out_a.backward(handoff.grad)
    ref_grads = dict(reference.named_parameters())
    mapping = stage_param_names(cfg, range(len(layers)))  # names in Sequential(*layers)
    for local, p in nn.Sequential(*layers).named_parameters():
        assert p.dtype == torch.float64
        torch.testing.assert_close(p.grad, ref_grads[mapping[local]].grad, rtol=0, atol=1e-12)


def test_float64_forward():
    cfg = get_config("bert-tiny")
    model = build_model(cfg, 0).to(torch.float64)
    assert model(_tokens(cfg)).dtype == torch.float64


def test_loss_fn():
    cfg = get_config("bert-tiny")
    logits = torch.randn(2, 4, cfg.vocab_size)
    targets = torch.tensor([[1, -100, 2, -100], [-100, -100, -100, 3]])
    mean = loss_fn(cfg)(logits, targets)
    total = loss_fn(cfg, reduction="sum")(logits, targets)
    assert total.item() == pytest.approx(3 * mean.item(), rel=1e-6)
    with pytest.raises(ValueError, match="reduction"):
        loss_fn(cfg, reduction="none")


# ---------------------------------------------------------------------------------------
# Partitioning

def _brute_force(costs, parts):
    best = float("inf")
    for cuts in itertools.combinations(range(1, len(costs)), parts - 1):
        bounds = (0, *cuts, len(costs))
        best = min(best, max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])))
    return best


def test_partition_equal_costs():
    assert partition([1.0] * 8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert partition([1.0] * 8, 3) == [range(0, 2), range(2, 5), range(5, 8)]
    assert partition([5.0], 1) == [range(0, 1)]


def test_partition_is_optimal_and_deterministic():
    rand = random.Random(0)
    for _ in range(40):
        n = rand.randint(1, 9)
        costs = [rand.choice([0.0, 0.5, 1.0, 2.0, 3.5]) for _ in range(n)]
        parts = rand.randint(1, n)
        ranges = partition(costs, parts)
        assert ranges == partition(costs, parts)
        assert [i for r in ranges for i in r] == list(range(n)) and all(len(r) for r in ranges)
        assert max(sum(costs[i] for i in r) for r in ranges) == pytest.approx(
            _brute_force(costs, parts))


def test_partition_of_model_costs():
    cfg = get_config("gpt2-bench")
    ranges = partition(layer_costs(cfg), 2)
    assert ranges == [range(0, 5), range(5, 10)]           # embed + 4 blocks | 4 blocks + head


def test_partition_errors():
    with pytest.raises(ValueError, match="cannot split 3 layers into 4 stages"):
        partition([1.0] * 3, 4)
    with pytest.raises(ValueError, match="positive integer"):
        partition([1.0] * 3, 0)
    with pytest.raises(ValueError, match="non-negative"):
        partition([1.0, -1.0], 1)


def test_parse_partition_and_sizes():
    assert parse_partition("0-3,4-7") == [range(0, 4), range(4, 8)]
    assert parse_partition(" 0 , 1-5", n_layers=6) == [range(0, 1), range(1, 6)]
    assert partition_from_sizes([3, 4, 3]) == [range(0, 3), range(3, 7), range(7, 10)]
    for spec, message in [("0-3,5-7", "should start at layer 4"), ("1-3", "start at layer 0"),
                          ("0-x", "bad stage"), ("3-1", "bad stage"), ("0-1-2", "bad stage"),
                          ("", "bad stage")]:
        with pytest.raises(ValueError, match=message):
            parse_partition(spec)
    with pytest.raises(ValueError, match="covers 8 layers, but the model has 10"):
        parse_partition("0-3,4-7", n_layers=10)
    with pytest.raises(ValueError, match="positive integers"):
        partition_from_sizes([3, 0])
    with pytest.raises(ValueError, match="sum to 7"):
        partition_from_sizes([3, 4], n_layers=8)


def test_build_stage_shares_modules_and_checks_range():
    layers = build_layers(get_config("gpt2-tiny"), 0)
    stage = build_stage(layers, range(1, 3))
    assert list(stage) == layers[1:3]
    for bad in (range(0), range(6, 9), range(0, 4, 2)):
        with pytest.raises(ValueError, match="contiguous range"):
            build_stage(layers, bad)
