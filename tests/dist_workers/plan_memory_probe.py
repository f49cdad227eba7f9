"""Worker: measure the bytes of parameters, gradients and optimizer state of real megatron models.

For each case (layout, architecture, dtype, optimizer) it builds the project's model
(engine.models.gpt.build_model_chunks), wraps it as training does (engine.roles.optim:
megatron DDP + (distributed) Adam), takes one optimizer step so Adam's state exists, and sums the
storage of every tensor: the parameters, DDP's gradient buffers, the fp32 master shards and the
Adam moments. Every rank writes its numbers; the test compares them with launch.memory_model.
"""

import json
import sys

import torch

CASES = [
    # name, model_type, tie, tp, pp, param dtype, distributed optimizer, value head, expert parallel,
    # expert tensor parallel (None: the TP size)
    ("llama_tp2_dp2_bf16_distopt", "llama", False, 2, 1, "bfloat16", True, False, 1, None),
    ("qwen2_pp2_dp2_bf16_distopt_critic", "qwen2", False, 1, 2, "bfloat16", True, True, 1, None),
    ("llama_tied_tp2_pp2_fp32_adam", "llama", True, 2, 2, "float32", False, False, 1, None),
    # experts on 2 EP ranks: their optimizer state sharded over expert-DP 1 (with TP2) and 2 (DP4); whole
    # experts (expert TP 1) at TP2: expert-DP 2
    ("qwen3moe_tp2_ep2_bf16_distopt", "qwen3_moe", False, 2, 1, "bfloat16", True, False, 2, None),
    ("qwen3moe_ep2_dp4_bf16_distopt", "qwen3_moe", False, 1, 1, "bfloat16", True, False, 2, None),
    ("qwen3moe_tp2_ep2_etp1_bf16_distopt", "qwen3_moe", False, 2, 1, "bfloat16", True, False, 2, 1),
]
# The MoE model: 4 experts of 32, top 2, layer 1 dense (a stage of mixed layers).
MOE_FIELDS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[1],
                  decoder_sparse_step=1, norm_topk_prob=True, head_dim=16)


def hf_config(model_type: str, tie: bool):
    from transformers import LlamaConfig, Qwen2Config, Qwen3MoeConfig

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3_moe": Qwen3MoeConfig}[model_type]
    extra = MOE_FIELDS if model_type == "qwen3_moe" else {}
    return cls(hidden_size=64, intermediate_size=160, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=300, max_position_embeddings=64, tie_word_embeddings=tie, **extra)


def storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for tensor in tensors:
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor.numel())
        if key not in seen:
            seen.add(key)
            total += tensor.numel() * tensor.element_size()
    return total


def measure(case) -> dict:
    from megatron.core import parallel_state

    from engine.models.gpt import build_model_chunks
    from engine.config import OptimConfig
    from engine.roles.optim import build_optimizer, wrap_for_training
    from parallel.layout import ParallelLayout
    from parallel.state import initialize_model_parallel

    name, model_type, tie, tp, pp, dtype, distopt, value_head, ep, etp = case
    layout = ParallelLayout(tp, pp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
                            sequence_parallel=tp > 1)
    initialize_model_parallel(layout, seed=3)
    bf16 = dtype == "bfloat16"
    chunks = build_model_chunks(hf_config(model_type, tie), layout, value_head=value_head,
                                params_dtype=torch.bfloat16 if bf16 else torch.float32)
    ddp_chunks = wrap_for_training(chunks, use_distributed_optimizer=distopt)
    optimizer, _ = build_optimizer(ddp_chunks, OptimConfig(lr=1e-3), total_training_steps=1,
                                   use_distributed_optimizer=distopt)
    for chunk in ddp_chunks:
        for buffer in chunk.buffers + chunk.expert_parallel_buffers:
            buffer.grad_data.normal_()  # any finite gradient: Adam creates its state on the first step
    optimizer.step()

    params = storage_bytes(p for chunk in ddp_chunks for p in chunk.parameters())
    grads = sum(b.grad_data.numel() * b.grad_data.element_size() for c in ddp_chunks for b in c.buffers + c.expert_parallel_buffers)
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    state_tensors, master_tensors = [], []
    for opt in inner:
        for state in opt.optimizer.state.values():
            state_tensors += [v for k, v in state.items() if torch.is_tensor(v) and k != "step"]
        for group in getattr(opt, "shard_fp32_from_float16_groups", []):
            master_tensors += list(group)
    result = {
        "case": name,
        "rank": torch.distributed.get_rank(),
        "pipeline_rank": parallel_state.get_pipeline_model_parallel_rank(),
        "data_parallel_size": parallel_state.get_data_parallel_world_size(),
        "param_element_bytes": next(ddp_chunks[0].parameters()).element_size(),
        "params_bytes": params,
        "grads_bytes": grads,
        "optimizer_bytes": storage_bytes(state_tensors) + storage_bytes(master_tensors),
    }
    parallel_state.destroy_model_parallel()
    return result


def main() -> None:
    out = sys.argv[1]
    results = [measure(case) for case in CASES]
    rank = torch.distributed.get_rank()
    with open(f"{out}/rank{rank}.json", "w") as handle:
        json.dump(results, handle)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
