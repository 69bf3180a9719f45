"""Training: configuration, the per-rank loop, and launching local or torchrun processes."""

from chimera.train.config import ConfigError, TrainConfig

__all__ = ["ConfigError", "TrainConfig", "launch"]


def launch(cfg: TrainConfig) -> dict:
    from chimera.train.launch import launch as _launch

    return _launch(cfg)
