"""TrainConfig: a training run's configuration, its sections (``chimera.train.sections``) in
one frozen value. It checks its values when it is made and reads no file; what reads files
or builds (the schedule, the model, the data's layout, the preflight) is
``chimera.train.build``. It is written as Python, as ``chimera train`` flags, or as a TOML
file (one table per section), and every checkpoint records it as ``config.toml``:

    TrainConfig(stages=4, lr=1e-3)                       # flat: a field's name is its flag
    TrainConfig(pipeline=Pipeline(stages=4), optim=Optim(lr=1e-3))
    TrainConfig.from_toml("run.toml")                    # chimera train --config run.toml

Imports no torch (the CLI parses and checks flags before torch loads).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields

from chimera.schedules.registry import option_declarations
from chimera.train import build, config_file
from chimera.train.sections import (DTYPES, FLAT, LIMITS, LR_SCHEDULES, RESUME_ALLOWABLE,
                                    SECTIONS, WIRE_DTYPES, ConfigError, Ckpt, Corpus, Net, Optim,
                                    Pipeline, Run)

__all__ = ["TrainConfig", "ConfigError", "DTYPES", "LIMITS", "LR_SCHEDULES", "RESUME_ALLOWABLE",
           "WIRE_DTYPES"]

# What ``get`` builds by name (``chimera.train.build``): for the checkpoint's record, which
# build's checks import and so cannot import build back.
BUILT = ("model_source", "data_info", "mask_id")


@dataclass(frozen=True, init=False)
class TrainConfig:
    net: Net = field(default_factory=Net)
    corpus: Corpus = field(default_factory=Corpus)
    pipeline: Pipeline = field(default_factory=Pipeline)
    optim: Optim = field(default_factory=Optim)
    run: Run = field(default_factory=Run)
    ckpt: Ckpt = field(default_factory=Ckpt)

    def __init__(self, net: Net | None = None, corpus: Corpus | None = None,
                 pipeline: Pipeline | None = None, optim: Optim | None = None,
                 run: Run | None = None, ckpt: Ckpt | None = None, **flat):
        """Sections, and any field by its flat name (its flag's: ``stages=4``), which
        overrides the section's; a scheme option by its name (``pipes=2``) or in
        ``options={...}``."""
        given = {"net": net, "corpus": corpus, "pipeline": pipeline, "optim": optim, "run": run,
                 "ckpt": ckpt}
        for name, value in _by_section(flat, given["pipeline"]).items():
            given[name] = dataclasses.replace(given[name], **value) if given[name] is not None \
                else SECTIONS[name](**value)
        for name, cls in SECTIONS.items():
            value = given[name] if given[name] is not None else cls()
            if not isinstance(value, cls):
                raise ConfigError(f"{name} must be a {cls.__name__}, got {value!r}")
            object.__setattr__(self, name, value)
        self.__post_init__()

    def __post_init__(self) -> None:
        """The checks across sections (each section checks its own values)."""
        if self.net.dtype == "bf16-master" and self.pipeline.shard_optimizer:
            raise ConfigError("--dtype bf16-master with --shard-optimizer is not supported yet: "
                              "the sharded optimizer updates slices of the parameters themselves")

    def get(self, name: str):
        """A value by its flat name (a flag's: ``stages``, ``pipes``), for code that speaks in
        flags (resume's record), or one of ``BUILT``."""
        if name in FLAT and name != "options":
            return getattr(getattr(self, FLAT[name]), name)
        if name in option_declarations():
            return self.pipeline.scheme_options.get(name)
        if name == "options":
            return {k: v for k, v in self.pipeline.options if k not in self.option_fields()} or None
        if name in BUILT:
            return getattr(build, name)(self)
        raise AttributeError(name)

    # -- derived values (no building) ----------------------------------------------
    @property
    def reference(self) -> bool:
        return self.pipeline.reference

    @property
    def n_micro(self) -> int:
        return self.pipeline.n_micro

    @property
    def world(self) -> int:
        return self.pipeline.world

    @property
    def warmup_steps(self) -> int:
        return self.optim.warmup_steps

    @property
    def global_batch(self) -> int:
        """Sequences per pass of the schedule (an optimizer step sums ``grad_accum`` of them)."""
        p = self.pipeline
        return p.data_parallel * p.n_micro * p.micro_batch_size

    @property
    def step_batch(self) -> int:
        """Sequences per optimizer step: ``grad_accum`` mini-batches of ``global_batch``."""
        return self.global_batch * self.optim.grad_accum

    # -- building (kept for callers of the old properties; see chimera.train.build) -----
    def preflight(self) -> "TrainConfig":
        """``chimera.train.build.preflight(self)``: every check that reads files or builds."""
        return build.preflight(self)

    def build_schedule(self):
        """``chimera.train.build.schedule(self)``: the lowered, validated schedule."""
        return build.schedule(self)

    # -- flat views and files ----------------------------------------------------
    def replace(self, **flat) -> "TrainConfig":
        """A copy with fields changed by flat name (``cfg.replace(stages=4)``)."""
        return dataclasses.replace(self, **flat)

    def to_dict(self) -> dict:
        """Every field by its flat name, as the flat config had them (a result's and a bench
        report's ``config``): pipes, chunks and strategy by name, other scheme options in
        ``options`` (None: none)."""
        out = {f.name: getattr(getattr(self, s), f.name) for s, cls in SECTIONS.items()
               for f in fields(cls)}
        out.update({k: self.get(k) for k in self.option_fields()}, options=self.get("options"))
        return out

    def sections(self) -> dict:
        """Section -> {field: value}, as the TOML file holds them (None: left out)."""
        out = {}
        for name, cls in SECTIONS.items():
            section = getattr(self, name)
            table = {f.name: getattr(section, f.name) for f in fields(cls)
                     if getattr(section, f.name) is not None}
            table["options"] = dict(table["options"]) if name == "pipeline" else table.get("options")
            out[name] = {k: list(v) if isinstance(v, tuple) else v for k, v in table.items()
                         if v is not None}
        return out

    def to_toml(self) -> str:
        import tomli_w  # lazy: writing is for runs and checkpoints, reading needs no package

        return tomli_w.dumps(self.sections())

    def save_toml(self, path) -> None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_toml())

    @classmethod
    def from_sections(cls, tables: dict, where: str = "the config") -> "TrainConfig":
        """The inverse of ``sections()``; an unknown table or key is refused by name, with
        where it belongs (``chimera.train.config_file.check_shape``)."""
        config_file.check_shape(tables, where=where)
        return cls(**{name: SECTIONS[name](**{k: tuple(v) if isinstance(v, list) else v
                                              for k, v in table.items()})
                      for name, table in tables.items()})

    @classmethod
    def from_toml(cls, path) -> "TrainConfig":
        """A TOML file's configuration (``chimera.train.config_file``: a regular UTF-8 file
        of at most 1 MiB); a message about one of its values names its file and line."""
        source = config_file.read(path)
        with source.blame():
            return cls.from_sections(source.tables, f"--config {path}")

    @classmethod
    def field_names(cls) -> list[str]:
        """Every field's flat name (its flag's)."""
        return list(FLAT)

    @classmethod
    def option_fields(cls) -> list[str]:
        """The scheme options that were fields of the flat config (pipes, chunks, strategy):
        flat arguments still (``TrainConfig(pipes=2)``); any option is one now."""
        return [k for k in ("chunks", "pipes", "strategy") if k in option_declarations()]


def _by_section(flat: dict, pipeline: Pipeline | None) -> dict[str, dict]:
    """Flat keyword arguments grouped by section. Scheme options: by name (``pipes=2``;
    None unsets) or ``options={...}``, which replaces the options that were not fields of
    the flat config (as it did), onto ``pipeline``'s."""
    out: dict[str, dict] = {}
    declared = option_declarations()
    named = {k: flat.pop(k) for k in list(flat) if k in declared and k not in FLAT}
    for name, value in flat.items():
        if name not in FLAT:
            raise TypeError(f"TrainConfig got an unexpected keyword argument {name!r}")
        out.setdefault(FLAT[name], {})[name] = value
    section = out.get("pipeline", {})
    if "options" not in section and not named:
        return out
    explicit = section.pop("options", None)
    if explicit is not None and not isinstance(explicit, (dict, tuple, list)):
        raise ConfigError(f"options must be a dict of scheme options, got {explicit!r}")
    explicit = dict(explicit or {})
    twice = [k for k, v in named.items() if v is not None and explicit.get(k) is not None]
    if twice:
        raise ConfigError(f"scheme option(s) {', '.join(twice)} given twice: as a field and in options")
    options = dict(pipeline.options) if pipeline is not None else {}
    if "options" in flat:
        options = {k: v for k, v in options.items() if k in TrainConfig.option_fields()}
    options.update(explicit)
    options.update(named)
    section["options"] = tuple(options.items())
    out["pipeline"] = section
    return out
