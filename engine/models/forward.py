"""Forward-only pass of a batch through megatron-core's pipeline schedule.

For tests and for roles that need plain logits / values (reference log-probs, critic values):
the batch is cut into micro-batches, run with ``get_forward_backward_func()(forward_only=True)``
and the outputs are concatenated on the last pipeline stage.
"""

from __future__ import annotations

from typing import Sequence

import torch

from parallel.context_parallel import gather_sequence, row_positions
from parallel.state import device


@torch.no_grad()
def forward_only(
    model_chunks: Sequence[torch.nn.Module],
    input_ids: torch.Tensor,
    *,
    micro_batch_size: int,
    position_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    broadcast_from_last_stage: bool = False,
) -> torch.Tensor | None:
    """Logits [batch, seq, vocab] (real vocab, gathered over TP) or critic values [batch, seq], fp32.

    ``input_ids`` [batch, seq] must be the same on every rank of a model-parallel group.
    ``attention_mask`` follows megatron (bool [batch, 1, seq, seq], True = masked); None means
    causal. Returns the result on the last pipeline stage and None elsewhere, unless
    ``broadcast_from_last_stage`` sends it to every stage.
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    batch_size, seq_length = input_ids.shape
    if batch_size % micro_batch_size:
        raise ValueError(f"batch size {batch_size} is not divisible by micro_batch_size {micro_batch_size}")
    num_microbatches = batch_size // micro_batch_size
    input_ids = input_ids.to(device())
    if position_ids is None:
        position_ids = torch.arange(seq_length, device=device()).unsqueeze(0).expand(batch_size, -1)
    architecture = model_chunks[0].hf_architecture
    is_critic = model_chunks[0].has_value_head
    # Context parallelism: each CP rank runs its load-balanced chunks of every row (the mask stays
    # whole) and the outputs are gathered back in sequence order.
    cp_group = parallel_state.get_context_parallel_group()
    cp_size = parallel_state.get_context_parallel_world_size()
    held = [row_positions(seq_length, cp_size, rank, device()) for rank in range(cp_size)] if cp_size > 1 else None

    def micro_batches():
        for start in range(0, batch_size, micro_batch_size):
            end = start + micro_batch_size
            mask = attention_mask[start:end].to(device()) if attention_mask is not None else None
            tokens, positions = input_ids[start:end], position_ids[start:end].to(device())
            if held is not None:
                mine = held[parallel_state.get_context_parallel_rank()]
                tokens, positions = tokens.index_select(1, mine), positions.index_select(1, mine)
            yield tokens, positions, mask

    def forward_step(data_iterator, model):
        tokens, positions, mask = next(data_iterator)
        output = model(tokens, positions, mask, runtime_gather_output=True)

        def collect(output_tensor, non_loss_data=True):
            if held is not None:
                output_tensor = gather_sequence(output_tensor, held, cp_group, dim=1)
            # [b, s, 1] values, or [b, s, padded vocab] logits whose padding rows we drop
            return output_tensor[..., 0] if is_critic else output_tensor[..., : architecture.vocab_size]

        return output, collect

    was_training = [chunk.training for chunk in model_chunks]
    for chunk in model_chunks:
        chunk.eval()
    try:
        outputs = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=[micro_batches() for _ in model_chunks] if len(model_chunks) > 1 else micro_batches(),
            model=list(model_chunks) if len(model_chunks) > 1 else model_chunks[0],
            num_microbatches=num_microbatches,
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            forward_only=True,
            collect_non_loss_data=True,
        )
    finally:
        for chunk, training in zip(model_chunks, was_training):
            chunk.train(training)

    last_stage = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    result = torch.cat([o.float() for o in outputs], dim=0) if last_stage else None
    if not broadcast_from_last_stage or parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return result
    shape = (batch_size, seq_length) if is_critic else (batch_size, seq_length, architecture.vocab_size)
    if result is None:
        result = torch.empty(shape, dtype=torch.float32, device=device())
    torch.distributed.broadcast(
        result,
        src=parallel_state.get_pipeline_model_parallel_last_rank(),
        group=parallel_state.get_pipeline_model_parallel_group(),
    )
    return result
