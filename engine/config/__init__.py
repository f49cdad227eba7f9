"""The experiment config: an OmegaConf-checked schema of dataclasses, loaded from ``yaml/``.

    from engine.config import ConfigError, load_config, to_yaml

    try:
        cfg = load_config("yaml/demo_cpu.yaml", ["data.train_batch_size=16"], world_size=2)
    except ConfigError as err:          # every mistake; the message is for the user
        print(err, file=sys.stderr)
        sys.exit(2)
    cfg.actor_rollout_ref.actor.optim.lr  # plain dataclasses, every interpolation resolved
    (run_dir / "config.yaml").write_text(to_yaml(cfg))

Each section's class is the one settings class of the component that reads it (the actor role,
the rollout engines, the prompt pipeline, ...): no runtime copy of a section exists.
:func:`engine.config.cli.load_config_or_exit` does the try/except above. Importing this package
does not import torch; validation imports the algorithm registry lazily.
"""
from engine.config.actor_rollout_ref import (ActorConfig, ActorRolloutRefConfig, PolicyLossConfig, RefConfig,
                                             RolloutConfig, SamplingConfig)
from engine.config.algorithm import AlgorithmConfig, KLControlConfig, RolloutCorrectionConfig
from engine.config.critic import CriticConfig
from engine.config.data import DataConfig
from engine.config.errors import ConfigError
from engine.config.experiment import ExperimentConfig
from engine.config.loader import load_config, to_yaml
from engine.config.model import MegatronConfig, ModelConfig, OptimConfig, PolicyModelConfig
from engine.config.trainer import TrainerConfig

__all__ = [
    "ActorConfig", "ActorRolloutRefConfig", "AlgorithmConfig", "ConfigError", "CriticConfig", "DataConfig",
    "ExperimentConfig", "KLControlConfig", "MegatronConfig", "ModelConfig", "OptimConfig", "PolicyLossConfig",
    "PolicyModelConfig", "RefConfig", "RolloutConfig", "RolloutCorrectionConfig", "SamplingConfig", "TrainerConfig",
    "load_config", "to_yaml",
]
