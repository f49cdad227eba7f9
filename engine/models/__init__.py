"""Megatron models from Hugging Face checkpoints (Llama, Qwen2), as actor/reference or critic.

- ``hf_config``: ``architecture_from_hf`` (validated HF config), ``transformer_config_from_hf``.
- ``gpt``: ``build_model_chunks(hf_config, layout, value_head=...)``, ``ValueHead``, the layer-spec choice.
- ``weight_mapping``: the HF <-> Megatron parameter mapping as data + pure shard/unshard functions.
- ``checkpoint``: ``load_hf_weights`` (slice-reading), ``export_hf_state_dict``, ``save_hf_checkpoint``.
- ``forward``: ``forward_only`` logits / values through megatron's pipeline schedule.
- ``smollm2``: the packaged SmolLM2-135M-Instruct GGUF as an HF folder.

No module here imports megatron-core at import time.
"""

from engine.models.checkpoint import export_hf_state_dict, load_hf_weights, save_hf_checkpoint
from engine.models.forward import forward_only
from engine.models.gpt import ValueHead, build_model_chunks, use_transformer_engine
from engine.models.hf_config import ModelArchitecture, architecture_from_hf, transformer_config_from_hf

__all__ = [
    "ModelArchitecture", "ValueHead", "architecture_from_hf", "build_model_chunks", "export_hf_state_dict",
    "forward_only", "load_hf_weights", "save_hf_checkpoint", "transformer_config_from_hf",
    "use_transformer_engine",
]
