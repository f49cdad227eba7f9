"""Per-GPU memory of a colocated PPO step, phase by phase, and the HybridEngine's bytes per sync.

Everything here is arithmetic on a model architecture and a layout; nothing is allocated. The
formulas, their sources and the assumptions behind them are written up in docs/planner.md.

Units are bytes (floats: the activation terms are averages over a sequence). Notation follows
Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models",
arXiv:2205.05198): s sequence length, b micro-batch size, h hidden size, a attention heads,
t tensor-parallel size, p pipeline-parallel size, v virtual stages per pipeline rank, L layers;
for Mixture-of-Experts layers E experts, k experts per token, f_e an expert's intermediate size,
e expert-parallel size, t_e expert tensor-parallel size (a divisor of t; megatron's default t).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.models.hf_config import ModelArchitecture
from engine.rollout.base import sglang_static_pool_bytes
from engine.trainer.phases import FORWARD_PHASES, GEN, PHASE_USES, PHASES, TRAIN_PHASES, UPDATE_WEIGHTS, resident_in_phase
from parallel.layout import ParallelLayout

GIB = 1024**3
MIB = 1024**2

RECOMPUTE_GRANULARITIES = (None, "selective", "full")

# Adam with mixed precision (ZeRO paper, Rajbhandari et al. 2020, sec. 3.1): an fp32 master copy
# (4 bytes) plus the first and second moments (4 + 4) per parameter, "K = 12". When the model
# parameters are already fp32 the optimizer steps them in place and only the moments are extra.
ADAM_MOMENT_BYTES = 8
FP32_MASTER_BYTES = 4

# Last pipeline stage of the actor: per token and vocab entry, the logits in the model dtype, an
# fp32 copy for log-softmax / entropy (megatron's vocab-parallel cross entropy writes in place, so
# entropy needs its own copy) and, in training, the fp32 gradient of the logits.
LOGIT_FORWARD_BYTES_FP32 = 4
LOGIT_GRAD_BYTES_FP32 = 4


@dataclass(frozen=True)
class LayerShape:
    """The dimensions of one transformer layer that decide what it saves for backward.

    ``gated_linear_unit`` is SwiGLU (fc1 produces gate and up, 2 x ffn); ``dropout`` adds the
    1-byte masks of the two residual dropouts and the attention dropout; ``flash_attention`` is a
    fused kernel that saves only Q, K, V, the output and the fp32 log-sum-exp per head (Dao et al.
    2022), instead of the [a, s, s] softmax. ``num_experts`` > 0: the MLP is a Mixture-of-Experts
    layer (``moe_topk`` experts of ``moe_ffn_hidden_size`` per token, SwiGLU).
    """

    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    ffn_hidden_size: int
    gated_linear_unit: bool = True
    dropout: bool = False
    flash_attention: bool = True
    num_experts: int = 0
    moe_topk: int = 0
    moe_ffn_hidden_size: int = 0

    @classmethod
    def from_architecture(cls, architecture: ModelArchitecture, flash_attention: bool = True) -> "LayerShape":
        """A Llama / Qwen2 / Qwen3 layer (SwiGLU, no dropout during RLHF training); of an MoE model,
        its MoE layer (every layer counts as one: the published Qwen3-MoE and Mixtral checkpoints have
        no dense layers)."""
        moe = architecture.moe
        return cls(
            hidden_size=architecture.hidden_size,
            num_attention_heads=architecture.num_attention_heads,
            num_query_groups=architecture.num_query_groups,
            kv_channels=architecture.kv_channels,
            ffn_hidden_size=architecture.ffn_hidden_size,
            gated_linear_unit=True,
            dropout=architecture.attention_dropout > 0,
            flash_attention=flash_attention,
            num_experts=moe.num_experts if moe else 0,
            moe_topk=moe.topk if moe else 0,
            moe_ffn_hidden_size=moe.ffn_hidden_size if moe else 0,
        )


def layer_activation_bytes(
    shape: LayerShape,
    tokens: float,
    sequence_length: int,
    tensor_model_parallel_size: int = 1,
    sequence_parallel: bool = False,
    recompute_granularity: str | None = None,
    activation_bytes: int = 2,
    expert_tensor_parallel_size: int | None = None,
) -> float:
    """Bytes one layer keeps for its backward pass, for ``tokens`` = s * b tokens on one GPU.

    Counted term by term (16-bit activations, 1-byte dropout masks), the way Korthikanti et al.
    derive 34 s b h + 5 a s^2 b for a GPT layer; ``tests/test_plan_memory_model.py`` checks that
    this sum reproduces their closed forms. With tensor parallelism the tensors inside the
    attention and MLP blocks are split over t; the layer norms' inputs, the dropout masks and the
    inputs of the first linear of each block are split only with sequence parallelism.

    ``recompute_granularity``: None stores everything; "selective" recomputes the core attention
    (drops the s^2 softmax terms, no effect with flash attention); "full" keeps only the layer input
    (the recomputed layer's own working set is added once per stage by the caller).

    An MoE layer replaces the MLP terms: the router's logits and fp32 probabilities (E per token, on
    the layer's sequence shard) and, for the k b s t_e / t expert inputs each GPU gets under balanced
    routing (k copies of its sequence shard's tokens; megatron's all-to-all dispatcher then gathers
    the t_e expert-TP ranks' rows), the expert fc1 input, fc1 and fc2-input activations split over
    t_e, and the expert output kept to weight it by its routing probability. Skewed routing gives one
    expert-parallel rank more rows than that.
    """
    if recompute_granularity not in RECOMPUTE_GRANULARITIES:
        raise ValueError(f"recompute_granularity must be one of {RECOMPUTE_GRANULARITIES}, got {recompute_granularity!r}")
    t = tensor_model_parallel_size
    sequence_split = t if sequence_parallel else 1
    h = shape.hidden_size
    kv_width = shape.num_query_groups * shape.kv_channels
    q_width = shape.num_attention_heads * shape.kv_channels
    mask = 1 if shape.dropout else 0
    word = activation_bytes
    if recompute_granularity == "full":
        return word * tokens * h / sequence_split

    # Outside the tensor-parallel regions: two norm inputs, two residual-dropout masks, and the
    # inputs of the QKV and fc1 linears (the norms' outputs, gathered from the sequence shards).
    replicated = tokens * (2 * word * h + 2 * mask * h + 2 * word * h)
    # Attention block, split over t: Q, K, V (GQA narrows K and V), the core attention's output
    # (which is also the input of the output projection).
    attention = tokens * word * (q_width + 2 * kv_width + q_width)
    if shape.flash_attention:
        attention += tokens * 4 * shape.num_attention_heads  # fp32 log-sum-exp per head
    elif recompute_granularity != "selective":
        # softmax output, its dropout mask and the dropout output: [a, s, s] per sequence
        scores = tokens * sequence_length * shape.num_attention_heads
        attention += scores * (word + mask + (word if mask else 0))
    # MLP block, split over t: fc1 output (gate and up for SwiGLU, the GeLU input otherwise) and
    # fc2's input (the activation's output).
    if shape.num_experts:
        expert_tp = expert_tensor_parallel_size or t
        router = tokens * shape.num_experts * (word + 4) / sequence_split
        rows = tokens * shape.moe_topk * expert_tp / sequence_split if sequence_parallel else tokens * shape.moe_topk
        experts = rows * word * (2 * h + 3 * shape.moe_ffn_hidden_size / expert_tp)
        return replicated / sequence_split + attention / t + router + experts
    fc1_width = 2 * shape.ffn_hidden_size if shape.gated_linear_unit else shape.ffn_hidden_size
    mlp = tokens * word * (fc1_width + shape.ffn_hidden_size)
    return replicated / sequence_split + (attention + mlp) / t


def context_parallel_exchange_bytes(shape: LayerShape, tokens: float, tensor_model_parallel_size: int,
                                    context_parallel_size: int, comm_type: str, activation_bytes: int = 2) -> float:
    """The K/V exchange buffers of one attention layer on one CP rank, for ``tokens`` of whole
    sequences (the rank holds 1/CP of them): working memory while the layer runs.

    all_gather: the whole sequence's K and V; p2p (ring): the K/V block being computed on and the one
    arriving (2 blocks of this rank's size); a2a: Q, K, V and the output re-laid as the whole sequence
    of 1/CP of the heads (the size of this rank's own); a2a+p2p: both.
    """
    if context_parallel_size == 1:
        return 0.0
    t = tensor_model_parallel_size
    kv = 2 * shape.num_query_groups * shape.kv_channels / t  # K and V widths on this TP rank
    q = shape.num_attention_heads * shape.kv_channels / t
    local = tokens / context_parallel_size
    ring = 2 * local * kv
    all_to_all = local * (2 * q + kv)
    elements = {"all_gather": tokens * kv, "p2p": ring, "a2a": all_to_all, "a2a+p2p": all_to_all + ring}[comm_type]
    return elements * activation_bytes


def moe_dispatch_bytes(shape: LayerShape, tokens: float, tensor_model_parallel_size: int = 1,
                       sequence_parallel: bool = False, activation_bytes: int = 2) -> float:
    """The all-to-all token dispatcher's send and receive buffers of one MoE layer (k rows of h per
    token of the layer's sequence shard): working memory while the layer runs, not kept for backward."""
    sequence_split = tensor_model_parallel_size if sequence_parallel else 1
    return 2 * tokens * shape.moe_topk * shape.hidden_size * activation_bytes / sequence_split


def kv_cache_bytes_per_token(
    architecture: ModelArchitecture, tensor_model_parallel_size: int = 1, kv_cache_dtype_bytes: int = 2
) -> int:
    """KV cache per token on one GPU: 2 (K and V) * layers * kv_heads * head_dim * bytes.

    Query groups are split over the generation TP size; with more ranks than groups each rank keeps
    a replica of one group (the inference engines replicate KV heads rather than split a head).
    """
    groups_per_gpu = max(1, architecture.num_query_groups // tensor_model_parallel_size)
    return 2 * architecture.num_layers * groups_per_gpu * architecture.kv_channels * kv_cache_dtype_bytes


@dataclass(frozen=True)
class StageParameters:
    """Parameters one GPU holds for one pipeline stage (its TP shard; its EP share of the experts)."""

    transformer_layers: int  # experts excluded
    embedding: int
    output_layer: int
    final_norm: int
    experts: int = 0

    @property
    def total(self) -> int:
        return self.transformer_layers + self.embedding + self.output_layer + self.final_norm + self.experts

    @property
    def dense(self) -> int:
        """What the dense data-parallel ranks replicate (experts are replicated over expert-DP ranks)."""
        return self.total - self.experts


def stage_layers(num_layers: int, layout: ParallelLayout, pipeline_rank: int) -> list[int]:
    """The layer indices a pipeline rank holds (all its virtual chunks; ``ParallelLayout.layer_owner``)."""
    return [layer for layer in range(num_layers) if layout.layer_owner(layer, num_layers)[0] == pipeline_rank]


def layer_parameters(architecture: ModelArchitecture, tensor_model_parallel_size: int, layer: int = 0) -> int:
    """Layer ``layer``'s parameters on one TP rank (megatron's padded query groups), its experts
    excluded (``expert_parameters``); an MoE layer's router is replicated on every rank."""
    t = tensor_model_parallel_size
    h = architecture.hidden_size
    shapes = _linear_shapes(architecture, t)
    qkv_in, qkv_rows, _ = shapes["self_attention.linear_qkv"]
    proj_in, _, _ = shapes["self_attention.linear_proj"]
    attention = qkv_in * qkv_rows + proj_in * h
    if architecture.add_qkv_bias:
        attention += qkv_rows
    norms = 2 * h  # RMSNorm weights, replicated on every TP rank
    if architecture.qk_layernorm:
        norms += 2 * architecture.kv_channels
    if architecture.moe is not None and layer in architecture.moe.layers:
        return attention // t + architecture.moe.num_experts * h + norms
    mlp = sum(fan_in * fan_out for fan_in, fan_out, _ in (shapes["mlp.linear_fc1"], shapes["mlp.linear_fc2"]))
    return (attention + mlp) // t + norms


def _linear_shapes(architecture: ModelArchitecture, tensor_model_parallel_size: int) -> dict[str, tuple[int, int, int]]:
    """Megatron's linear layers of a dense transformer layer, unsplit: (in, out, TP-split dim: 0 =
    out / column-parallel, 1 = in / row-parallel), with the query groups padded for TP; SwiGLU fc1
    holds gate and up."""
    h, d, ffn = architecture.hidden_size, architecture.kv_channels, architecture.ffn_hidden_size
    groups = architecture.padded_num_query_groups(tensor_model_parallel_size)
    heads = groups * architecture.heads_per_query_group
    return {
        "self_attention.linear_qkv": (h, (heads + 2 * groups) * d, 0),
        "self_attention.linear_proj": (heads * d, h, 1),
        "mlp.linear_fc1": (h, 2 * ffn, 0),
        "mlp.linear_fc2": (ffn, h, 1),
    }


def adapter_parameters(architecture: ModelArchitecture, tensor_model_parallel_size: int, rank: int,
                       targets: tuple[str, ...], layer: int = 0) -> int:
    """LoRA parameters of layer ``layer`` on one TP rank (``engine.models.lora``): r (in + out) per
    adapted layer, the TP-split factor divided by t (B of column-, A of row-parallel layers)."""
    t = tensor_model_parallel_size
    if architecture.moe is not None and layer in architecture.moe.layers:
        targets = tuple(target for target in targets if not target.startswith("mlp."))
    shapes = _linear_shapes(architecture, t)
    total = 0
    for target in targets:
        fan_in, fan_out, split = shapes[target]
        total += rank * (fan_in + fan_out // t) if split == 0 else rank * (fan_in // t + fan_out)
    return total


def expert_parameters(architecture: ModelArchitecture, tensor_model_parallel_size: int = 1,
                      expert_model_parallel_size: int = 1, layer: int = 0) -> int:
    """Layer ``layer``'s expert weights on one GPU: E / e SwiGLU experts, each split over the
    ``tensor_model_parallel_size`` expert-TP ranks; 0 for a dense layer."""
    moe = architecture.moe
    if moe is None or layer not in moe.layers:
        return 0
    experts = moe.num_experts // expert_model_parallel_size
    return experts * 3 * architecture.hidden_size * moe.ffn_hidden_size // tensor_model_parallel_size


def stage_parameters(
    architecture: ModelArchitecture, layout: ParallelLayout, pipeline_rank: int, value_head: bool = False
) -> StageParameters:
    """Parameters held by one GPU of pipeline rank ``pipeline_rank`` (all its virtual chunks).

    The first rank holds the embedding, the last the final norm and the LM head (or the critic's
    value head, replicated over TP); with tied embeddings and p > 1 megatron keeps a copy of the
    embedding on the last rank for the output layer.
    """
    t = layout.tensor_model_parallel_size
    p = layout.pipeline_model_parallel_size
    vocab_shard = architecture.padded_vocab_size(t) // t * architecture.hidden_size
    first, last = pipeline_rank == 0, pipeline_rank == p - 1
    embedding = vocab_shard if first else 0
    output_layer = 0
    if last:
        if value_head:
            output_layer = architecture.hidden_size + 1
        elif not architecture.tie_word_embeddings or p > 1:
            output_layer = vocab_shard
    layers = stage_layers(architecture.num_layers, layout, pipeline_rank)
    e, expert_tp = layout.expert_model_parallel_size, layout.expert_tensor_size
    return StageParameters(
        transformer_layers=sum(layer_parameters(architecture, t, layer) for layer in layers),
        embedding=embedding,
        output_layer=output_layer,
        final_norm=architecture.hidden_size if last else 0,
        experts=sum(expert_parameters(architecture, expert_tp, e, layer) for layer in layers),
    )


def full_model_parameters(architecture: ModelArchitecture) -> int:
    """Parameters of the whole (unsplit, unpadded) LM: what the generation engine holds in total."""
    h = architecture.hidden_size
    embedding = architecture.vocab_size * h
    output = 0 if architecture.tie_word_embeddings else embedding
    # At TP 1 megatron pads no query group, so one layer there is the unsplit HF layer.
    layers = sum(layer_parameters(architecture, 1, layer) + expert_parameters(architecture, layer=layer)
                 for layer in range(architecture.num_layers))
    return embedding + layers + h + output


def full_expert_parameters(architecture: ModelArchitecture) -> int:
    """The experts' share of ``full_model_parameters``."""
    return sum(expert_parameters(architecture, layer=layer) for layer in range(architecture.num_layers))


def pipeline_layers_in_flight(
    num_layers: int, layout: ParallelLayout, num_microbatches: int, pipeline_rank: int
) -> float:
    """Layer activations a pipeline rank holds at peak, in units of one layer x one micro-batch.

    Without pipelining: all L layers of one micro-batch (gradient accumulation frees each
    micro-batch before the next). 1F1B: rank r runs p - r forward passes over its L/p layers before
    its first backward. The interleaved schedule with v chunks per rank warms up with
    2(p - r - 1) + (v - 1)p chunk-passes (+1 in steady state), each over L/(pv) layers; for rank 0
    that is L (1 + (p - 1)/(p v)) (Korthikanti et al. sec. 4.2.3). Both are capped by the passes
    that exist (m micro-batches, m v chunk-passes).
    """
    p = layout.pipeline_model_parallel_size
    v = layout.virtual_pipeline_model_parallel_size or 1
    if p == 1:
        return float(num_layers)
    if v == 1:
        return min(p - pipeline_rank, num_microbatches) * num_layers / p
    passes = min(2 * (p - pipeline_rank - 1) + (v - 1) * p + 1, num_microbatches * v)
    return passes * num_layers / (p * v)


@dataclass(frozen=True)
class OffloadPolicy:
    """Which parts of a model leave the GPU while another phase runs (verl's *_offload keys)."""

    param_offload: bool = False
    grad_offload: bool = False
    optimizer_offload: bool = False


@dataclass(frozen=True)
class ModelMemoryConfig:
    """One role's model as it lives on the GPUs: architecture, layout, dtypes, batch, offload.

    ``train_tokens_per_microbatch`` / ``forward_tokens_per_microbatch`` are tokens per GPU per
    micro-batch before context parallelism splits them; ``sequence_length`` is the padded
    prompt + response length (it only matters for attention without flash kernels).
    """

    role: str
    architecture: ModelArchitecture
    layout: ParallelLayout
    data_parallel_size: int
    trainable: bool
    value_head: bool = False
    params_dtype_bytes: int = 2
    grad_dtype_bytes: int = 2
    use_distributed_optimizer: bool = True
    recompute_granularity: str | None = None
    train_tokens_per_microbatch: int = 0
    forward_tokens_per_microbatch: int = 0
    sequence_length: int = 0
    num_microbatches: int = 1
    flash_attention: bool = True
    offload: OffloadPolicy = field(default_factory=OffloadPolicy)
    # LoRA: only the adapters (this rank, megatron layer names) have gradients and Adam state.
    lora_rank: int = 0
    lora_targets: tuple[str, ...] = ()

    def adapter_parameters(self, pipeline_rank: int) -> int:
        t = self.layout.tensor_model_parallel_size
        return sum(adapter_parameters(self.architecture, t, self.lora_rank, self.lora_targets, layer)
                   for layer in stage_layers(self.architecture.num_layers, self.layout, pipeline_rank))

    def params_bytes(self, pipeline_rank: int) -> float:
        stage = stage_parameters(self.architecture, self.layout, pipeline_rank, self.value_head)
        return (stage.total + self.adapter_parameters(pipeline_rank)) * self.params_dtype_bytes

    def grad_bytes(self, pipeline_rank: int) -> float:
        if not self.trainable:
            return 0.0
        if self.lora_rank:
            return self.adapter_parameters(pipeline_rank) * self.grad_dtype_bytes
        return stage_parameters(self.architecture, self.layout, pipeline_rank, self.value_head).total * self.grad_dtype_bytes

    def optimizer_bytes(self, pipeline_rank: int) -> float:
        """Adam state; the distributed optimizer shards it over the ranks that replicate each weight:
        data x context parallel ranks, for experts the expert-data-parallel ranks (t d c / (t_e e))."""
        if not self.trainable:
            return 0.0
        per_param = ADAM_MOMENT_BYTES + (FP32_MASTER_BYTES if self.params_dtype_bytes < 4 else 0)
        stage = stage_parameters(self.architecture, self.layout, pipeline_rank, self.value_head)
        replicas = self.data_parallel_size * self.layout.context_parallel_size
        if self.lora_rank:
            adapters = self.adapter_parameters(pipeline_rank)
            return adapters * per_param / (replicas if self.use_distributed_optimizer else 1)
        if not self.use_distributed_optimizer:
            return stage.total * per_param
        layout = self.layout
        expert_replicas = (layout.tensor_model_parallel_size * replicas
                           // (layout.expert_tensor_size * layout.expert_model_parallel_size))
        return (stage.dense / replicas + stage.experts / expert_replicas) * per_param

    def _layer_bytes(self, tokens: float, recompute: str | None) -> float:
        return layer_activation_bytes(
            LayerShape.from_architecture(self.architecture, self.flash_attention),
            tokens / self.layout.context_parallel_size,
            self.sequence_length,
            self.layout.tensor_model_parallel_size,
            self.layout.uses_sequence_parallel,
            recompute,
            self.params_dtype_bytes,
            self.layout.expert_tensor_size,
        )

    def _working_set_bytes(self, tokens: float) -> float:
        """The running layer: all it stores, an MoE layer's dispatcher buffers and the context-parallel
        K/V exchange."""
        shape = LayerShape.from_architecture(self.architecture, self.flash_attention)
        layout = self.layout
        dispatch = moe_dispatch_bytes(shape, tokens / layout.context_parallel_size,
                                      layout.tensor_model_parallel_size, layout.uses_sequence_parallel,
                                      self.params_dtype_bytes) if shape.num_experts else 0.0
        exchange = context_parallel_exchange_bytes(shape, tokens, layout.tensor_model_parallel_size,
                                                   layout.context_parallel_size, layout.cp_comm_type,
                                                   self.params_dtype_bytes)
        return self._layer_bytes(tokens, None) + dispatch + exchange

    def _logit_bytes(self, tokens: float, training: bool) -> float:
        if self.value_head:
            return 0.0
        t = self.layout.tensor_model_parallel_size
        per_entry = self.params_dtype_bytes + LOGIT_FORWARD_BYTES_FP32 + (LOGIT_GRAD_BYTES_FP32 if training else 0)
        return tokens / self.layout.context_parallel_size * self.architecture.padded_vocab_size(t) / t * per_entry

    def train_activation_bytes(self, pipeline_rank: int) -> float:
        """Peak activations of a training step on ``pipeline_rank``: the stored layers of the
        micro-batches in flight, one layer's full working set (the layer in backward, recomputed
        or not), and the logits on the last rank."""
        tokens = self.train_tokens_per_microbatch
        stored_layers = pipeline_layers_in_flight(
            self.architecture.num_layers, self.layout, self.num_microbatches, pipeline_rank
        )
        stored = stored_layers * self._layer_bytes(tokens, self.recompute_granularity)
        working_set = self._working_set_bytes(tokens)
        last = pipeline_rank == self.layout.pipeline_model_parallel_size - 1
        return stored + working_set + (self._logit_bytes(tokens, training=True) if last else 0.0)

    def forward_activation_bytes(self, pipeline_rank: int) -> float:
        """Peak of a forward-only pass (log-probs, values): one layer's working set + logits."""
        tokens = self.forward_tokens_per_microbatch
        last = pipeline_rank == self.layout.pipeline_model_parallel_size - 1
        return self._working_set_bytes(tokens) + (self._logit_bytes(tokens, training=False) if last else 0.0)


@dataclass(frozen=True)
class RolloutMemoryConfig:
    """The generation engine (SGLang semantics), colocated on every training GPU.

    ``gpu_memory_utilization`` is SGLang's ``mem_fraction_static``: the engine's weights plus KV
    cache take that fraction of the memory *free when the engine starts* (``sglang_static_pool_bytes``;
    Trident starts it before any training model, so that is the GPU less the CUDA contexts of the
    trainer and the engine). Its CUDA graphs are captured beside that pool. Weights, KV cache and
    graphs are released during the training phases (the memory saver's three tags) and the weights
    come back from the actor through the HybridEngine; the engine's CUDA context stays. ``in_process``
    is an engine inside each trainer process (HF generate): one full weight copy per rank and a KV
    cache for that rank's sequences, no memory fraction, no process of its own. ``server_gpus`` > 0
    is ``rollout.mode=disaggregated``: servers on GPUs of their own, none of it on the training
    GPUs, each server's pool the fraction of a whole GPU; ``batches_in_flight`` are generating at
    once (``trainer.max_staleness`` of them ahead).
    """

    tensor_model_parallel_size: int
    gpu_memory_utilization: float
    sequences_per_step: int  # prompts x samples per prompt, the whole world
    sequence_length: int  # max prompt + max response tokens
    weight_dtype_bytes: int = 2
    kv_cache_dtype_bytes: int = 2
    update_weights_bucket_megabytes: float = 512.0
    pipeline_model_parallel_size: int = 1
    in_process: bool = False
    server_gpus: int = 0
    batches_in_flight: int = 1

    @property
    def disaggregated(self) -> bool:
        return self.server_gpus > 0

    def replicas(self, world_size: int) -> int:
        gpus = self.server_gpus or world_size
        return gpus // (self.tensor_model_parallel_size * self.pipeline_model_parallel_size)


@dataclass(frozen=True)
class HybridEngineSync:
    """Bytes per GPU of one training -> generation weight sync.

    ``received_bytes``: what HybridFlow's grouping (arXiv:2409.19256, sec. 5.3) moves into each
    GPU: the engine shard M / (t_g p_g) minus what the GPU holds of it already. With t_g <= t that is
    its whole training shard M / (t p), HybridFlow's (t p - t_g p_g) / (t_g p_g t p) * M; with
    t_g > t the engine slice of each layer is inside the training slice, so it holds the slices of
    its own stage's layers only: M / (t_g p). Experts, of which a GPU trains 1 / e of its stage's,
    are counted the same way with p e in place of p and t_e in place of t (the HybridEngine's
    expert phase completes them first; with t_e < t the held expert slice and the engine slice
    line up like this when one contains the other at the same index, as with t_e = 1). ``gather_all_bytes``: the gather-everything
    baseline (DeepSpeed-Chat), (t p d - 1) / (t p d) * M; ``engine_shard_bytes``: the generation
    shard each GPU ends up holding, M / (t_g p_g), pushed in ``buckets`` buckets.
    """

    model_bytes: float
    received_bytes: float
    gather_all_bytes: float
    engine_shard_bytes: float
    bucket_bytes: float
    buckets: int


def hybrid_engine_sync(
    architecture: ModelArchitecture,
    train_layout: ParallelLayout,
    world_size: int,
    rollout: RolloutMemoryConfig,
) -> HybridEngineSync:
    """The HybridEngine transition cost for the actor (``full_model_parameters`` x weight dtype)."""
    t, p = train_layout.tensor_model_parallel_size, train_layout.pipeline_model_parallel_size
    e, expert_tp = train_layout.expert_model_parallel_size, train_layout.expert_tensor_size
    tg, pg = rollout.tensor_model_parallel_size, rollout.pipeline_model_parallel_size
    model_bytes = full_model_parameters(architecture) * rollout.weight_dtype_bytes
    expert_bytes = full_expert_parameters(architecture) * rollout.weight_dtype_bytes
    engine_shard = model_bytes / (tg * pg)
    bucket = rollout.update_weights_bucket_megabytes * MIB
    held = (model_bytes - expert_bytes) / (p * max(t, tg)) + expert_bytes / (p * e * max(expert_tp, tg))
    received = max(0.0, engine_shard - held)
    gather_all = (world_size - 1) / world_size * model_bytes
    return HybridEngineSync(
        model_bytes=model_bytes,
        received_bytes=received,
        gather_all_bytes=gather_all,
        engine_shard_bytes=engine_shard,
        bucket_bytes=bucket,
        buckets=math.ceil(engine_shard / bucket),
    )


# The phases estimated: generation, and each phase that brings parts of a model onto its GPUs.
ESTIMATED_PHASES = (GEN, *(phase for phase in PHASES if phase in PHASE_USES))


@dataclass
class PhaseEstimate:
    """Peak bytes on the fullest GPU during one phase, item by item ("actor/params": bytes)."""

    phase: str
    items: dict[str, float]
    capacity_bytes: float

    @property
    def total_bytes(self) -> float:
        return sum(self.items.values())

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.capacity_bytes

    @property
    def over_by_bytes(self) -> float:
        return max(0.0, self.total_bytes - self.capacity_bytes)


@dataclass
class MemoryPlan:
    """All phases, the HybridEngine sync and the rollout's KV-cache headroom."""

    phases: list[PhaseEstimate]
    sync: HybridEngineSync
    kv_cache_bytes: float  # what the engine has left for KV cache after its weights
    kv_cache_bytes_per_token: int
    max_concurrent_sequences: int  # full-length sequences that fit in that KV cache, per replica
    sequences_per_replica: int
    problems: list[str]

    @property
    def fits(self) -> bool:
        return not self.problems


_OFFLOAD_FLAG = {"params": "param_offload", "grads": "grad_offload", "optimizer": "optimizer_offload"}


def _resident(model: ModelMemoryConfig, part: str, phase: str) -> bool:
    offloaded = [name for name, flag in _OFFLOAD_FLAG.items() if getattr(model.offload, flag)]
    return resident_in_phase(phase, model.role, part, offloaded)


def _static_bytes(model: ModelMemoryConfig, part: str, pipeline_rank: int) -> float:
    return {"params": model.params_bytes, "grads": model.grad_bytes, "optimizer": model.optimizer_bytes}[part](pipeline_rank)


def _pipeline_ranks(model: ModelMemoryConfig) -> list[int]:
    # The first rank holds the most activations and the embedding, the last the LM head and
    # logits; middle ranks hold less than the first.
    return sorted({0, model.layout.pipeline_model_parallel_size - 1})


def _model_items(model: ModelMemoryConfig, phase: str, activation_kind: str | None) -> dict[str, float]:
    """The model's resident state (and activations) on its fullest pipeline rank for ``phase``."""
    best: dict[str, float] = {}
    for rank in _pipeline_ranks(model):
        items = {
            f"{model.role}/{part}": _static_bytes(model, part, rank)
            for part in ("params", "grads", "optimizer")
            if _resident(model, part, phase) and _static_bytes(model, part, rank) > 0
        }
        if activation_kind == "train":
            items[f"{model.role}/activations"] = model.train_activation_bytes(rank)
        elif activation_kind == "forward":
            items[f"{model.role}/activations"] = model.forward_activation_bytes(rank)
        if sum(items.values()) > sum(best.values()) or not best:
            best = items
    return best


def estimate_memory(
    models: list[ModelMemoryConfig],
    rollout: RolloutMemoryConfig,
    world_size: int,
    gpu_memory_bytes: float,
    reserved_bytes: float,
    context_bytes: float = 0.0,
    cuda_graph_bytes: float = 0.0,
) -> MemoryPlan:
    """Per-phase peak memory on the fullest GPU, the sync cost, and what does not fit.

    ``gpu_memory_bytes``: all the GPU has (``nvidia-smi``'s total). ``context_bytes``: one process's
    CUDA context (the trainer's, and the engine's, which stays while it is released).
    ``cuda_graph_bytes``: the engine's CUDA graphs, captured beside its pool and released with it.
    ``reserved_bytes`` covers what no formula here counts (NCCL buffers, allocator fragmentation);
    it is added to every phase.
    """
    by_role = {model.role: model for model in models}
    if "actor" not in by_role:
        raise ValueError("the memory plan needs an 'actor' model")
    actor = by_role["actor"]
    sync = hybrid_engine_sync(actor.architecture, actor.layout, world_size, rollout)
    per_token = kv_cache_bytes_per_token(actor.architecture, rollout.tensor_model_parallel_size, rollout.kv_cache_dtype_bytes)
    replicas = rollout.replicas(world_size)
    sequences_per_replica = math.ceil(rollout.sequences_per_step * rollout.batches_in_flight / replicas)
    if rollout.in_process:
        engine_pool = sync.engine_shard_bytes + per_token * rollout.sequence_length * sequences_per_replica
        free_at_engine_start = gpu_memory_bytes - context_bytes
    elif rollout.disaggregated:  # a server's GPU holds its process alone
        free_at_engine_start = gpu_memory_bytes - context_bytes
        engine_pool = sglang_static_pool_bytes(free_at_engine_start, rollout.gpu_memory_utilization)
    else:  # the engine starts before any training model: only the two processes' contexts are taken
        free_at_engine_start = gpu_memory_bytes - 2 * context_bytes
        engine_pool = sglang_static_pool_bytes(free_at_engine_start, rollout.gpu_memory_utilization)
    phases = []
    for phase in ESTIMATED_PHASES:
        active_role = FORWARD_PHASES.get(phase) or TRAIN_PHASES.get(phase)
        if active_role and active_role not in by_role:
            continue
        items: dict[str, float] = {}
        for model in models:
            kind = None
            if model.role == active_role:
                kind = "train" if phase in TRAIN_PHASES else "forward"
            items.update(_model_items(model, phase, kind))
        if phase == GEN and not rollout.disaggregated:
            items["rollout/weights+kv_cache"] = engine_pool
            if not rollout.in_process and cuda_graph_bytes:
                items["rollout/cuda_graphs"] = cuda_graph_bytes
        elif phase == UPDATE_WEIGHTS and rollout.disaggregated:
            # the sender gathers its stage's whole tensors a bucket at a time: one packed, one broadcast
            items["rollout/sync_buckets"] = 2 * min(sync.bucket_bytes, sync.model_bytes)
        elif phase == UPDATE_WEIGHTS:
            items["rollout/weights"] = sync.engine_shard_bytes
            # one bucket being packed from the training shards, one handed to the engine
            items["rollout/sync_buckets"] = 2 * min(sync.bucket_bytes, sync.engine_shard_bytes)
        if context_bytes:
            items["cuda_contexts"] = context_bytes * (1 if rollout.in_process or rollout.disaggregated else 2)
        items["reserved"] = reserved_bytes
        phases.append(PhaseEstimate(phase, items, gpu_memory_bytes))
    if rollout.disaggregated:  # a server's GPU: its pool (weights + KV cache), graphs and context
        server = {"rollout/weights+kv_cache": engine_pool, "reserved": reserved_bytes}
        if cuda_graph_bytes:
            server["rollout/cuda_graphs"] = cuda_graph_bytes
        if context_bytes:
            server["cuda_contexts"] = context_bytes
        phases.append(PhaseEstimate("server", server, gpu_memory_bytes))

    problems = [
        f"phase {estimate.phase!r} needs {estimate.total_bytes / GIB:.1f} GiB per GPU but the GPU has "
        f"{gpu_memory_bytes / GIB:.1f} GiB (over by {estimate.over_by_bytes / GIB:.1f} GiB); largest items: "
        + ", ".join(f"{name} {value / GIB:.1f}" for name, value in sorted(estimate.items.items(), key=lambda kv: -kv[1])[:3])
        for estimate in phases
        if not estimate.fits
    ]
    kv_bytes = engine_pool - sync.engine_shard_bytes
    max_sequences = int(max(0.0, kv_bytes) // (per_token * rollout.sequence_length))
    if max_sequences < 1:
        problems.append(
            f"phase '{GEN}': the engine's share gpu_memory_utilization={rollout.gpu_memory_utilization} x "
            f"{free_at_engine_start / GIB:.1f} GiB free when it starts = {engine_pool / GIB:.1f} GiB leaves "
            f"{kv_bytes / GIB:.2f} GiB of KV cache after its {sync.engine_shard_bytes / GIB:.1f} GiB weight shard; "
            f"one {rollout.sequence_length}-token sequence needs {per_token * rollout.sequence_length / GIB:.2f} GiB "
            "(raise gpu_memory_utilization or rollout.tensor_model_parallel_size)"
        )
    return MemoryPlan(
        phases=phases,
        sync=sync,
        kv_cache_bytes=kv_bytes,
        kv_cache_bytes_per_token=per_token,
        max_concurrent_sequences=max_sequences,
        sequences_per_replica=sequences_per_replica,
        problems=problems,
    )
