"""``HFModel``: a Hugging Face model as what ``chimera.api.Pipeline`` needs, and back.

Names: the pipeline names a tensor ``"<layer>.<child>.<rest>"`` (``nn.Sequential`` of the
layers); each layer's ``prefixes`` map ``<child>`` to an HF module path, so
``"3.block.attn.c_attn.weight"`` is HF's ``"transformer.h.2.attn.c_attn.weight"``.
Ties are HF's own (``model.all_tied_weights_keys``): across layers they go to the Pipeline
(``ties=``), inside a layer (BERT's decoder bias) the layer holds one Parameter.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import torch
from torch import nn

from chimera import tp
from chimera.api import ExecOptions, LossOptions, ModelOptions, Pipeline
from chimera.byo import build_layers
from chimera.errors import UserError
from chimera.hf import layers as L
from chimera.hf.weights import (Checkpoint, cast_parameters, check_shapes, clear_init_flags,
                                load_layer, save_folder, tie_within)

# architecture -> (model_type, plan, causal: labels are the input ids, shifted in the loss)
ARCHS = {
    "GPT2LMHeadModel": ("gpt2", L.gpt2_plan, True),
    "LlamaForCausalLM": ("llama", L.llama_plan, True),
    "Qwen2ForCausalLM": ("qwen2", L.qwen_plan, True),
    "MistralForCausalLM": ("mistral", L.window_plan, True),
    "Qwen3ForCausalLM": ("qwen3", L.qwen_plan, True),
    "GemmaForCausalLM": ("gemma", L.llama_plan, True),
    "Phi3ForCausalLM": ("phi3", L.window_plan, True),
    "BertForMaskedLM": ("bert", L.bert_plan, False),
}
SUPPORTED = ", ".join(ARCHS)
# honour sliding_window
SLIDING = ("MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM")
# the tensor-parallel plan of each pipeline layer class (chimera.tp's, at the layer's own
# names: HF's block sits in chimera.hf's GPT2Block as `block`, its decoder layer in
# LlamaBlock as `layer`). Llama's plan covers Qwen2 (a column-parallel bias is cut with its
# columns) and Mistral (the same module names; the window is in the mask).
_DECODER_TP = lambda: tp.prefixed(tp.llama_decoder_plan(), "layer.")  # noqa: E731
TP_PLANS = {
    L.GPT2Embed: lambda: {**tp.embedding_plan("wte"), "drop": tp.Dropout("replicated")},
    L.GPT2Block: lambda: tp.prefixed(tp.hf_gpt2_block_plan(), "block."),
    L.GPT2Head: lambda: tp.head_plan("lm_head"),
    L.LlamaEmbed: lambda: tp.embedding_plan("embed_tokens"),
    L.LlamaBlock: _DECODER_TP,
    L.SlidingBlock: _DECODER_TP,
    L.LlamaHead: lambda: tp.head_plan("lm_head"),
}
# Gemma's embedding scales its lookup by sqrt(hidden) inside its own module, which a
# vocabulary-sharded embedding would replace: embedding and (tied) head stay whole there
WHOLE_ENDS = {"GemmaForCausalLM": (L.LlamaEmbed, L.LlamaHead)}
# Qwen3's q/k norms are one weight over every head: with q and k column-parallel each rank
# would see its heads only, and the norms' gradients would be partial sums. Here q, k, v
# are column-parallel with their outputs gathered (the norms see every head, their gradients
# whole on every rank), attention runs on every head, o_proj is row-parallel on its slice of
# the whole input; the MLP as Llama's. No collective in the weight-gradient half (W).
QWEN3_BLOCK_TP = {"self_attn.q_proj": "colwise_gather_output", "self_attn.k_proj": "colwise_gather_output",
                  "self_attn.v_proj": "colwise_gather_output", "self_attn.o_proj": "rowwise_split_input",
                  "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise"}


def _hf_block_plan(config) -> dict:
    """HF's own plan of a decoder layer (its config's ``base_model_tp_plan``): for Phi-3's
    fused projections (qkv_proj with GQA's unequal parts, gate_up_proj) it gathers a fused
    output and gives the row-parallel projection its whole input."""
    return tp.prefixed(tp.from_hf(type(config).base_model_tp_plan, "layers.*."), "layer.")


# decoder layers whose plan is not Llama's (the layer class is Llama's)
BLOCK_TP = {
    "Phi3ForCausalLM": _hf_block_plan,
    "Qwen3ForCausalLM": lambda config: tp.prefixed({**QWEN3_BLOCK_TP, "mlp": tp.shared_input(),
                                                    "self_attn": tp.shared_input("hidden_states")},
                                                   "layer."),
}
# architectures without one, and why
NO_TP = {"BertForMaskedLM": "BERT has no tensor-parallel plan yet"}
TP_ARCHS = ", ".join(a for a in ARCHS if a not in NO_TP)
ATTENTION = ("eager", "sdpa")


class HFModel:
    """One HF model, split into pipeline layers (embedding, one per block, head).

    Build it on every rank (see :func:`chimera.hf.load`); ``pipeline(**kw)`` makes the
    Pipeline, each rank building (and reading from the checkpoint) only the layers it holds.
    ``loss_fn(logits, targets)`` sums over tokens and ``token_count(targets)`` counts them
    (for ``loss_reduction="token_mean"``). ``read_keys``: the checkpoint keys this process read.
    """

    def __init__(self, arch: str, config, model: nn.Module | None = None,
                 checkpoint: Checkpoint | None = None, dtype: torch.dtype | None = None,
                 labels_shifted: bool = False):
        self.arch, self.model, self.checkpoint = arch, model, checkpoint
        if dtype is None and model is None:
            dtype = torch.float32  # from a config or a folder; a model object keeps its own
        self.dtype = dtype
        _, plan, causal = ARCHS[arch]
        shift = causal and not labels_shifted
        self.loss_fn = L.causal_lm_loss if shift else L.token_loss
        self.token_count = L.causal_label_count if shift else L.target_count
        self.source = model if model is not None else _on_meta(arch, config)  # the HF model
        self.config = self.source.config
        self._shadow = None if model is not None else self.source  # on meta: for sizing
        attn = self.config._attn_implementation
        if attn not in ATTENTION:
            raise UserError(f"attention implementation {attn!r} is not supported "
                             f"(use one of {ATTENTION})")
        self.plan = plan(self.config)
        self.num_layers = len(self.plan)
        # packed documents kept apart: position ids that restart start a document (the
        # layers' ``documents``); set before the layers are made
        self.documents = False
        self.hf_ties = dict(self.source.all_tied_weights_keys)  # HF target -> HF source
        self.ties, self.within = self._split_ties()

    @property
    def read_keys(self) -> list[str]:
        return [] if self.checkpoint is None else list(self.checkpoint.read)

    # -- names -----------------------------------------------------------------------------
    def hf_name(self, name: str) -> str:
        """Pipeline name -> HF name: ``"0.wte.weight"`` -> ``"transformer.wte.weight"``."""
        index, rest = name.split(".", 1)
        child, _, tail = rest.partition(".")
        return f"{self.plan[int(index)][1][child]}.{tail}"

    def pipeline_name(self, hf: str) -> str:
        for i, (_, children) in enumerate(self.plan):
            for child, path in children.items():
                if hf.startswith(path + "."):
                    return f"{i}.{child}.{hf[len(path) + 1:]}"
        raise KeyError(f"{hf} belongs to no pipeline layer of {self.arch}")

    def _split_ties(self) -> tuple[list[tuple[str, str]], dict[int, list[tuple[str, str]]]]:
        """HF's ties as (source, target) pipeline names across layers, and per layer as
        (target, source) names inside it."""
        across, within = [], {}
        for target, source in self.hf_ties.items():
            (ti, t), (si, s) = (self.pipeline_name(n).split(".", 1) for n in (target, source))
            if ti == si:
                within.setdefault(int(ti), []).append((t, s))
            else:
                across.append((f"{si}.{s}", f"{ti}.{t}"))
        return across, within

    def _candidates(self, index: int, layer: nn.Module) -> dict[str, list[str]]:
        """Per persistent tensor of the layer, the checkpoint keys that may hold it, best
        first: a tie's source before its target (HF ties after loading), each also without
        the base model's prefix (``"h.0..."`` in the original GPT-2 files)."""
        prefix = self.source.base_model_prefix + "."
        out = {}
        for local in layer.state_dict(keep_vars=True):
            hf = self.hf_name(f"{index}.{local}")
            keys = [self.hf_ties[hf], hf] if hf in self.hf_ties else [hf]
            out[local] = []
            for key in keys:
                out[local] += [key, key[len(prefix):]] if key.startswith(prefix) else [key]
        return out

    # -- layers ----------------------------------------------------------------------------
    def make_layer(self, index: int) -> nn.Module:
        """Layer ``index``, with its weights (a copy of the model's, the checkpoint's, or HF's
        initialization from the config). Under ``torch.device("meta")`` (Pipeline sizing the
        layers for a balanced partition): the layer on meta, nothing read."""
        cls, children = self.plan[index]
        on_meta = torch.get_default_device().type == "meta"
        source = self._meta_model() if on_meta else self.source
        parts = copy.deepcopy({c: source.get_submodule(path) for c, path in children.items()})
        layer = cls(self.config, **parts)
        layer.prefixes = dict(children)
        layer.documents = self.documents
        clear_init_flags(layer)
        if self.dtype is not None:
            cast_parameters(layer, self.dtype)
        if on_meta or self.model is not None:
            return layer
        layer.to_empty(device="cpu")
        tie_within(layer, self.within.get(index, []))
        load_layer(layer, index, self._candidates(index, layer), self.checkpoint,
                   self.source._initialize_weights)
        return layer

    def check_weights(self) -> None:
        """Every tensor the layers will read is in the checkpoint with the config's shape:
        checked from the safetensors headers on meta layers (no tensor read), so that a
        mismatch is one line before any process starts, not a traceback from every rank."""
        if self.checkpoint is None or self.model is not None:
            return
        expected = []
        with torch.device("meta"):
            for index in range(self.num_layers):
                layer = self.make_layer(index)
                tensors = layer.state_dict(keep_vars=True)
                expected += [(tuple(tensors[local].shape), keys)
                             for local, keys in self._candidates(index, layer).items()]
        check_shapes(self.checkpoint.folder, expected, self.checkpoint.shapes())

    def _meta_model(self) -> nn.Module:
        if self._shadow is None:
            self._shadow = _on_meta(self.arch, self.config)
        return self._shadow

    def layers(self) -> list[nn.Module]:
        """Every layer, in one process (a reference, a check); ties as in the pipeline."""

        out = build_layers(self.make_layer, self.num_layers)
        for first, second in self.ties:
            i, name = second.split(".", 1)
            owner, _, attr = name.rpartition(".")
            j, src = first.split(".", 1)
            setattr(out[int(i)].get_submodule(owner), attr, out[int(j)].get_parameter(src))
        return out

    def tp_plan(self, index: int, layer: nn.Module) -> dict:
        """Layer ``index``'s tensor-parallel plan (``ModelOptions.tp_plan``): the embedding
        by vocabulary, each block Megatron-style, the head column-parallel, logits gathered;
        a family's own block plan (``BLOCK_TP``) or whole ends (``WHOLE_ENDS``) where it has them."""
        if type(layer) in WHOLE_ENDS.get(self.arch, ()):
            return {}
        if self.arch in BLOCK_TP and isinstance(layer, L.LlamaBlock):
            return BLOCK_TP[self.arch](self.config)
        make = TP_PLANS.get(type(layer))
        if self.arch in NO_TP or make is None:
            why = NO_TP.get(self.arch, f"{self.arch} has no tensor-parallel plan yet")
            raise UserError(f"tensor parallel: {why}; {TP_ARCHS} have one")
        return make()

    def pipeline_kwargs(self, model: ModelOptions | None = None,
                        options: ExecOptions | None = None) -> dict:
        """What ``Pipeline`` needs for this model (its layers, ties, loss and token count, its
        tensor-parallel plan; no buffers to sync); add the schedule and sizes. ``model`` and
        ``options``: the caller's, with this model's parts set in them (a plan given keeps)."""
        model = model or ModelOptions()
        return dict(layers=self.make_layer, loss_fn=self.loss_fn,
                    model=dataclasses.replace(model, num_layers=self.num_layers,
                                              ties=self.ties or None,
                                              tp_plan=model.tp_plan or self.tp_plan),
                    loss=LossOptions("token_mean", token_count=self.token_count),
                    options=dataclasses.replace(options or ExecOptions(), sync_buffers=False))

    def pipeline(self, *, model: ModelOptions | None = None, options: ExecOptions | None = None,
                 **kwargs):
        """``chimera.api.Pipeline`` of this model: ``pipeline(schedule="chimera", stages=4,
        micro_batches=8, micro_batch_size=2)``. Every rank calls it."""

        return Pipeline(**self.pipeline_kwargs(model, options), **kwargs)

    # -- export ----------------------------------------------------------------------------
    def hf_state_dict(self, state: dict) -> dict[str, torch.Tensor]:
        """A pipeline state dict -> HF names, as ``save_pretrained`` stores them (a tie once,
        under its source name)."""
        out = {}
        for name, t in state.items():
            hf = self.hf_name(name)
            if hf not in self.hf_ties:
                out[hf] = t
        want = {k for k in self.source.state_dict(keep_vars=True) if k not in self.hf_ties}
        if set(out) != want:
            missing, extra = sorted(want - set(out)), sorted(set(out) - want)
            raise UserError(f"not the whole {self.arch}: missing {missing[:4]}, unexpected {extra[:4]}")
        return out

    def save_pretrained(self, state, folder: str | Path) -> Path | None:
        """Write ``folder`` (config.json, model.safetensors) that ``from_pretrained`` loads.
        ``state``: a Pipeline (collective: call on every rank; rank 0 writes, the others
        return None) or a pipeline state dict."""
        if not isinstance(state, dict):
            state = state.state_dict()
            if not state:
                return None
        tensors = self.hf_state_dict(state)
        config = copy.deepcopy(self.config)
        config.architectures = [self.arch]
        config.dtype = next(t.dtype for t in tensors.values() if t.is_floating_point())
        save_folder(Path(folder), tensors, config)
        return Path(folder)


def _on_meta(arch: str, config) -> nn.Module:
    """The whole HF model on the meta device: names, ties, init functions; no memory."""
    import transformers  # start-up time: transformers loads its model classes lazily too

    with torch.device("meta"):
        return getattr(transformers, arch)(config)


# -- load ----------------------------------------------------------------------------------
def load(source, *, dtype: torch.dtype | None = None, attn_implementation: str | None = None,
         architecture: str | None = None, labels_shifted: bool = False) -> HFModel:
    """An :class:`HFModel` from a model object, a config object, a ``config.json`` file or a
    folder (``config.json``, with ``*.safetensors`` weights when ``save_pretrained`` wrote
    them; without weights the layers are initialized as HF does, seeded per layer).

    ``dtype``: the parameters' dtype (default: the model's own, float32 from a config or a
    folder). ``attn_implementation``: "eager" or "sdpa" (default: HF's choice). ``architecture``:
    overrides the config's ``architectures`` (one of ``ARCHS``: GPT2LMHeadModel,
    LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM, Qwen3ForCausalLM, GemmaForCausalLM,
    Phi3ForCausalLM, BertForMaskedLM). ``labels_shifted``: the targets of a causal model are already the next
    tokens (``targets[:, t]`` follows ``inputs[:, t]``, as ``chimera train``'s batches), not
    HF's labels (the input ids, shifted inside the loss). Local files only: nothing is
    downloaded.
    """
    from transformers import PretrainedConfig, PreTrainedModel  # start-up time (see _on_meta)

    model, checkpoint = None, None
    if isinstance(source, PreTrainedModel):
        model, config, arch = source, source.config, type(source).__name__
        if arch not in ARCHS:
            raise UserError(f"{arch} is not supported (chimera.hf supports {SUPPORTED})")
    else:
        if isinstance(source, PretrainedConfig):
            config = copy.deepcopy(source)
        else:
            config, checkpoint = _read_folder(Path(source))
        arch = architecture or _architecture(config)
    check_config(arch, config)
    if attn_implementation is not None:
        if attn_implementation not in ATTENTION:
            raise UserError(f"attn_implementation {attn_implementation!r} is not supported "
                             f"(use one of {ATTENTION})")
        if model is not None and config._attn_implementation != attn_implementation:
            raise UserError(f"the model uses {config._attn_implementation!r} attention; build it with "
                             f"attn_implementation={attn_implementation!r} instead")
        config._attn_implementation = attn_implementation
    return HFModel(arch, config, model, checkpoint, dtype, labels_shifted)


def _read_folder(path: Path):
    if not path.exists():
        raise UserError(f"{path}: no such file or folder (chimera.hf reads local files only: "
                         "a config.json or a save_pretrained folder)")
    file = path if path.is_file() else path / "config.json"
    if not file.is_file():
        raise UserError(f"{path}: no config.json in this folder")
    try:
        raw = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{file}: not a JSON config ({exc})") from None
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if model_type not in {t for t, _, _ in ARCHS.values()}:
        raise UserError(f"{file}: model_type {model_type!r} is not supported (chimera.hf supports "
                         f"{SUPPORTED})")
    from transformers import AutoConfig  # start-up time (see _on_meta)

    config = AutoConfig.for_model(**raw)
    folder = path if path.is_dir() else None
    if folder is None or not Checkpoint.present(folder):
        others = [] if folder is None else sorted(
            p.name for p in folder.glob("*") if p.suffix in (".bin", ".pt", ".pth"))
        if others:
            raise UserError(f"{folder}: only safetensors weights are read, found {others[0]} (save the "
                             "model with save_pretrained(..., safe_serialization=True))")
        return config, None
    return config, Checkpoint(folder)


def _architecture(config) -> str:
    named = list(getattr(config, "architectures", None) or [])
    if named:
        arch = next((a for a in named if a in ARCHS), None)
        if arch is None:
            raise UserError(f"architecture {named[0]} is not supported (chimera.hf supports "
                             f"{SUPPORTED}; pass architecture= to train the weights as one of those)")
        return arch
    by_type = {t: a for a, (t, _, _) in ARCHS.items()}
    if config.model_type not in by_type:
        raise UserError(f"model_type {config.model_type!r} is not supported (chimera.hf supports "
                         f"{SUPPORTED})")
    return by_type[config.model_type]


def check_config(arch: str, config) -> None:
    """Refuse, in one line, what the layers would not compute as HF does."""
    if arch not in ARCHS:
        raise UserError(f"architecture {arch} is not supported (chimera.hf supports {SUPPORTED})")
    want = ARCHS[arch][0]
    if config.model_type != want:
        raise UserError(f"{arch} needs a {want!r} config, got model_type {config.model_type!r} "
                         f"(chimera.hf supports {SUPPORTED})")
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if getattr(config, key, None):
            raise UserError(f"mixture-of-experts configs ({key}={getattr(config, key)}) are not "
                             "supported")
    _check_window(arch, config)
    if getattr(config, "add_cross_attention", False):
        raise UserError(f"{arch} with add_cross_attention=True is not supported")
    if arch == "BertForMaskedLM" and config.is_decoder:
        raise UserError("BertForMaskedLM with is_decoder=True is not supported (bidirectional only)")
    rope = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope in ("dynamic", "longrope"):
        raise UserError(f"rope_type {rope!r} changes with the sequence length and is not supported "
                         "(default, linear, llama3 and yarn are)")


def _check_window(arch: str, config) -> None:
    """Sliding-window attention where HF's model has it (``SLIDING``); elsewhere HF would
    ignore a ``sliding_window`` the config carries, which is refused rather than trained."""
    window = getattr(config, "sliding_window", None)
    if arch not in SLIDING:
        if window or getattr(config, "use_sliding_window", False):
            raise UserError(f"sliding-window attention is not supported for {arch} (HF's {arch} "
                            f"ignores it); {', '.join(SLIDING)} honour it")
        return
    if window is not None and (not isinstance(window, int) or window < 1):
        raise UserError(f"sliding_window must be a positive integer or None, got {window!r}")
    types = getattr(config, "layer_types", None)
    if types is not None:
        other = sorted(set(types) - {"full_attention", "sliding_attention"})
        if other or len(types) < config.num_hidden_layers:
            raise UserError(f"layer_types {other or types} not supported: one of full_attention, "
                            f"sliding_attention per layer")
        if "sliding_attention" in types and window is None:
            raise UserError("layer_types has sliding_attention layers but sliding_window is None")