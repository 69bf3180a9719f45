"""A Hugging Face model as ``chimera train``'s model source (``chimera.train.sources``).

``--model hf:PATH`` reads a ``config.json`` (or a folder holding one; with ``save_pretrained``
safetensors beside it, those are the starting weights, each rank reading its stages' tensors);
``hf-llama-tiny``, ``hf-qwen2-tiny``, ``hf-mistral-tiny``, ``hf-qwen3-tiny``,
``hf-gemma-tiny``, ``hf-phi3-tiny`` and ``hf-gpt2-small`` are configs built here. Batches come from
``chimera.data.get_batch``: causal models get targets that are already the next tokens
(``labels_shifted=True``), BERT masked tokens with the tokenizer's mask id (``[MASK]``),
or, where it has none, one after the data's ids.

Vocabulary: a preset's is the data's (as chimera's own presets); an ``hf:`` config keeps its
own, which must hold every id of the data (refused otherwise). Checkpoints key parameters by
HF's names, a tie once under its source (``transformer.wte.weight``), so ``export`` writes
the folder ``save_pretrained`` would.
"""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path

import torch

from chimera import rng
from chimera.byo import layer_seed, merge_ties, seeded
from chimera.data import model_vocab
from chimera.errors import UserError
from chimera.hf.model import NO_TP, TP_ARCHS, HFModel, check_config, load
from chimera.models.packing import document_positions
from chimera.models.source import HF_PREFIX, HF_PRESETS, ModelSource
from chimera.tp import takes_sharded_logits

# HF initializes with torch's global RNG, and patches torch.nn.init while it does: one layer
# at a time per process (virtual ranks are threads of one process)
_BUILDING = rng.LOCK  # one build at a time, and no RNG restore by another thread meanwhile
_VOLATILE = ("transformers_version", "_name_or_path", "architectures", "dtype")


def _kind(arch: str) -> str:
    return "bert" if arch == "BertForMaskedLM" else "gpt2"


def context_of(config) -> int | None:
    """The longest sequence the config's positions cover (``n_positions`` for GPT-2)."""
    return getattr(config, "max_position_embeddings", None)


def preset_config(name: str, vocab_size: int):
    import transformers  # start-up time: transformers loads its model classes lazily too

    arch, fields, _ = HF_PRESETS[name]
    config_class = getattr(transformers, arch).config_class
    return config_class(vocab_size=vocab_size, bos_token_id=None, eos_token_id=None,
                        pad_token_id=None, **fields)


class HFSource(ModelSource):
    sums = True  # HF's loss: summed over target tokens, divided by their count in the mini-batch

    def __init__(self, name: str, arch: str, config, seq_len: int, vocab_size: int,
                 dtype: torch.dtype = torch.float32, weights: str | None = None):
        self.name, self.arch, self.config, self.dtype = name, arch, config, dtype
        self.weights = weights  # a save_pretrained folder (None: HF's init, seeded per layer)
        self.kind, self.seq_len, self.vocab_size = _kind(arch), seq_len, vocab_size
        self._check_sizes()
        self.num_layers = self.model.num_layers
        self.ties = tuple(merge_ties([tuple(pair) for pair in self.model.ties]))

    def _check_sizes(self) -> None:
        if self.config.vocab_size < self.vocab_size:
            what = "ids, BERT's mask id included" if self.kind == "bert" else "ids"
            raise UserError(f"--model {self.name}: its vocab_size {self.config.vocab_size} is smaller "
                             f"than the data's vocabulary ({self.vocab_size} {what}); use a config "
                             f"with vocab_size >= {self.vocab_size}")
        longest = context_of(self.config)
        if not isinstance(self.seq_len, int) or self.seq_len < 1:
            raise UserError(f"--seq-len must be a positive integer, got {self.seq_len!r}")
        if longest is not None and self.seq_len > longest:
            raise UserError(f"--seq-len {self.seq_len} is longer than {self.name}'s "
                             f"max_position_embeddings {longest}")

    @classmethod
    def open(cls, name: str, data_info, seq_len: int | None, dtype: torch.dtype) -> "HFSource":
        """``name``: an HF preset or ``hf:PATH``; sized to the data (``DataInfo``)."""
        if name in HF_PRESETS:
            arch, _, default = HF_PRESETS[name]
            config = preset_config(name, model_vocab(data_info, _kind(arch)))
            return cls(name, arch, config, seq_len or default, config.vocab_size, dtype)
        path = name[len(HF_PREFIX):]
        if not path:
            raise UserError("--model hf:PATH: give a config.json, or a folder holding one (and "
                             "save_pretrained safetensors weights to start from)")
        model = load(path, dtype=dtype, labels_shifted=True)
        model.check_weights()  # here, before any rank builds its layers from them
        weights = path if model.checkpoint is not None else None
        source = cls.__new__(cls)
        source.__dict__["model"] = model  # read once: the weights stay where they are
        cls.__init__(source, name, model.arch, model.config, seq_len or context_of(model.config),
                     model_vocab(data_info, _kind(model.arch)), dtype, weights)
        return source

    @classmethod
    def from_fingerprint(cls, name: str, fingerprint: dict, dtype: torch.dtype) -> "HFSource":
        """The source of a checkpoint's ``meta.json`` (its weights come from the checkpoint)."""
        from transformers import AutoConfig  # start-up time (see preset_config)

        try:
            arch = fingerprint["architecture"]
            config = AutoConfig.for_model(**fingerprint["config"])
            check_config(arch, config)
            return cls(name, arch, config, int(fingerprint["seq_len"]),
                       int(fingerprint["vocab_size"]), dtype)
        except (KeyError, TypeError, ValueError) as exc:
            raise UserError(f"its model_config does not describe a Hugging Face model this "
                             f"version builds: {str(exc).splitlines()[0]}") from None

    @cached_property
    def model(self) -> HFModel:
        """The HF model split into layers (built lazily: a spawned rank rebuilds it)."""
        model = load(self.weights or self.config, dtype=self.dtype, architecture=self.arch,
                     labels_shifted=True)
        model.documents = self.eos_id is not None
        return model

    def keep_documents_apart(self, eos_id: int | None) -> None:
        super().keep_documents_apart(eos_id)
        self.model.documents = True

    def packed(self, ids, segments):
        """HF's packed format: position ids that restart at each document, no attention mask
        (the layers' masks keep documents apart: ``HFModel.documents``)."""
        return {"input_ids": ids, "position_ids": document_positions(segments)}

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "model"}

    # -- the source ---------------------------------------------------------------------
    def layer_costs(self) -> list[float]:
        """As ``chimera.models.layer_costs``: a block's FLOPs is 1.0 (``layer_flops``)."""
        flops = self.layer_flops()
        return [f / flops[1] for f in flops]

    def layer_flops(self) -> list[float]:
        """Forward FLOPs per token: a block's 2 per weight plus attention's 4 T C; the
        embedding a lookup (4 C); the head its projection. Counted on meta."""
        c, t = self.config.hidden_size, self.seq_len
        with _BUILDING, torch.device("meta"):
            counts = [sum(p.numel() for p in self.model.make_layer(i).parameters())
                      for i in range(self.num_layers)]
        return [4.0 * c] + [2.0 * n + 4.0 * t * c for n in counts[1:-1]] + [2.0 * counts[-1]]

    def build_layer(self, index: int, seed: int):
        with _BUILDING, seeded(layer_seed(seed, index)):
            return self.model.make_layer(index)

    @takes_sharded_logits  # HF's losses (hf.layers): whole or vocab-sharded logits
    def loss_fn(self, output, targets):
        return self.model.loss_fn(output, targets)

    def tp_plan(self):
        if self.arch in NO_TP:
            raise UserError(f"--tensor-parallel: {self.name} ({self.arch}): {NO_TP[self.arch]}; "
                            f"GPT-2 presets and Hugging Face {TP_ARCHS} models have one")
        return self.model.tp_plan

    def global_name(self, name: str) -> str:
        return self.model.hf_name(name)

    def fingerprint(self) -> dict:
        config = {k: v for k, v in self.config.to_dict().items() if k not in _VOLATILE}
        return {"source": "hf", "architecture": self.arch, "config": json.loads(json.dumps(config)),
                "seq_len": self.seq_len, "vocab_size": self.vocab_size}

    # -- out ------------------------------------------------------------------------------
    def export(self, state: dict[str, torch.Tensor], folder: str | Path) -> Path:
        """A checkpoint's parameters (HF names, a tie once) -> a ``save_pretrained`` folder."""
        named = {}
        for key, tensor in state.items():
            try:
                named[self.model.pipeline_name(key)] = tensor
            except KeyError as exc:
                raise UserError(f"{exc.args[0]}: not a parameter of this model") from None
        return self.model.save_pretrained(named, folder)
