"""Worker: Megatron logits under context parallelism against transformers itself (fp32).

For each HF folder and each layout (models_parity's ``tp,pp,vpp,sp,ep,etp,cp,comm``) in one torchrun world:
- a left-aligned batch (plain causal attention) through ``engine.models.forward.forward_only``, each CP
  rank running its load-balanced chunks, against transformers' logits of the same rows;
- a packed row of three sequences (each padded to the CP x TP multiple) with its block-causal mask,
  against transformers run on each sequence alone, where the comm type takes packed rows (its
  refusal where it does not, as Transformer Engine's: ``parallel.layout.PACKED_ROW_COMM_TYPES``);
- the stand-in's chunks: every rank's ``input_ids`` share is exactly its two chunks (from the
  rotary slice megatron computes, which the CPU adaptation routes through ``row_positions``).
Rank 0 writes the largest differences to --out.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hf-dirs", nargs="+", required=True)
    parser.add_argument("--layouts", nargs="+", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from megatron.core import parallel_state
    from transformers import AutoModelForCausalLM

    from engine.batching import pack_sequences
    from engine.models.checkpoint import load_hf_weights
    from engine.models.forward import forward_only
    from engine.models.gpt import build_model_chunks
    from parallel.context_parallel import ContextParallelAttention
    from parallel.layout import PACKED_ROW_COMM_TYPES
    from parallel.state import destroy_model_parallel
    from tests.dist_workers.models_parity import parse_layout, use_layout

    results: dict = {}
    for hf_dir in map(Path, args.hf_dirs):
        hf_model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        vocab = hf_model.config.vocab_size
        generator = torch.Generator().manual_seed(3)
        tokens = torch.randint(0, vocab, (4, 16), generator=generator)
        lengths = [5, 11, 7]
        sequences = [torch.randint(0, vocab, (1, n), generator=generator) for n in lengths]
        with torch.no_grad():
            reference = hf_model(tokens).logits.float()
            packed_reference = [hf_model(s).logits.float()[0] for s in sequences]
        family: dict = {}
        results[hf_dir.name] = family
        for text in args.layouts:
            layout = parse_layout(text)
            use_layout(layout)
            chunks = build_model_chunks(hf_dir, layout, initialize_weights=False)
            assert load_hf_weights(chunks, hf_dir) == []
            attention = [m for chunk in chunks for m in chunk.modules() if isinstance(m, ContextParallelAttention)]
            if layout.context_parallel_size > 1:  # (CP 1 runs megatron's local attention: a baseline)
                assert attention and all(a.comm_type == layout.cp_comm_type for a in attention), text
            # The tokens each rank's embedding really sees (the first stage's): its share of every row.
            seen: list[int] = []
            def record(module, args, kwargs, output):
                seen.append((args[0] if args else kwargs["input_ids"]).shape[1])

            hooks = [chunk.embedding.register_forward_hook(record, with_kwargs=True)
                     for chunk in chunks if getattr(chunk, "pre_process", False)]
            logits = forward_only(chunks, tokens, micro_batch_size=2, broadcast_from_last_stage=True)
            for hook in hooks:
                hook.remove()

            # Three sequences in one row, each padded to the multiple CP (x TP with SP) needs.
            padded = torch.zeros(3, max(lengths), dtype=torch.long)
            mask = torch.zeros_like(padded)
            for row, sequence in enumerate(sequences):
                padded[row, : lengths[row]] = sequence[0]
                mask[row, : lengths[row]] = 1
            tp_factor = layout.tensor_model_parallel_size if layout.uses_sequence_parallel else 1
            pack = pack_sequences(padded, mask, alignment=2 * layout.context_parallel_size * tp_factor)
            family[text] = {"max_abs_logit_diff": (logits - reference).abs().max().item(),
                            "cp_size": parallel_state.get_context_parallel_world_size(),
                            "embedded_row_lengths": sorted(set(seen))}
            if layout.cp_comm_type in PACKED_ROW_COMM_TYPES:
                packed_logits = forward_only(chunks, pack.input_ids, micro_batch_size=1,
                                             attention_mask=pack.block_causal_mask(), broadcast_from_last_stage=True)
                per_sequence = pack.unpack(packed_logits)
                family[text]["packed_max_abs_logit_diff"] = max(
                    (per_sequence[row, :n] - packed_reference[row]).abs().max().item() for row, n in enumerate(lengths))
            elif layout.pipeline_model_parallel_size == 1:  # (a refusing first stage would leave the next waiting)
                try:  # refused as Transformer Engine refuses it, by every CP rank in its first attention
                    forward_only(chunks, pack.input_ids, micro_batch_size=1, attention_mask=pack.block_causal_mask())
                except ValueError as error:
                    family[text]["packed_refusal"] = str(error)
    # a2a splits the heads: a TP rank's single key/value head cannot be split over 2 CP ranks.
    layout = parse_layout("2,1,0,1,1,0,2,a2a")
    use_layout(layout)
    try:
        build_model_chunks(Path(args.hf_dirs[0]), layout, initialize_weights=False)
    except ValueError as error:
        results["a2a_refusal"] = str(error)
    if torch.distributed.get_rank() == 0:
        Path(args.out).write_text(json.dumps(results, indent=2))
    destroy_model_parallel()


if __name__ == "__main__":
    main()
