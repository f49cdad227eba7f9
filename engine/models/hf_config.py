"""From a Hugging Face config (Llama, Qwen2, Qwen3, Qwen3-MoE, Mixtral) to megatron-core's TransformerConfig.

``ModelArchitecture`` is the single, validated reading of the HF config: model dimensions, RoPE,
biases, per-head q/k norms, the Mixture-of-Experts layers, tied embeddings and the TP vocab padding.
The weight mapping, the model builder and the checkpoint code all read it; nothing else parses HF
configs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from parallel.layout import ParallelLayout

# HF model_type -> the prefix of its transformers classes (``Qwen3ForCausalLM``, ...).
MODEL_CLASS_PREFIXES = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "qwen3_moe": "Qwen3Moe",
                        "mixtral": "Mixtral"}
SUPPORTED_MODEL_TYPES = tuple(MODEL_CLASS_PREFIXES)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class UnsupportedModelError(ValueError):
    """The HF config describes something we cannot build; the message names the key."""


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling from the HF ``rope_parameters`` / ``rope_scaling`` entry.

    ``rope_type`` "linear" is position interpolation (Chen et al. 2023): every frequency / factor.
    ``rope_type`` "llama3" keeps high frequencies, divides low ones by ``factor`` and interpolates
    in between (Llama 3.1 report); the wavelength thresholds are
    ``original_max_position_embeddings / {low,high}_freq_factor``.
    """

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class MixtureOfExperts:
    """The MoE layers of an HF config (Qwen3-MoE, Mixtral; no shared experts in either).

    The router as HF computes it: p = softmax(W_gate h) over all experts, the ``topk`` largest, and
    with ``renormalize`` those k weights divided by their sum (Mixtral always; Qwen3-MoE when
    ``norm_topk_prob``). Each chosen expert is a SwiGLU MLP of width ``ffn_hidden_size``.
    """

    num_experts: int
    topk: int
    ffn_hidden_size: int
    renormalize: bool
    layers: tuple[int, ...]  # the MoE layers; the others have a dense MLP (Qwen3-MoE's mlp_only_layers)


@dataclass(frozen=True)
class ModelArchitecture:
    """What we build from an HF decoder config, validated. Field names follow megatron-core."""

    model_type: str
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int  # head dim
    layernorm_epsilon: float
    rotary_base: float
    rope_scaling: RopeScaling | None
    tie_word_embeddings: bool
    add_qkv_bias: bool
    # Qwen3: RMSNorm over head_dim of every q and k head before RoPE (megatron's qk_layernorm).
    qk_layernorm: bool
    max_position_embeddings: int
    init_method_std: float
    attention_dropout: float
    moe: MixtureOfExperts | None = None  # None: a dense model
    # Megatron pads the vocabulary so every TP rank holds an equal, aligned slice.
    make_vocab_size_divisible_by: int = 128
    source_config: Any = field(default=None, compare=False, repr=False)  # the HF PretrainedConfig

    @property
    def heads_per_query_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    def padded_vocab_size(self, tensor_model_parallel_size: int) -> int:
        """Vocab rows in Megatron: rounded up to a multiple of lcm(divisible_by, TP size).

        Megatron-LM pads to divisible_by x TP; we pad to the least common multiple instead, so for
        every TP that divides divisible_by (1, 2, 4, 8, ... with the default 128) the embedding
        has the same shape and a checkpoint saved at one TP loads at another.
        """
        multiple = math.lcm(self.make_vocab_size_divisible_by, tensor_model_parallel_size)
        return int(math.ceil(self.vocab_size / multiple) * multiple)

    def padded_num_query_groups(self, tensor_model_parallel_size: int) -> int:
        """Query groups in Megatron: rounded up to a multiple of TP with all-zero groups.

        A zero group (q, k, v and its o_proj columns 0) adds exactly 0 to the attention output and
        gets zero gradients, so padding changes nothing but compute (see weight_mapping).
        """
        tp = tensor_model_parallel_size
        return int(math.ceil(self.num_query_groups / tp) * tp)

    def validate_layout(self, layout: ParallelLayout) -> None:
        """Raise if the model cannot be split as ``layout`` asks."""
        tp, ep = layout.tensor_model_parallel_size, layout.expert_model_parallel_size
        if self.ffn_hidden_size % tp:
            raise UnsupportedModelError(
                f"intermediate_size={self.ffn_hidden_size} is not divisible by tensor_model_parallel_size={tp}"
            )
        if self.moe is None and (ep > 1 or layout.expert_tensor_parallel_size is not None):
            key = "expert_model_parallel_size" if ep > 1 else "expert_tensor_parallel_size"
            raise UnsupportedModelError(
                f"{key}={getattr(layout, key)} needs a Mixture-of-Experts model; {self.model_type} is dense"
            )
        if self.moe is not None:
            if self.moe.num_experts % ep:
                raise UnsupportedModelError(
                    f"{self.moe.num_experts} experts are not divisible by expert_model_parallel_size={ep}"
                )
            etp = layout.expert_tensor_size
            if self.moe.ffn_hidden_size % etp:
                raise UnsupportedModelError(f"the experts' intermediate size {self.moe.ffn_hidden_size} is not "
                                            f"divisible by the expert tensor-parallel size {etp}")
        stages = layout.pipeline_model_parallel_size * (layout.virtual_pipeline_model_parallel_size or 1)
        if self.num_layers % stages:
            raise UnsupportedModelError(
                f"num_hidden_layers={self.num_layers} is not divisible by pipeline x virtual pipeline "
                f"stages = {stages}"
            )

def load_hf_config(hf_config_or_dir: Any):
    """An HF ``PretrainedConfig`` as is, or the one in a model folder (``config.json``)."""
    if isinstance(hf_config_or_dir, (str, Path)):
        path = Path(hf_config_or_dir)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path}: no config.json (expected a Hugging Face model folder)")
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(path)
    return hf_config_or_dir


def _rope_parameters(hf_config) -> dict:
    # transformers >= 5 keeps everything in `rope_parameters`; older configs have `rope_theta` +
    # `rope_scaling`.
    params = getattr(hf_config, "rope_parameters", None)
    if params:
        if "rope_theta" not in params and any(isinstance(v, dict) for v in params.values()):
            raise UnsupportedModelError("per-layer-type rope_parameters are not supported")
        return dict(params)
    params = dict(getattr(hf_config, "rope_scaling", None) or {})
    params.setdefault("rope_type", params.pop("type", "default"))
    params["rope_theta"] = getattr(hf_config, "rope_theta", 10000.0)
    return params


def _rope_scaling(params: dict) -> RopeScaling | None:
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope scaling type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError("partial_rotary_factor != 1 is not supported")
    if rope_type == "default":
        return None
    if "factor" not in params:
        raise UnsupportedModelError(f"rope scaling {rope_type!r} needs 'factor'")
    if rope_type == "linear":
        return RopeScaling("linear", float(params["factor"]))
    return RopeScaling(
        "llama3",
        factor=float(params["factor"]),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )


def architecture_from_hf(hf_config_or_dir: Any, *, make_vocab_size_divisible_by: int = 128) -> ModelArchitecture:
    """Read and validate a Llama / Qwen2 / Qwen3 / Qwen3-MoE / Mixtral HF config (object or model folder)."""
    hf_config = load_hf_config(hf_config_or_dir)
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"hidden_act {hf_config.hidden_act!r} is not supported (only 'silu')")
    if model_type in ("llama", "mixtral"):
        for key in ("attention_bias", "mlp_bias"):
            if getattr(hf_config, key, False):
                raise UnsupportedModelError(f"{model_type} with {key}=True is not supported")
        if model_type == "mixtral" and hf_config.sliding_window is not None:
            raise UnsupportedModelError("mixtral with a sliding_window is not supported (set it to null)")
        add_qkv_bias = False
    else:
        if getattr(hf_config, "use_sliding_window", False):
            raise UnsupportedModelError(f"{model_type} with use_sliding_window=True is not supported")
        if model_type != "qwen2" and getattr(hf_config, "attention_bias", False):
            # Qwen3's attention_bias also puts a bias on o_proj, which our layer spec does not have.
            raise UnsupportedModelError(f"{model_type} with attention_bias=True is not supported")
        # qwen2: q/k/v projections always carry a bias, o_proj and the MLP none; qwen3(_moe): no bias
        add_qkv_bias = model_type == "qwen2"
    num_heads = hf_config.num_attention_heads
    num_groups = getattr(hf_config, "num_key_value_heads", None) or num_heads
    if num_heads % num_groups:
        raise UnsupportedModelError(
            f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_groups}"
        )
    rope = _rope_parameters(hf_config)
    return ModelArchitecture(
        model_type=model_type,
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_layers=hf_config.num_hidden_layers,
        num_attention_heads=num_heads,
        num_query_groups=num_groups,
        kv_channels=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads,
        layernorm_epsilon=float(hf_config.rms_norm_eps),
        rotary_base=float(rope.get("rope_theta", 10000.0)),
        rope_scaling=_rope_scaling(rope),
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        add_qkv_bias=add_qkv_bias,
        qk_layernorm=model_type in ("qwen3", "qwen3_moe"),
        max_position_embeddings=hf_config.max_position_embeddings,
        init_method_std=float(getattr(hf_config, "initializer_range", 0.02)),
        attention_dropout=float(getattr(hf_config, "attention_dropout", 0.0) or 0.0),
        moe=_mixture_of_experts(hf_config, model_type),
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        source_config=hf_config,
    )


def _mixture_of_experts(hf_config, model_type: str) -> MixtureOfExperts | None:
    num_layers = hf_config.num_hidden_layers
    if model_type == "mixtral":
        if getattr(hf_config, "router_jitter_noise", 0.0):
            raise UnsupportedModelError("mixtral with router_jitter_noise > 0 is not supported")
        moe = MixtureOfExperts(num_experts=hf_config.num_local_experts, topk=hf_config.num_experts_per_tok,
                               ffn_hidden_size=hf_config.intermediate_size, renormalize=True,
                               layers=tuple(range(num_layers)))
    elif model_type == "qwen3_moe":
        # transformers: layer i is MoE unless listed in mlp_only_layers, and only every decoder_sparse_step-th
        dense = set(getattr(hf_config, "mlp_only_layers", None) or ())
        step = hf_config.decoder_sparse_step
        layers = tuple(i for i in range(num_layers) if i not in dense and step > 0 and (i + 1) % step == 0)
        moe = MixtureOfExperts(num_experts=hf_config.num_experts, topk=hf_config.num_experts_per_tok,
                               ffn_hidden_size=hf_config.moe_intermediate_size,
                               renormalize=bool(hf_config.norm_topk_prob), layers=layers)
    else:
        return None
    if moe.topk == 1 and moe.renormalize:
        # megatron takes top-1 only after the softmax, which leaves p_max instead of HF's weight 1.
        raise UnsupportedModelError("num_experts_per_tok=1 with renormalised router weights is not supported")
    if not 0 < moe.topk <= moe.num_experts:
        raise UnsupportedModelError(f"num_experts_per_tok={moe.topk} must be in [1, {moe.num_experts}]")
    return moe


def rope_inverse_frequencies(architecture: ModelArchitecture) -> torch.Tensor:
    """RoPE inverse frequencies [kv_channels / 2], float32, with the config's scaling applied.

    theta_i = base^(-2i/d) (RoFormer, Su et al. 2021); scaling as described in ``RopeScaling``.
    """
    dim = architecture.kv_channels
    inv_freq = 1.0 / (architecture.rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    scaling = architecture.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    wavelength = 2 * math.pi / inv_freq
    long_wavelength = scaling.original_max_position_embeddings / scaling.low_freq_factor
    short_wavelength = scaling.original_max_position_embeddings / scaling.high_freq_factor
    # smooth = 0 at the long-wavelength threshold (fully scaled), 1 at the short one (unscaled)
    smooth = (scaling.original_max_position_embeddings / wavelength - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    interpolated = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = torch.where(wavelength > long_wavelength, inv_freq / scaling.factor, interpolated)
    return torch.where(wavelength < short_wavelength, inv_freq, scaled)


def transformer_config_from_hf(
    hf_config_or_dir: Any,
    layout: ParallelLayout,
    params_dtype: torch.dtype = torch.float32,
    *,
    use_transformer_engine: bool = False,
    perform_initialization: bool = True,
    moe_aux_loss_coeff: float = 0.0,
    **overrides: Any,
):
    """megatron-core ``TransformerConfig`` for a supported HF config split as ``layout``.

    ``moe_aux_loss_coeff``: weight of the load-balancing loss added to an MoE model's loss.
    ``overrides`` are passed through to TransformerConfig (e.g. ``recompute_granularity``).
    """
    from megatron.core.transformer import TransformerConfig

    architecture = (
        hf_config_or_dir
        if isinstance(hf_config_or_dir, ModelArchitecture)
        else architecture_from_hf(hf_config_or_dir)
    )
    architecture.validate_layout(layout)
    if params_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"params_dtype must be float32, bfloat16 or float16, got {params_dtype}")
    # Fused kernels exist only with TE/apex on GPU; the plain-torch paths are numerically the same.
    fused = use_transformer_engine
    config = dict(
        num_layers=architecture.num_layers,
        hidden_size=architecture.hidden_size,
        ffn_hidden_size=architecture.ffn_hidden_size,
        # With head padding (see ModelArchitecture.padded_num_query_groups); == HF when TP divides.
        num_attention_heads=architecture.padded_num_query_groups(layout.tensor_model_parallel_size)
        * architecture.heads_per_query_group,
        num_query_groups=architecture.padded_num_query_groups(layout.tensor_model_parallel_size),
        kv_channels=architecture.kv_channels,
        normalization="RMSNorm",
        layernorm_epsilon=architecture.layernorm_epsilon,
        gated_linear_unit=True,  # SwiGLU: silu(x W_gate) * (x W_up)
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=architecture.add_qkv_bias,
        qk_layernorm=architecture.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=architecture.attention_dropout,
        init_method_std=architecture.init_method_std,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        tensor_model_parallel_size=layout.tensor_model_parallel_size,
        pipeline_model_parallel_size=layout.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=layout.virtual_pipeline_model_parallel_size,
        context_parallel_size=layout.context_parallel_size,
        cp_comm_type=layout.cp_comm_type if layout.context_parallel_size > 1 else None,
        hierarchical_context_parallel_sizes=layout.hierarchical_context_parallel_sizes,
        expert_model_parallel_size=layout.expert_model_parallel_size,
        expert_tensor_parallel_size=layout.expert_tensor_size,
        sequence_parallel=layout.uses_sequence_parallel,
        perform_initialization=perform_initialization,
        bias_activation_fusion=fused,
        masked_softmax_fusion=fused,
        persist_layer_norm=fused,
        apply_rope_fusion=fused,
        gradient_accumulation_fusion=False,  # trained models on GPU: engine.models.gpt.fused_weight_gradients
    )
    if architecture.moe is not None:
        config.update(_moe_settings(architecture, fused, moe_aux_loss_coeff))
    elif moe_aux_loss_coeff:
        raise UnsupportedModelError(f"moe_aux_loss_coeff={moe_aux_loss_coeff}: {architecture.model_type} is dense, "
                                    "without experts to balance")
    config.update(overrides)
    return TransformerConfig(**config)


def _moe_settings(architecture: ModelArchitecture, grouped_gemm: bool, aux_loss_coeff: float) -> dict[str, Any]:
    """TransformerConfig keys of the MoE layers: the router as HF computes it (see MixtureOfExperts),
    the all-to-all token dispatcher, TE's grouped GEMM for the experts where TE is used, and the
    load-balancing loss added with ``aux_loss_coeff`` > 0 (``engine.roles.load_balancing``)."""
    moe = architecture.moe
    return dict(
        num_moe_experts=moe.num_experts,
        moe_ffn_hidden_size=moe.ffn_hidden_size,
        moe_router_topk=moe.topk,
        moe_router_score_function="softmax",
        # pre_softmax: softmax over all experts, then top-k, weights not renormalised (Qwen3-MoE's
        # norm_topk_prob=False). Otherwise softmax over the k largest logits, which equals HF's
        # renormalised top-k of the full softmax.
        moe_router_pre_softmax=not moe.renormalize,
        moe_layer_freq=[int(layer in moe.layers) for layer in range(architecture.num_layers)],
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=grouped_gemm,
        moe_router_load_balancing_type="aux_loss" if aux_loss_coeff else "none",
        moe_aux_loss_coeff=aux_loss_coeff,
    )
