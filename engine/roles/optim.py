"""Training wrappers: megatron DDP, the (distributed) AdamW optimizer and its LR schedule.

The settings are ``*.optim`` (:class:`engine.config.OptimConfig`) and
``*.megatron.use_distributed_optimizer``; the precision is the model's own (``TransformerConfig.bf16``
/ ``fp16``, from ``megatron.param_dtype``): 16-bit parameters get fp32 main weights, fp32 gradient
buffers and fp32 Adam moments; fp16 adds megatron's dynamic loss scaling.
"""

from __future__ import annotations

from typing import Sequence

import torch

from engine.config.model import OptimConfig

# Elements per gradient bucket with overlap_grad_reduce: megatron's default for up to 40 DP ranks.
GRAD_BUCKET_ELEMENTS = 40_000_000


def is_half_precision(model_config) -> bool:
    """Whether a megatron ``TransformerConfig`` holds 16-bit (bf16 / fp16) parameters."""
    return bool(model_config.bf16 or model_config.fp16)


def wrap_for_training(model_chunks: Sequence[torch.nn.Module], use_distributed_optimizer: bool, *,
                      overlap_grad_reduce: bool = False, overlap_param_gather: bool = False) -> list[torch.nn.Module]:
    """megatron DDP around each chunk (16-bit models inside megatron's Float16Module, which casts
    the last stage's output to fp32), with ``finalize_model_grads`` hooked into the model config:
    the DP gradient reduce(-scatter), the sequence-parallel norm-gradient all-reduce and
    tied-embedding sync happen there. Gradients are accumulated and reduced in fp32.

    The overlaps are wired into the model config as Megatron-LM's ``training.py`` does:
    ``no_sync_func`` holds the reduce back until the last micro-batch, ``grad_sync_func`` (per chunk,
    so interleaved chunks start their reduce when their backward ends) and, for the param gather of
    interleaved chunks, ``param_sync_func`` (the schedule starts each chunk's gather before its
    first forward)."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.transformer.module import Float16Module

    if overlap_param_gather and not use_distributed_optimizer:
        raise ValueError("overlap_param_gather needs the distributed optimizer (there is nothing to gather)")
    model_config = model_chunks[0].config
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=use_distributed_optimizer, grad_reduce_in_fp32=True,
        overlap_grad_reduce=overlap_grad_reduce, overlap_param_gather=overlap_param_gather,
        # megatron's default grows with DP past 40 ranks (distributed_data_parallel.py:64-65); fixed, a
        # dp_reshardable optimizer checkpoint (stored by bucket) resumes at any DP size
        bucket_size=GRAD_BUCKET_ELEMENTS if overlap_grad_reduce else None,
        # Interleaved chunks: the schedule starts each chunk's gather (param_sync_func below); one
        # chunk: each bucket's forward hook starts the next bucket's gather.
        align_param_gather=overlap_param_gather and len(model_chunks) > 1,
    )
    wrapped = []
    for chunk in model_chunks:
        module = Float16Module(model_config, chunk) if is_half_precision(model_config) else chunk
        wrapped.append(DistributedDataParallel(model_config, ddp_config, module))
    model_config.finalize_model_grads_func = finalize_model_grads

    def per_chunk(functions):
        return functions[0] if len(functions) == 1 else functions

    if overlap_grad_reduce:
        model_config.no_sync_func = per_chunk([chunk.no_sync for chunk in wrapped])
        model_config.grad_sync_func = per_chunk([chunk.start_grad_sync for chunk in wrapped])
    if ddp_config.align_param_gather:
        model_config.param_sync_func = [chunk.start_param_sync for chunk in wrapped]
    return wrapped


def gather_updated_weights(ddp_chunks: Sequence[torch.nn.Module]) -> None:
    """With ``overlap_param_gather`` the optimizer step leaves each rank with only its own shard of
    the updated weights until the next forward pass gathers them; whatever reads the weights
    between updates (the weight sync, the HF export, offload, the checkpoint) needs them whole now,
    as Megatron-LM gathers before saving (``disable_forward_pre_hook``). A no-op otherwise."""
    for chunk in ddp_chunks:
        if chunk.ddp_config.overlap_param_gather:
            chunk.start_param_sync(force_sync=True)


def build_optimizer(ddp_chunks: Sequence[torch.nn.Module], config: OptimConfig, total_training_steps: int,
                    use_distributed_optimizer: bool):
    """megatron-core AdamW over ``ddp_chunks`` and its ``OptimizerParamScheduler``.

    ``total_training_steps`` counts optimizer steps (mini-batch updates over the whole run): the
    decay runs from the end of warm-up to there. The loss scaler (1 unless fp16) is hooked into
    the model config, where megatron's schedules apply it before each backward pass.
    """
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    if total_training_steps < 1:
        raise ValueError(f"total_training_steps must be >= 1, got {total_training_steps}")
    model_config = ddp_chunks[0].config
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",  # megatron's "adam" is AdamW: decoupled weight decay
            lr=config.lr,
            min_lr=config.min_lr,
            weight_decay=config.weight_decay,
            adam_beta1=config.betas[0],
            adam_beta2=config.betas[1],
            adam_eps=config.eps,
            clip_grad=config.max_grad_norm if config.max_grad_norm > 0 else 0.0,
            bf16=model_config.bf16,
            fp16=model_config.fp16,
            params_dtype=model_config.params_dtype,
            # fp16: dynamic loss scaling (None = dynamic), from 2^16 as Megatron-LM's examples do.
            initial_loss_scale=2.0**16,
            use_distributed_optimizer=use_distributed_optimizer,
        ),
        list(ddp_chunks),
    )
    model_config.grad_scale_func = optimizer.scale_loss
    warmup = config.warmup_steps(total_training_steps)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if warmup > 0 else config.lr,
        max_lr=config.lr,
        min_lr=config.min_lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=max(total_training_steps, warmup + 1),
        lr_decay_style=config.lr_decay_style,
        start_wd=config.weight_decay,
        end_wd=config.weight_decay,
        wd_incr_steps=total_training_steps,
        wd_incr_style="constant",
    )
    return optimizer, scheduler
