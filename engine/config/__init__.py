"""The experiment config: an OmegaConf-checked schema of dataclasses, loaded from ``yaml/``.

    from engine.config import ConfigError, load_config, to_yaml

    try:
        cfg = load_config("yaml/demo_cpu.yaml", ["data.train_batch_size=16"], world_size=2)
    except ConfigError as err:          # every mistake; the message is for the user
        print(err, file=sys.stderr)
        sys.exit(2)
    cfg.actor_rollout_ref.actor.optim.lr  # plain dataclasses, every interpolation resolved
    (run_dir / "config.yaml").write_text(to_yaml(cfg))

:func:`engine.config.cli.load_config_or_exit` does exactly that try/except. Importing this package
does not import torch; validation imports the algorithm registry lazily.
"""
from engine.config.actor_rollout_ref import (ActorRolloutRefSection, ActorSection, PolicyLossSection,
                                             RefSection, RolloutSection, ValidationSamplingSection)
from engine.config.algorithm import AlgorithmSection, KLControlSection
from engine.config.critic import CriticSection
from engine.config.data import DataSection
from engine.config.errors import ConfigError
from engine.config.experiment import ExperimentConfig
from engine.config.loader import load_config, to_yaml
from engine.config.model import MegatronSection, ModelSection, OptimSection
from engine.config.trainer import TrainerSection

__all__ = [
    "ActorRolloutRefSection", "ActorSection", "AlgorithmSection", "ConfigError", "CriticSection", "DataSection",
    "ExperimentConfig", "KLControlSection", "MegatronSection", "ModelSection", "OptimSection", "PolicyLossSection",
    "RefSection", "RolloutSection", "TrainerSection", "ValidationSamplingSection", "load_config", "to_yaml",
]
