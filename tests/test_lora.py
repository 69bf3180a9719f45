"""Parameter-efficient fine-tuning through the API: LoRA adapters (chimera.models.lora) on HF
Llama and GPT-2 against ``peft`` on HF's own model in one process (float64), and parameters
frozen by name against the same model frozen in one process.

One run of virtual ranks (the transport is not the subject here) executes every case; the
tests below read its results.
"""

from __future__ import annotations

import copy
import functools
from fnmatch import fnmatchcase

import pytest

pytest.importorskip("transformers", reason="chimera.hf needs transformers (pip install '.[hf]')")

import torch  # noqa: E402
from torch import nn  # noqa: E402

import hf_models as hm  # noqa: E402
import chimera.api as chimera  # noqa: E402
from chimera import hf  # noqa: E402
from chimera.errors import UserError  # noqa: E402
from chimera.models.lora import LoRAOptions  # noqa: E402
from chimera.rng import seeded  # noqa: E402
from ranks import run_ranks  # noqa: E402

TOL = dict(rtol=1e-10, atol=1e-12)
N, B = 4, 2  # micro-batches, micro-batch size
SCHEDULES = ("chimera", "zb-v", "1f1b", "chimera-zb")
ARCHS = ("llama", "gpt2")
TARGETS = {"llama": ("*.q_proj", "*.v_proj"), "gpt2": ("*.c_attn", "*.c_proj")}  # Conv1D both
# families on Llama's layers with the default targets (None), and what peft is given for them
DEFAULTS = {"qwen2": ("q_proj", "v_proj"), "phi3": ("qkv_proj",)}  # Phi-3: q, k, v fused
CASES = [(a, s) for a in ARCHS for s in SCHEDULES] + [(a, "chimera") for a in DEFAULTS]
LORA = dict(rank=3, alpha=6.0)


def _random_adapters(state: dict) -> dict:
    """B starts at zero (the update and A's gradient would be zero): random values instead,
    the same on every rank."""
    g = torch.Generator().manual_seed(7)
    return {k: (0.3 * torch.randn(v.shape, generator=g, dtype=v.dtype) if ".lora_B." in k else v)
            for k, v in state.items()}


def _lora_case(folders: dict, arch: str, schedule: str) -> dict:
    model = hf.load(folders[arch], dtype=torch.float64, attn_implementation=hm.ATTN[arch])
    lora = LoRAOptions(targets=TARGETS.get(arch), **LORA)
    pipe = model.pipeline(schedule=schedule, stages=2, micro_batches=N, micro_batch_size=B,
                          model=chimera.ModelOptions(lora=lora))
    start = _random_adapters(pipe.state_dict(all_ranks=True))
    pipe.load_state_dict(start)
    out = hm.pipelined(model, pipe, arch, N * B)
    out["start"] = {model.hf_name(k): v for k, v in start.items()}
    out["trainable"] = sorted(model.hf_name(n) for n, p in pipe.named_parameters() if p.requires_grad)
    held = [p for m in pipe.runtime.modules.values() for p in m.parameters()]
    out["optimized"] = (len(pipe.parameters()), sum(p.requires_grad for p in held), len(held))
    return out


def _frozen_case() -> dict:
    """A small GPT: the embedding and every block's layer norms frozen by pattern."""
    pipe = chimera.Pipeline(_gpt_layers, _gpt_loss, schedule="chimera", micro_batches=N,
                            micro_batch_size=B, model=chimera.ModelOptions(freeze=FREEZE))
    x, y = _gpt_batch()
    loss = pipe.step(x, y)
    return {"loss": loss, "grads": {n: p.grad.clone() for n, p in pipe.named_parameters()
                                    if p.grad is not None},
            "frozen": sorted(n for n, p in pipe.named_parameters() if not p.requires_grad),
            "norm": float(pipe.clip_grad_norm_(None))}


def _sharded_case(rank: int) -> dict:
    """ZeRO-1 with adapters: only what trains is sharded; frozen weights have no state."""
    pipe = chimera.Pipeline(_gpt_layers, _gpt_loss, schedule="chimera", micro_batches=N,
                            micro_batch_size=B,
                            model=chimera.ModelOptions(lora=LoRAOptions(rank=2, targets=["*.fc"])),
                            options=chimera.ExecOptions(shard_optimizer=True))
    opt = torch.optim.AdamW(pipe.parameters(), lr=0.01)
    pipe.step(*_gpt_batch())
    opt.step()
    adapters = sum(p.numel() for n, p in pipe.named_parameters() if ".lora_" in n)
    return {"optimized": sum(p.numel() for p in pipe.parameters()), "adapters": adapters,
            "state": sum(t.numel() for s in opt.state.values() for t in s.values() if t.dim())}


def _errors(folders: dict) -> dict:
    def raises(**model) -> str | None:
        try:
            chimera.Pipeline(_gpt_layers, _gpt_loss, schedule="1f1b", micro_batches=N,
                             micro_batch_size=B, model=chimera.ModelOptions(**model))
        except UserError as exc:
            return str(exc)
        return None

    return {"freeze typo": raises(freeze=["*.attn.qkvv*"]),
            "target typo": raises(lora=LoRAOptions(targets=["*.fc", "*.nope"])),
            "not linear": raises(lora=LoRAOptions(targets=["*.attn"])),
            "tied": _raises_tied(folders)}


def _raises_tied(folders: dict) -> str | None:
    model = hf.load(folders["gpt2"], dtype=torch.float64)
    try:
        model.pipeline(schedule="1f1b", stages=2, micro_batches=N, micro_batch_size=B,
                       model=chimera.ModelOptions(lora=LoRAOptions(targets=["*.lm_head"])))
    except UserError as exc:
        return str(exc)
    return None


# -- chimera's own GPT-2 (a preset's layers: nn.Linear attn.qkv, the default target) -------------
PRESET = "gpt2-tiny"


def _preset_layers() -> list[nn.Module]:
    from chimera import models

    return [layer.double() for layer in models.build_layers(models.get_config(PRESET), seed=0)]


def _preset_loss():
    from chimera import models

    return models.loss_fn(models.get_config(PRESET))


def _preset_batch(step: int):
    g = torch.Generator().manual_seed(step)
    return (torch.randint(0, 256, (N * B, 6), generator=g), torch.randint(0, 256, (N * B, 6), generator=g))


def _preset_case(schedule: str) -> dict:
    pipe = chimera.Pipeline(_preset_layers, _preset_loss(), schedule=schedule, micro_batches=N,
                            micro_batch_size=B, model=chimera.ModelOptions(lora=LoRAOptions(**LORA)))
    pipe.load_state_dict(_random_adapters(pipe.state_dict(all_ranks=True)))
    opt = torch.optim.AdamW([{"params": pipe.parameters()}], lr=hm.LR, eps=hm.EPS)
    losses, grads = [], []
    for step in range(2):
        opt.zero_grad()
        losses.append(pipe.step(*_preset_batch(step)))
        grads.append({n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None})
        opt.step()
    return {"losses": losses, "grads": grads,
            "params": {n: p.detach().clone() for n, p in pipe.named_parameters()}}


def _preset_reference() -> dict:
    """The same adapters (chimera.models.lora on each layer, the layer's seed) in one process."""
    from chimera.models.lora import Tuning

    with seeded(0):
        layers = _preset_layers()
    tuning = Tuning((), LoRAOptions(**LORA), seed=0)
    model = nn.Sequential(*[tuning.layer(i, layer) for i, layer in enumerate(layers)])
    model.load_state_dict(_random_adapters(model.state_dict()))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=hm.LR, eps=hm.EPS)
    loss_fn, out = _preset_loss(), {"losses": [], "grads": []}
    for step in range(2):
        opt.zero_grad()
        x, y = _preset_batch(step)
        loss = loss_fn(model(x), y)
        loss.backward()
        out["losses"].append(float(loss.detach()))
        out["grads"].append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def _worker(rank: int, world: int, folders: dict) -> dict:
    out = {(a, s): _lora_case(folders, a, s) for a, s in CASES}
    out.update({("preset", s): _preset_case(s) for s in ("chimera", "zb-v", "1f1b")})
    out["frozen"] = _frozen_case()
    out["sharded"] = _sharded_case(rank)
    out["errors"] = _errors(folders)
    return out


# -- a small GPT of plain modules (the frozen and sharded cases) -----------------------------
FREEZE = ("0.*", "*.ln*")
V, C, T = 11, 8, 5


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(C)
        self.attn = nn.Sequential(nn.Linear(C, C), nn.Tanh())
        self.fc = nn.Linear(C, C)

    def forward(self, x):
        return x + self.fc(self.attn(self.ln(x)))


def _gpt_layers() -> list[nn.Module]:
    return [m.double() for m in (nn.Embedding(V, C), Block(), Block(), nn.Linear(C, V))]


def _gpt_loss(logits, targets):
    return nn.functional.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))


def _gpt_batch():
    g = torch.Generator().manual_seed(3)
    return (torch.randint(0, V, (N * B, T), generator=g), torch.randint(0, V, (N * B, T), generator=g))


# -- fixtures ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return hm.saved(tmp_path_factory.mktemp("lora"), ARCHS + tuple(DEFAULTS))


@pytest.fixture(scope="module")
def world2(saved):
    return run_ranks(functools.partial(_worker, folders={a: f for a, (f, _) in saved.items()}), 2)


def _peft_reference(hf_model, arch: str, start: dict) -> dict:
    """``peft`` on HF's own model in one process, from the pipeline's starting weights."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=LORA["rank"], lora_alpha=LORA["alpha"], lora_dropout=0.0,
                             target_modules=list(DEFAULTS.get(arch) or
                                                 [t.lstrip("*.") for t in TARGETS[arch]]),
                             fan_in_fan_out=arch == "gpt2")
    model = peft.get_peft_model(copy.deepcopy(hf_model), config)
    adapters = {f"base_model.model.{k}": v for k, v in start.items() if ".lora_" in k}
    missing = peft.set_peft_model_state_dict(model, adapters).unexpected_keys
    assert not missing, missing
    return _train(model, model.base_model.model, arch)


def _train(model, base, arch: str) -> dict:
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=hm.LR, weight_decay=hm.DECAY, eps=hm.EPS)
    out = {"grads": [], "losses": []}
    for inputs, labels in hm.plan(arch, N * B):
        opt.zero_grad()
        loss = hm.loss_of(arch, base(**inputs).logits, labels)
        loss.backward()
        out["losses"].append(float(loss.detach()))
        out["grads"].append({_ours(n): p.grad.clone() for n, p in base.named_parameters()
                             if p.requires_grad})
        opt.step()
    out["params"] = {_ours(n): p.detach().clone()
                     for n, p in base.named_parameters(remove_duplicate=False)}  # tied: both
    return out


def _ours(peft_name: str) -> str:
    """peft's names of HF's model -> the HF names chimera's pipeline gives."""
    return peft_name.replace(".base_layer.", ".").replace(".default.", ".")


@pytest.fixture(scope="module")
def refs(saved, world2):
    return {(a, s): _peft_reference(saved[a][1], a, world2[0][(a, s)]["start"]) for a, s in CASES}


@pytest.mark.parametrize("case", [f"{a}-{s}" for a, s in CASES])
def test_lora_gradients_equal_peft_in_one_process(world2, refs, case):
    """Adapters on Llama's q/v projections, GPT-2's Conv1D c_attn/c_proj, and the default
    targets of Qwen2 (q/v) and Phi-3 (the fused qkv_proj): every trainable
    gradient of 3 steps (padding, a new length mid-run), the losses and the parameters after
    AdamW equal peft's on HF's model in one process; nothing else trains."""
    arch, schedule = case.split("-", 1)
    ref = refs[(arch, schedule)]
    for rank, res in enumerate(world2):
        got = res[(arch, schedule)]
        assert got["losses"] == pytest.approx(ref["losses"], rel=1e-10)
        for k in range(3):
            grads = dict(got["grads"][k])
            assert {n for n, g in got["grads"][k] if g is not None} <= set(ref["grads"][k])
            for name, g in got["grads"][k]:
                if g is not None:
                    assert torch.allclose(g, ref["grads"][k][name], **TOL), (rank, k, name)
            assert all(".lora_" in n for n in grads if grads[n] is not None)
        for name, p in got["params"]:
            assert torch.allclose(p, ref["params"][name], **TOL), (rank, name)
        assert all(".lora_" in n for n in got["trainable"])  # (zb-v: rank 0 holds none)
        given, trainable, held = got["optimized"]
        # parameters(): what trains, every replica's; a rank with nothing to train (zb-v's
        # rank 0) its frozen ones, so an optimizer can be built there too
        assert given == (trainable or held)
    trained = {n for res in world2 for n in res[(arch, schedule)]["trainable"]}
    assert trained == set(ref["grads"][0])  # every adapter peft trains, and no other tensor


@pytest.mark.parametrize("schedule", ["chimera", "zb-v", "1f1b"])
def test_lora_on_a_gpt2_preset_equals_one_process(world2, schedule):
    """chimera's own GPT-2 (attn.qkv adapters, the default targets): the adapters are the same
    on every layout (drawn from the layer's seed), and their gradients, the losses and two
    AdamW steps equal the same model in one process."""
    ref = _preset_reference()
    assert all(n.endswith((".attn.qkv.lora_A.weight", ".attn.qkv.lora_B.weight"))
               for n in ref["grads"][0])
    for rank, res in enumerate(world2):
        got = res[("preset", schedule)]
        assert got["losses"] == pytest.approx(ref["losses"], rel=1e-10)
        for k in range(2):
            for name, g in got["grads"][k].items():
                assert torch.allclose(g, ref["grads"][k][name], **TOL), (rank, k, name)
        for name, p in got["params"].items():
            assert torch.allclose(p, ref["params"][name], **TOL), (rank, name)
    held = {n for res in world2 for n in res[("preset", schedule)]["grads"][0]}
    assert held == set(ref["grads"][0])


def test_lora_starts_from_the_base_model():
    """B = 0 at the start: an adapted layer computes what the base layer does."""
    from chimera.models.lora import adapt_layer

    layer = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3)).double()
    x = torch.randn(2, 4, dtype=torch.float64)
    before = layer(x)
    used = adapt_layer(0, layer, LoRAOptions(rank=2, targets=["0.0"]), seed=0)
    assert used == {"0.0"}
    assert torch.equal(layer(x), before)
    assert [n for n, p in layer.named_parameters() if p.requires_grad] == ["0.lora_A.weight",
                                                                          "0.lora_B.weight"]
    whole = nn.Linear(4, 3).double()  # a layer that is itself linear: named by its index
    assert adapt_layer(5, whole, LoRAOptions(rank=2, targets=["5"]), seed=0) == {"5"}
    assert torch.equal(whole(x), nn.functional.linear(x, whole.weight, whole.bias))
    assert [n for n, p in whole.named_parameters() if p.requires_grad] == ["lora_A.weight",
                                                                          "lora_B.weight"]


def _frozen_reference() -> dict:
    with seeded(0):  # what the Pipeline calls make_layers with
        layers = _gpt_layers()
    model = nn.Sequential(*layers)
    for name, p in model.named_parameters():
        if any(fnmatchcase(name, q) for q in FREEZE):
            p.requires_grad_(False)
    x, y = _gpt_batch()
    loss = _gpt_loss(model(x), y)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()]))
    return {"loss": float(loss.detach()), "grads": grads, "norm": float(norm.detach())}


def test_frozen_by_pattern_trains_as_one_process(world2):
    """``freeze``: the matched parameters get no gradient and count nowhere (the gradient
    norm is the trainable ones'); the others' gradients equal one process's."""
    ref = _frozen_reference()
    for res in world2:
        got = res["frozen"]
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-12)
        assert got["norm"] == pytest.approx(ref["norm"], rel=1e-10)
        assert got["frozen"] and all(n.startswith("0.") or ".ln." in n for n in got["frozen"])
        for name, g in got["grads"].items():
            assert torch.allclose(g, ref["grads"][name], **TOL), name
    held = {n for res in world2 for n in res["frozen"]["grads"]}
    assert held == set(ref["grads"])


def test_sharded_optimizer_holds_only_the_adapters(world2):
    """ZeRO-1 with LoRA: the optimizer's slices cover the adapters once over each stage's
    replicas (no frozen weight), and AdamW's moments are the size of those slices."""
    got = [res["sharded"] for res in world2]
    # chimera at D = 2: each rank holds one replica of each stage, so all the adapters
    assert got[0]["adapters"] == got[1]["adapters"]
    assert sum(g["optimized"] for g in got) == got[0]["adapters"]
    assert all(0 < g["optimized"] < g["adapters"] for g in got)
    assert all(g["state"] == 2 * g["optimized"] for g in got)


def test_refused_in_one_line(world2):
    errors = world2[0]["errors"]
    assert "'*.attn.qkvv*'" in errors["freeze typo"] and "match no parameter" in errors["freeze typo"]
    assert "0.weight" in errors["freeze typo"]  # some of the model's names, to choose from
    assert "'*.nope'" in errors["target typo"] and "'*.fc'" not in errors["target typo"]
    assert "1.fc" in errors["target typo"] and "1.attn.0" in errors["target typo"]
    assert "Sequential" in errors["not linear"] and "linear layers" in errors["not linear"]
    assert "tied" in errors["tied"] and "lm_head" in errors["tied"]
    assert all("\n" not in e for e in errors.values())


def test_lora_with_tensor_parallel_is_refused():
    def worker(rank, world):
        try:
            chimera.Pipeline(_gpt_layers, _gpt_loss, schedule="1f1b", stages=1, micro_batches=1,
                             tensor_parallel=2, model=chimera.ModelOptions(
                                 lora=LoRAOptions(targets=["*.fc"]), tp_plan={"*.fc": "colwise"}))
        except UserError as exc:
            return str(exc)

    assert all("tensor_parallel=2 is not supported" in m for m in run_ranks(worker, 2))
