"""Check what the config points at before any process group or model is built.

``check_inputs(cfg)`` raises :class:`engine.config.errors.InputError` naming the key and the path
for the inputs users get wrong: the model folders (missing, not a model folder, no weights, an
architecture we do not build), the tokenizer (cannot load, no chat template), the reward function
(cannot import, wrong signature, no scorer for a data source) and, with ``data=True``, the prompt
files (schema, empty after filtering, prompts over the length limit; this tokenizes every prompt,
which the trainer would also do at start-up). ``launch.main`` runs the quick checks on every rank;
the ``trident`` command runs all of them once, before it starts torchrun.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.config.errors import InputError
from engine.config.experiment import ExperimentConfig


def check_inputs(cfg: ExperimentConfig, *, data: bool = True) -> None:
    """Raise ``InputError`` (or ``PromptSchemaError`` for a data row) on the first unusable input."""
    model = cfg.actor_rollout_ref.model
    architecture = check_model_folder("actor_rollout_ref.model.path", model.path)
    check_trainable_layout(architecture, cfg.actor_rollout_ref.actor.megatron, "actor_rollout_ref.actor.megatron")
    check_lora_targets(architecture, model)
    built = cfg.built_models()
    if built.critic:
        if cfg.critic.model.path != model.path:
            architecture = check_model_folder("critic.model.path", cfg.critic.model.path)
        check_trainable_layout(architecture, cfg.critic.megatron, "critic.megatron")
    tokenizer = load_tokenizer(model.tokenizer_path, model.trust_remote_code)
    reward = cfg.reward_model
    if built.reward_model:
        check_model_folder("reward_model.model.path", reward.model.path)
        load_tokenizer(reward.model.tokenizer_path, reward.model.trust_remote_code, key="reward_model.model.tokenizer_path")
    if built.judge_server:
        check_model_folder("reward_model.judge.model.path", reward.judge.model.path)
    if data:
        from engine.data import PromptDataset

        train = PromptDataset.from_config(cfg.data, tokenizer, "train")
        if cfg.data.val_files:
            PromptDataset.from_config(cfg.data, tokenizer, "val")
        check_reward_function(cfg, train.data_sources)
    else:
        check_reward_function(cfg, ())


def check_model_folder(key: str, path: str):
    """A HF model folder we can build: config.json of a supported architecture, safetensors weights.
    Returns its ``ModelArchitecture``."""
    from engine.models.hf_config import UnsupportedModelError, architecture_from_hf

    folder = Path(path)
    if not folder.exists():
        raise InputError(f"{key}={path}: no such folder")
    if not folder.is_dir() or not (folder / "config.json").is_file():
        raise InputError(f"{key}={path}: not a Hugging Face model folder (no config.json)")
    try:
        architecture = architecture_from_hf(folder)
    except UnsupportedModelError as error:
        raise InputError(f"{key}={path}: {error}") from None
    except (OSError, ValueError) as error:  # an unreadable or foreign config.json
        raise InputError(f"{key}={path}: config.json cannot be read: {error}") from None
    if not any(folder.glob("*.safetensors")):
        raise InputError(f"{key}={path}: no *.safetensors weights in the folder (convert .bin checkpoints "
                         f"with transformers' save_pretrained(..., safe_serialization=True))")
    return architecture


def check_trainable_layout(architecture, megatron, key: str) -> None:
    """The model splits as ``key`` asks, and megatron-core can train it so."""
    from engine.models.hf_config import UnsupportedModelError

    try:
        architecture.validate_layout(megatron)
    except UnsupportedModelError as error:
        raise InputError(f"{key}: {error}") from None
    tp = megatron.tensor_model_parallel_size
    if architecture.moe is not None and not megatron.uses_sequence_parallel and tp > 1:
        raise InputError(f"{key}.sequence_parallel=false: megatron-core trains the MoE layers of "
                         f"{architecture.model_type} at tensor_model_parallel_size={tp} only with sequence parallelism")
    if architecture.moe is None and megatron.moe_router_replay:
        raise InputError(f"{key}.moe_router_replay=true: router replay needs a Mixture-of-Experts model; "
                         f"{architecture.model_type} is dense")
    if architecture.moe is None and megatron.moe_aux_loss_coeff > 0:
        raise InputError(f"{key}.moe_aux_loss_coeff={megatron.moe_aux_loss_coeff}: the load-balancing loss needs a "
                         f"Mixture-of-Experts model; {architecture.model_type} is dense")


def check_lora_targets(architecture, model) -> None:
    """LoRA adapts dense layers only: the experts of an MoE model have no adapters yet."""
    lora = model.lora_settings(seed=0)
    if lora is not None and architecture.moe is not None and any(
            layer.startswith("mlp.") for layer in lora.megatron_layers()):
        raise InputError(f"actor_rollout_ref.model.target_modules={model.target_modules}: LoRA on the expert "
                         f"layers of {architecture.model_type} is not built yet; adapt the attention only "
                         "(q_proj, k_proj, v_proj, o_proj)")


def load_tokenizer(path: str, trust_remote_code: bool, key: str = "actor_rollout_ref.model.tokenizer_path") -> Any:
    """The policy's (or the reward model's) tokenizer, which must carry a chat template (prompts are
    chat messages)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as error:  # transformers raises OSError, ValueError, KeyError... for a bad folder
        raise InputError(f"{key}={path}: cannot load a tokenizer: "
                         f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}") from None
    if not getattr(tokenizer, "chat_template", None):
        raise InputError(f"{key}={path}: the tokenizer has no chat template; the "
                         "prompts are chat messages (use an instruct model's tokenizer)")
    return tokenizer


def check_reward_function(cfg: ExperimentConfig, data_sources) -> None:
    """The reward function imports, takes (data_source, solution_str, ground_truth, extra_info) and
    can score every data source of the training prompts (unless the rule score weighs nothing: then
    it is only logged where it can be)."""
    from engine.rewards.manager import RewardManager

    try:
        manager = RewardManager(cfg.reward_model, start_pool=False)
        if cfg.reward_model.combine.needs_rule_scores:
            manager.check_data_sources(data_sources)
    except (OSError, ImportError, AttributeError, TypeError, ValueError) as error:
        raise InputError(str(error)) from None
