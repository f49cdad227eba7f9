"""Worker: a tiny megatron-core GPT trains a few steps at the layout given on the command line.

Checks that real megatron-core layers, the pipeline schedule and the distributed optimizer run on
this device and that the loss is identical to a TP1/PP1 run of the same weights (the caller
compares the printed losses).
"""

import argparse
import json
import os

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--vpp", type=int, default=None)
    parser.add_argument("--sp", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from parallel.layout import ParallelLayout
    from parallel.state import destroy_model_parallel, device, initialize_model_parallel

    layout = ParallelLayout(args.tp, args.pp, args.vpp, sequence_parallel=args.sp)
    initialize_model_parallel(layout, seed=7)

    from megatron.core import parallel_state
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
        tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
        virtual_pipeline_model_parallel_size=args.vpp, sequence_parallel=args.sp,
        pipeline_dtype=torch.float32, bias_activation_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
    )
    chunks = []
    for vp in range(args.vpp or 1):
        pre = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp)
        post = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp)
        model = GPTModel(
            config, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=128,
            max_sequence_length=32, pre_process=pre, post_process=post, vp_stage=vp,
            position_embedding_type="rope",
        )
        chunks.append(model.to(device()))
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True)
    chunks = [DistributedDataParallel(config, ddp_config, m) for m in chunks]
    # DP grad reduce-scatter, SP norm-grad all-reduce and tied-embedding sync happen here.
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=True, clip_grad=1.0), chunks
    )

    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 128, (4, 16), generator=generator).to(device())
    position_ids = torch.arange(16, device=device()).unsqueeze(0).expand(4, -1)

    def batches():
        for start in range(0, 4, 2):
            yield tokens[start:start + 2]

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        output = model(batch, position_ids[: batch.shape[0]], None, labels=batch)

        def loss_func(output_tensor):
            loss = output_tensor.float().mean()
            return loss, {"loss": loss.detach()}

        return output, loss_func

    losses = []
    for _ in range(3):
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        iterators = [batches() for _ in chunks] if len(chunks) > 1 else batches()
        results = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iterators,
            model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=2, seq_length=16,
            micro_batch_size=2, forward_only=False,
        )
        _, grad_norm, _ = optimizer.step()
        if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
            losses.append(sum(r["loss"].item() for r in results) / len(results))
        losses.append(float(grad_norm))
    if torch.distributed.get_rank() == torch.distributed.get_world_size() - 1:
        with open(args.out, "w") as handle:
            json.dump({"values": losses, "rank": int(os.environ["RANK"])}, handle)
    destroy_model_parallel()


if __name__ == "__main__":
    main()
