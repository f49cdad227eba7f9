"""What actor, critic and reference share: batches in, megatron pipeline schedules, results out.

Contract with the trainer (SPMD: every rank runs the same calls):

- every rank passes the same global :class:`RolloutBatch`;
- the batch is split over data-parallel ranks (balanced by tokens with ``use_dynamic_bsz``), each
  share into micro-batches (fixed size, or balanced under a token budget), and run through
  megatron-core's pipeline schedule (``get_forward_backward_func``);
- per-token results exist only on the last pipeline stage; they are broadcast over the pipeline
  group, all-gathered over data-parallel ranks and put back in the batch's row order, so every
  rank returns the full ``[B, R]`` result (a few bytes per token, against a forward pass).

Model inputs: with ``use_remove_padding`` each micro-batch is one THD-packed row
(:func:`engine.batching.pack_sequences`), which reaches core attention as ``PackedSeqParams`` (TE's
attention, or ``engine.models.attention``'s varlen path without TE), or as one row with its
block-causal mask for the context-parallel stand-in; otherwise rows are
left-aligned so plain causal attention never sees padding. Pipeline stages may receive activations
of a different shape every micro-batch, so ``variable_seq_lengths`` is switched on for PP > 1; the
interleaved (VPP) schedule deadlocks with it in megatron-core 0.16.1, so there every micro-batch of a
call is padded to one shape instead (``TokenLayout.padded_to``).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from engine.batching import (
    TokenLayout,
    fixed_micro_batches,
    left_align_sequences,
    next_token_labels,
    pack_sequences,
    packing_alignment,
    restore_order,
    split_for_data_parallel,
    token_budget_micro_batches,
)
from engine.config.model import OptimConfig
from engine.models.attention import packs_by_cu_seqlens
from engine.roles import load_balancing
from engine.roles.optim import gather_updated_weights
from engine.roles.batch import RolloutBatch
from parallel.offload import PARTS as OFFLOAD_PARTS
from parallel.offload import ModelOffloader
from parallel.state import device


@dataclass(frozen=True)
class MicroBatchConfig:
    """How one rank's share of a batch is cut into micro-batches.

    Attributes:
        micro_batch_size_per_gpu: sequences per micro-batch (``*_micro_batch_size_per_gpu``).
        use_dynamic_bsz: cut by ``max_token_len_per_gpu`` instead, balancing tokens.
        max_token_len_per_gpu: token budget of one micro-batch on one GPU (``ppo_max_token_len_per_gpu`` /
            ``log_prob_max_token_len_per_gpu``); under context parallelism a GPU holds 1/CP of each
            sequence, so a micro-batch holds CP x this many tokens of whole sequences (verl's Ulysses
            convention).
    """

    micro_batch_size_per_gpu: int = 1
    use_dynamic_bsz: bool = False
    max_token_len_per_gpu: int = 16384

    @classmethod
    def of(cls, micro_batch_size_per_gpu: int | None, use_dynamic_bsz: bool, max_token_len_per_gpu: int
           ) -> "MicroBatchConfig":
        """From a role's ``*micro_batch_size_per_gpu`` (null is allowed with dynamic batching, which
        does not use it) and ``*max_token_len_per_gpu`` settings."""
        return cls(micro_batch_size_per_gpu or 1, use_dynamic_bsz, max_token_len_per_gpu)

    def __post_init__(self) -> None:
        if self.micro_batch_size_per_gpu < 1:
            raise ValueError(f"micro_batch_size_per_gpu must be >= 1, got {self.micro_batch_size_per_gpu}")
        if self.max_token_len_per_gpu < 1:
            raise ValueError(f"max_token_len_per_gpu must be >= 1, got {self.max_token_len_per_gpu}")


@dataclass
class ModelInputs:
    """One micro-batch as the model sees it."""

    layout: TokenLayout
    input_ids: torch.Tensor  # [rows, width] (this rank's tokens under CP)
    labels: torch.Tensor  # next-token ids, [rows, width]
    position_ids: torch.Tensor
    # The CP stand-in (no TE) cannot run THD: a packed row there needs its block-causal mask, made
    # per forward pass (``attention_mask()``) so that it lives only as long as the pass that uses it.
    block_causal: bool
    packed_seq_params: object | None
    padding_mask: torch.Tensor | None = None  # MoE models: True at padding, which the router's losses skip
    # Context parallelism: the layout positions every CP rank holds (rank order); the tensors above
    # hold this rank's (``parallel.context_parallel``), the mask the whole row's. None without CP.
    held_positions: list[torch.Tensor] | None = None
    cp_group: object | None = None

    def attention_mask(self) -> torch.Tensor | None:
        """The model's attention mask: the packed row's block-causal mask (whole, under CP), or None
        for causal attention."""
        return self.layout.block_causal_mask() if self.block_causal else None

    def unpack(self, values: torch.Tensor, fill_value: float = 0.0) -> torch.Tensor:
        """Per-token outputs of this rank's tokens ``[rows, held, ...]`` back to the batch's
        ``[B, S, ...]``: gathered over the CP ranks first (differentiable), then unpacked."""
        if self.held_positions is not None:
            from parallel.context_parallel import gather_sequence

            values = gather_sequence(values, self.held_positions, self.cp_group, dim=1)
        return self.layout.unpack(values, fill_value)


def response_columns(per_position: torch.Tensor, response_length: int) -> torch.Tensor:
    """``[B, S, ...]`` outputs at positions S-R-1 .. S-2, which predict / value the R response
    tokens (see :class:`RolloutBatch`)."""
    seq_len = per_position.shape[1]
    return per_position[:, seq_len - response_length - 1 : seq_len - 1]


class MegatronWorker:
    """Runs batches through this rank's megatron model chunks (see the module docstring).

    Args:
        model_chunks: this rank's GPTModel chunks from ``engine.models.build_model_chunks``
            (unwrapped; export and weight sync read them).
        use_remove_padding: THD sequence packing.
        ddp_chunks: the same chunks wrapped for training (:func:`engine.roles.optim.wrap_for_training`);
            None for forward-only roles.
    """

    def __init__(
        self,
        model_chunks: Sequence[torch.nn.Module],
        *,
        use_remove_padding: bool = True,
        ddp_chunks: Sequence[torch.nn.Module] | None = None,
        optimizer=None,
        offload: Sequence[str] = (),
        offloader: ModelOffloader | None = None,
    ) -> None:
        from megatron.core import parallel_state

        from engine.models.gpt import use_transformer_engine

        self.model_chunks = list(model_chunks)
        self.ddp_chunks = list(ddp_chunks) if ddp_chunks is not None else None
        # What leaves the device outside this worker's passes (``parallel.offload``); a worker on
        # another's chunks (the LoRA reference on the actor's) shares that worker's offloader.
        self.offloader = offloader or ModelOffloader(self.ddp_chunks or self.model_chunks, optimizer, enabled=offload)
        self.model_config = self.model_chunks[0].config
        self.use_remove_padding = use_remove_padding
        self.transformer_engine = use_transformer_engine()
        self.cp_group = parallel_state.get_context_parallel_group()
        self.cp_size = parallel_state.get_context_parallel_world_size()
        self.cp_rank = parallel_state.get_context_parallel_rank()
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.tp_size = parallel_state.get_tensor_model_parallel_world_size()
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        # engine.roles.routing's comparison and replay of the rollout's MoE routing, while they run
        self.rollout_routing: list = []
        self.pp_group = parallel_state.get_pipeline_model_parallel_group()
        self.pp_size = parallel_state.get_pipeline_model_parallel_world_size()
        self.pp_last_rank = parallel_state.get_pipeline_model_parallel_last_rank()
        self.is_last_stage = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        self.dp_group = parallel_state.get_data_parallel_group()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.vpp_size = len(self.model_chunks) if len(self.model_chunks) > 1 else None
        self.alignment = packing_alignment(self.tp_size, self.cp_size, self.model_config.sequence_parallel)
        if self.pp_size > 1 and self.vpp_size is None:
            # Micro-batches differ in shape (packed length, rows); stages then exchange shapes first.
            self.model_config.variable_seq_lengths = True
        self.offloader.offload_enabled()

    # --- splitting --------------------------------------------------------------------------

    def data_parallel_share(self, batch: RolloutBatch, balance_tokens: bool) -> tuple[RolloutBatch, list[list[int]]]:
        """This DP rank's rows of ``batch`` and the index lists of every rank's share."""
        parts = split_for_data_parallel(batch.sequence_lengths(), self.dp_size, balance_tokens)
        return batch.select(parts[self.dp_rank]), parts

    def micro_batch_indices(self, batch: RolloutBatch, config: MicroBatchConfig, config_key: str) -> list[list[int]]:
        """Index lists of the micro-batches of this rank's share."""
        multiple = self.pp_size if self.vpp_size else 1  # the interleaved schedule's requirement
        if config.use_dynamic_bsz:
            # A GPU holds 1/CP of each sequence: the budget counts whole sequences' tokens x CP.
            return token_budget_micro_batches(
                batch.sequence_lengths(), config.max_token_len_per_gpu * self.cp_size, min_num_micro_batches=multiple,
                count_multiple_of=multiple, sync_group=self.pp_group, config_key=config_key,
            )
        parts = fixed_micro_batches(len(batch), config.micro_batch_size_per_gpu)
        if len(parts) % multiple:
            raise ValueError(
                f"the interleaved pipeline schedule (virtual_pipeline_model_parallel_size) needs a "
                f"multiple of pipeline_model_parallel_size={self.pp_size} micro-batches, got "
                f"{len(parts)} ({len(batch)} sequences per rank / micro_batch_size_per_gpu="
                f"{config.micro_batch_size_per_gpu})"
            )
        return parts

    # --- model inputs and the schedule -------------------------------------------------------

    def layout(self, batch: RolloutBatch) -> TokenLayout:
        """The model's token layout of a micro-batch: THD-packed or left-aligned rows."""
        input_ids, attention_mask = batch.input_ids.to(device()), batch.attention_mask.to(device())
        if self.use_remove_padding:
            return pack_sequences(input_ids, attention_mask, self.alignment)
        return left_align_sequences(input_ids, attention_mask, self.alignment)

    def model_inputs(self, layout: TokenLayout) -> ModelInputs:
        rows, width = layout.input_ids.shape
        position_ids = torch.arange(width, device=layout.input_ids.device).unsqueeze(0).expand(rows, -1)
        by_cu_seqlens = layout.is_packed and packs_by_cu_seqlens(self.transformer_engine, self.cp_size)
        packed_seq_params = layout.packed_seq_params() if by_cu_seqlens else None
        padding_mask = None
        if self.model_config.num_moe_experts:
            padding_mask = torch.ones_like(layout.input_ids, dtype=torch.bool)
            padding_mask[layout.layout_rows, layout.layout_cols] = False
        inputs = ModelInputs(layout, layout.input_ids, next_token_labels(layout.input_ids), position_ids,
                             layout.is_packed and packed_seq_params is None, packed_seq_params, padding_mask)
        return self.context_parallel_share(inputs) if self.cp_size > 1 else inputs

    def context_parallel_share(self, inputs: ModelInputs) -> ModelInputs:
        """This CP rank's tokens of ``inputs``: megatron's load-balanced chunks of each row, or of each
        sequence of a THD pack where Transformer Engine runs it (``parallel.context_parallel``). The
        attention mask stays whole: the CP attention picks its queries' rows."""
        from parallel.context_parallel import row_positions, thd_positions

        width = inputs.input_ids.shape[1]
        if inputs.packed_seq_params is not None:
            held = [thd_positions(inputs.layout.cu_seqlens, self.cp_size, rank) for rank in range(self.cp_size)]
        else:
            held = [row_positions(width, self.cp_size, rank) for rank in range(self.cp_size)]
        mine = held[self.cp_rank].to(inputs.input_ids.device)

        def share(tensor):
            return None if tensor is None else tensor.index_select(1, mine.to(tensor.device))

        return replace(inputs, input_ids=share(inputs.input_ids), labels=share(inputs.labels),
                       position_ids=share(inputs.position_ids), padding_mask=share(inputs.padding_mask),
                       held_positions=held, cp_group=self.cp_group)

    def run_schedule(
        self,
        micro_batches: Sequence[RolloutBatch],
        step_fn: Callable[[torch.Tensor, ModelInputs, RolloutBatch], tuple[torch.Tensor, dict]],
        *,
        forward_only: bool,
    ) -> list[dict]:
        """One call of megatron's forward(-backward) schedule over ``micro_batches``.

        ``step_fn(model_output, inputs, micro_batch) -> (loss, results)`` runs on the last stage;
        the list of ``results`` (one per micro-batch) is returned there, ``[]`` elsewhere.
        """
        from megatron.core.pipeline_parallel import get_forward_backward_func

        layouts = [self.layout(mb) for mb in micro_batches]
        if self.vpp_size:
            # The interleaved schedule cannot exchange per-micro-batch shapes (it deadlocks with
            # variable_seq_lengths): give every micro-batch of this call the same block.
            rows = max(layout.input_ids.shape[0] for layout in layouts)
            width = max(layout.input_ids.shape[1] for layout in layouts)
            layouts = [layout.padded_to(rows, width) for layout in layouts]
        inputs = [self.model_inputs(layout) for layout in layouts]
        chunks = self.ddp_chunks if (self.ddp_chunks is not None and not forward_only) else self.model_chunks

        def forward_step(data_iterator, model):
            index = next(data_iterator)
            mb_inputs = inputs[index]
            for routing in self.rollout_routing:
                routing.expect(mb_inputs, micro_batches[index].routed_experts)
            output = model(
                mb_inputs.input_ids, mb_inputs.position_ids, mb_inputs.attention_mask(),
                packed_seq_params=mb_inputs.packed_seq_params, padding_mask=self.stage_padding_mask(model, mb_inputs),
            )
            return output, functools.partial(_call_step, step_fn, mb_inputs, micro_batches[index])

        num = len(inputs)
        iterators = [iter(range(num)) for _ in chunks] if self.vpp_size else iter(range(num))
        training = [chunk.training for chunk in chunks]
        for chunk in chunks:
            chunk.train(not forward_only)
        context = torch.no_grad() if forward_only else contextlib.nullcontext()
        try:
            with context:
                results = get_forward_backward_func()(
                    forward_step_func=forward_step,
                    data_iterator=iterators,
                    model=chunks if self.vpp_size else chunks[0],
                    num_microbatches=num,
                    seq_length=max(i.layout.input_ids.shape[1] for i in inputs),
                    micro_batch_size=max(i.layout.input_ids.shape[0] for i in inputs),
                    forward_only=forward_only,
                )
        finally:
            for chunk, mode in zip(chunks, training):
                chunk.train(mode)
        return list(results) if self.is_last_stage else []

    def stage_padding_mask(self, model, inputs: ModelInputs) -> torch.Tensor | None:
        """The padding mask as ``model``'s MoE layers need it: GPTModel splits it over the sequence-
        parallel ranks only on the first pipeline stage (megatron-core 0.16.1), so later stages get
        their slice here."""
        from megatron.core import tensor_parallel
        from megatron.core.utils import get_attr_wrapped_model

        mask = inputs.padding_mask
        if mask is None or not self.model_config.sequence_parallel or get_attr_wrapped_model(model, "pre_process"):
            return mask
        return tensor_parallel.scatter_to_sequence_parallel_region(mask.transpose(0, 1).contiguous()).transpose(0, 1)

    # --- collecting results ------------------------------------------------------------------

    def forward_per_token(
        self,
        batch: RolloutBatch,
        config: MicroBatchConfig,
        output_fn: Callable[[torch.Tensor, ModelInputs, RolloutBatch], dict[str, torch.Tensor]],
        keys: Sequence[str],
        config_key: str,
    ) -> dict[str, torch.Tensor]:
        """Forward-only pass; ``output_fn`` maps one micro-batch's output to ``[b, R]`` tensors
        named ``keys``. Returns each as ``[B, R]`` float32 (CPU) on every rank, in batch order."""
        with self.offloader.resident("params"):
            return self._forward_per_token(batch, config, output_fn, keys, config_key)

    def _forward_per_token(self, batch, config, output_fn, keys, config_key) -> dict[str, torch.Tensor]:
        local, dp_parts = self.data_parallel_share(batch, balance_tokens=config.use_dynamic_bsz)
        mb_parts = self.micro_batch_indices(local, config, config_key)
        micro_batches = [local.select(ix) for ix in mb_parts]

        def step(output, inputs, micro_batch):
            return torch.zeros((), device=output.device), output_fn(output, inputs, micro_batch)

        results = self.run_schedule(micro_batches, step, forward_only=True)
        shape = (len(local), batch.response_length)
        gathered = {}
        for key in keys:
            if self.is_last_stage:
                tensor = restore_order([r[key].float() for r in results], mb_parts).to(device())
            else:
                tensor = torch.empty(shape, dtype=torch.float32, device=device())
            if self.pp_size > 1:
                dist.broadcast(tensor, src=self.pp_last_rank, group=self.pp_group)
            if self.dp_size > 1:
                shares = [torch.empty_like(tensor) for _ in range(self.dp_size)]
                dist.all_gather(shares, tensor.contiguous(), group=self.dp_group)
            else:
                shares = [tensor]
            gathered[key] = restore_order(shares, dp_parts).cpu()
        return gathered

    def reduce_metrics(self, results: list[dict]) -> dict[str, float]:
        """Sum each metric share over micro-batches and data-parallel ranks (the mini-batch value,
        see ``engine.algo.losses``), on every rank."""
        payload: list = [None]
        if self.is_last_stage:
            keys = sorted(results[0])
            local = torch.stack([sum(r[k].detach().double() for r in results) for k in keys]).to(device())
            if self.dp_size > 1:
                dist.all_reduce(local, group=self.dp_group)
            payload = [dict(zip(keys, local.tolist()))]
        if self.pp_size > 1:
            dist.broadcast_object_list(payload, src=self.pp_last_rank, group=self.pp_group)
        return payload[0]


def _call_step(step_fn, inputs, micro_batch, output_tensor):
    return step_fn(output_tensor, inputs, micro_batch)


@dataclass(frozen=True)
class UpdateSchedule:
    """How a PPO update walks a batch (shared by actor and critic).

    Attributes:
        ppo_epochs: passes over the batch.
        ppo_mini_batch_size: sequences per optimizer step, over all data-parallel ranks (a role's
            ``ppo_mini_batch_size`` counts prompts: times ``rollout.n``).
        micro_batches: how each rank's share of a mini-batch is cut.
        shuffle: reshuffle the batch into mini-batches every epoch (seeded; the same on every
            rank and for every layout, so layouts see identical mini-batches).
        seed: base seed of the shuffling; each update call advances it.
    """

    ppo_epochs: int = 1
    ppo_mini_batch_size: int = 256
    micro_batches: MicroBatchConfig = MicroBatchConfig()
    shuffle: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if self.ppo_epochs < 1:
            raise ValueError(f"ppo_epochs must be >= 1, got {self.ppo_epochs}")
        if self.ppo_mini_batch_size < 1:
            raise ValueError(f"ppo_mini_batch_size must be >= 1, got {self.ppo_mini_batch_size}")


class TrainableWorker(MegatronWorker):
    """A worker with megatron DDP, optimizer and LR schedule, running PPO-style updates."""

    def __init__(self, model_chunks, optim: OptimConfig, total_optimizer_steps: int, *,
                 use_distributed_optimizer: bool, overlap_grad_reduce: bool = False, overlap_param_gather: bool = False,
                 use_remove_padding: bool = True, offload: Sequence[str] = ()):
        from engine.roles.optim import build_optimizer, wrap_for_training

        _check_tensor_parallel_attributes(model_chunks)
        ddp_chunks = wrap_for_training(model_chunks, use_distributed_optimizer, overlap_grad_reduce=overlap_grad_reduce,
                                       overlap_param_gather=overlap_param_gather)
        self.optimizer, self.lr_scheduler = build_optimizer(ddp_chunks, optim, total_optimizer_steps,
                                                            use_distributed_optimizer)
        super().__init__(model_chunks, use_remove_padding=use_remove_padding, ddp_chunks=ddp_chunks,
                         optimizer=self.optimizer, offload=offload)
        self.num_update_calls = 0
        self.is_moe = bool(self.model_config.num_moe_experts)
        if self.is_moe and not self.model_config.moe_aux_loss_coeff:
            load_balancing.record_without_adding(model_chunks)

    def run_updates(
        self,
        batch: RolloutBatch,
        schedule: UpdateSchedule,
        loss_fn: Callable,
        metric_prefix: str,
    ) -> dict[str, float]:
        """Epochs x mini-batches of optimizer steps.

        ``loss_fn(output, inputs, micro_batch, scale) -> LossOutput`` gives the micro-batch's share
        of the mini-batch loss under the global normaliser ``scale`` (``engine.algo.losses``).
        Returns the metrics averaged over optimizer steps, plus ``grad_norm`` (before clipping),
        ``lr`` and, for an MoE model, ``moe_load_balancing_loss`` (``engine.roles.load_balancing``),
        prefixed with ``metric_prefix``; with fp16 also ``loss_scale`` and ``skipped_step_fraction``
        (steps dropped for an overflow, whose grad norm is not averaged).
        """
        with self.offloader.resident(*OFFLOAD_PARTS):
            return self._run_updates(batch, schedule, loss_fn, metric_prefix)

    def _run_updates(self, batch, schedule, loss_fn, metric_prefix) -> dict[str, float]:
        from engine.algo.losses import LossScale, count_tokens_and_sequences

        if len(batch) % schedule.ppo_mini_batch_size:
            raise ValueError(
                f"a batch of {len(batch)} sequences does not split into mini-batches of "
                f"ppo_mini_batch_size={schedule.ppo_mini_batch_size}"
            )
        generator = torch.Generator().manual_seed(schedule.seed + self.num_update_calls)
        self.num_update_calls += 1
        totals: dict[str, float] = {}
        averaged_over: dict[str, int] = {}  # optimizer steps that reported each metric
        for _ in range(schedule.ppo_epochs):
            order = torch.randperm(len(batch), generator=generator) if schedule.shuffle else torch.arange(len(batch))
            for start in range(0, len(batch), schedule.ppo_mini_batch_size):
                mini_batch = batch.select(order[start:start + schedule.ppo_mini_batch_size].tolist())
                local, _ = self.data_parallel_share(mini_batch, balance_tokens=schedule.micro_batches.use_dynamic_bsz)
                parts = self.micro_batch_indices(local, schedule.micro_batches, "ppo_max_token_len_per_gpu")
                micro_batches = [local.select(ix) for ix in parts]
                # Global normaliser of the mini-batch: counts summed over data-parallel ranks.
                counts = count_tokens_and_sequences([local.response_mask]).to(device())
                if self.dp_size > 1:
                    dist.all_reduce(counts, group=self.dp_group)
                # The Dr.GRPO normaliser: responses are padded to data.max_response_length.
                scale = LossScale.from_counts(counts.cpu(), max_response_length=batch.response_length)
                # megatron averages over micro-batches (schedule) and DP ranks (DDP); the shares
                # must be summed, so undo both averages. (Under CP the DDP average also runs over the
                # CP ranks, each holding its tokens' share of the gradient; megatron's schedule
                # multiplies the loss by CP to undo that itself.)
                undo_averaging = len(micro_batches) * self.dp_size

                def step(output, inputs, micro_batch, scale=scale, factor=undo_averaging):
                    result = loss_fn(output, inputs, micro_batch, scale)
                    return result.loss * factor, {k: v.detach() for k, v in result.metrics.items()}

                for chunk in self.ddp_chunks:
                    chunk.zero_grad_buffer()
                self.optimizer.zero_grad()
                load_balancing.clear()
                results = self.run_schedule(micro_batches, step, forward_only=False)
                # Step the schedule first, so optimizer step k uses the LR of step k (1-based):
                # with warm-up from 0 the first step would otherwise not move the weights.
                self.lr_scheduler.step(increment=1)
                updated, grad_norm, _ = self.optimizer.step()
                metrics = self.reduce_metrics(results)
                if self.is_moe:
                    metrics["moe_load_balancing_loss"] = load_balancing.take_load_balancing_loss(
                        self.model_chunks[0].hf_architecture, len(micro_batches))
                if grad_norm is not None:  # None: a skipped fp16 step, which has no norm to average
                    metrics["grad_norm"] = float(grad_norm)
                metrics["lr"] = self.optimizer.param_groups[0]["lr"]
                if self.model_config.fp16:
                    # An fp16 overflow: megatron skipped the step and lowered the loss scale; the
                    # LR schedule must not advance for a step that did not happen.
                    if not updated:
                        self.lr_scheduler.step(increment=-1)
                    metrics["skipped_step_fraction"] = float(not updated)
                    metrics["loss_scale"] = float(self.optimizer.get_loss_scale())
                for key, value in metrics.items():
                    totals[key] = totals.get(key, 0.0) + value
                    averaged_over[key] = averaged_over.get(key, 0) + 1
        gather_updated_weights(self.ddp_chunks)
        return {f"{metric_prefix}/{key}": value / averaged_over[key] for key, value in totals.items()}


def _check_tensor_parallel_attributes(model_chunks) -> None:
    """megatron-core 0.16.1 marks TP-split weights (``tensor_model_parallel``) only inside its
    weight initialisers; chunks built with ``perform_initialization=False`` lack the marks and the
    optimizer then counts only TP rank 0's shards in the gradient norm (wrong clipping)."""
    from megatron.core import parallel_state

    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return
    if not any(getattr(p, "tensor_model_parallel", False) for c in model_chunks for p in c.parameters()):
        raise ValueError(
            "the model chunks have no tensor-parallel weight marks: build them with "
            "build_model_chunks(..., initialize_weights=True) before load_hf_weights (megatron-core "
            "0.16.1 sets `tensor_model_parallel` only while initialising weights); otherwise the "
            "gradient norm and its clipping are wrong under tensor parallelism"
        )
