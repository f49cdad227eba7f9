"""Worker: HF checkpoints -> Megatron chunks at several layouts, against transformers itself.

For each HF folder and each layout (tp,pp,vpp) in one torchrun world (re-initialising megatron's
parallel state between layouts):
- logits of our Megatron model vs. the HF model (fp32) on the same tokens;
- HF -> Megatron -> HF export is bit-exact for every tensor;
- loading another family's checkpoint fails early with a CheckpointError.
With --critic-layouts, also for each HF folder:
- the critic (value head) loads from the LM checkpoint (only the value head missing), returns
  [batch, seq] values equal to HF's final hidden states times the exported value head, and its
  body exports bit-exactly;
- it saves as a sharded HF folder that transformers' *ForTokenClassification reproduces, and that
  loads back into a critic at the second critic layout with identical values.
Rank 0 writes the measurements to --out; any failed check raises.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def parse_layout(text: str):
    from parallel.layout import ParallelLayout

    fields = text.split(",")
    comm = fields.pop() if len(fields) == 8 else "p2p"  # the CP comm type, a name
    values = [int(x) for x in fields]
    tp, pp, vpp, sp, ep, etp, cp = values + [1, 1, 0, 0, 1, 0, 1][len(values):]
    return ParallelLayout(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                          virtual_pipeline_model_parallel_size=vpp or None, sequence_parallel=bool(sp),
                          expert_model_parallel_size=ep, expert_tensor_parallel_size=etp or None,
                          context_parallel_size=cp, cp_comm_type=comm)


def use_layout(layout) -> None:
    from megatron.core import parallel_state

    from parallel.state import initialize_model_parallel

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    initialize_model_parallel(layout, seed=11)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hf-dirs", nargs="+", required=True)
    parser.add_argument("--layouts", nargs="+", required=True, help="tp,pp,vpp[,sp[,ep[,etp[,cp,comm]]]] (vpp 0 = none, sp 1 = sequence parallel, ep = expert parallel, etp = expert tensor parallel, 0 = tp; cp with its cp_comm_type)")
    parser.add_argument("--critic-layouts", nargs="*", default=[])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=12)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--work-dir", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    from engine.models.checkpoint import CheckpointError, export_hf_state_dict, load_hf_weights, save_hf_checkpoint
    from engine.models.forward import forward_only
    from engine.models.gpt import build_model_chunks

    results: dict = {}
    for hf_dir in map(Path, args.hf_dirs):
        hf_model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        vocab = hf_model.config.vocab_size
        tokens = torch.randint(0, vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            reference = hf_model(tokens).logits.float()
            final_hidden = hf_model.model(tokens).last_hidden_state.float()
        original = {}
        for file in sorted(hf_dir.glob("*.safetensors")):
            original.update(load_file(file))
        family: dict = {}
        results[hf_dir.name] = family

        for text in args.layouts:
            layout = parse_layout(text)
            use_layout(layout)
            chunks = build_model_chunks(hf_dir, layout, initialize_weights=False)
            missing = load_hf_weights(chunks, hf_dir)
            assert missing == [], missing
            logits = forward_only(chunks, tokens, micro_batch_size=args.micro_batch, broadcast_from_last_stage=True)
            assert logits.shape == reference.shape, (logits.shape, reference.shape)
            exported = export_hf_state_dict(chunks, destination_rank=None)
            assert sorted(exported) == sorted(original), set(exported) ^ set(original)
            not_equal = [n for n in original if not torch.equal(exported[n], original[n])]
            assert not not_equal, f"{text}: round trip differs for {not_equal}"
            for other in (Path(d) for d in args.hf_dirs if Path(d) != hf_dir):
                try:
                    load_hf_weights(chunks, other)
                except CheckpointError as error:
                    assert "config.json does not describe the built model" in str(error), error
                else:
                    raise AssertionError(f"loading {other} into a {hf_dir.name} model did not fail")
            family[text] = {"max_abs_logit_diff": (logits - reference).abs().max().item(),
                            "round_trip_bit_exact": True, "tensors": len(exported),
                            # MoE: how many experts this rank holds (all of them without expert parallelism)
                            "local_experts": max((len(layer.mlp.local_expert_indices) for chunk in chunks
                                                  for layer in chunk.decoder.layers
                                                  if hasattr(layer.mlp, "local_expert_indices")), default=0)}

        values_by_layout = {}
        for index, text in enumerate(args.critic_layouts):
            layout = parse_layout(text)
            use_layout(layout)
            critic = build_model_chunks(hf_dir, layout, value_head=True, initialize_weights=False)
            source = hf_dir if index == 0 else Path(args.work_dir) / f"{hf_dir.name}-critic"
            missing = load_hf_weights(critic, source)
            from megatron.core import parallel_state

            holds_head = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
            expected_missing = ["output_layer.weight", "output_layer.bias"] if holds_head and index == 0 else []
            assert missing == expected_missing, (missing, expected_missing)
            values = forward_only(critic, tokens, micro_batch_size=args.micro_batch, broadcast_from_last_stage=True)
            assert values.shape == (args.batch, args.seq), values.shape
            exported = export_hf_state_dict(critic, destination_rank=None)
            body = {n for n in original if n != "lm_head.weight"}
            assert set(exported) == body | {"score.weight", "score.bias"}, set(exported) ^ body
            assert all(torch.equal(exported[n], original[n]) for n in body), "critic body differs from checkpoint"
            assert exported["score.weight"].abs().sum() > 0, "value head was not initialised"
            recomputed = final_hidden @ exported["score.weight"].T + exported["score.bias"]
            entry = {"values_shape": list(values.shape),
                     "max_abs_value_diff_vs_hf_hidden": (values - recomputed[..., 0]).abs().max().item()}
            if index == 0:
                out_dir = Path(args.work_dir) / f"{hf_dir.name}-critic"
                # A small shard size forces the sharded layout with model.safetensors.index.json.
                save_hf_checkpoint(critic, out_dir, max_shard_bytes=64 * 1024)
                assert (out_dir / "model.safetensors.index.json").is_file()
                hf_critic = AutoModelForTokenClassification.from_pretrained(out_dir, dtype=torch.float32).eval()
                with torch.no_grad():
                    hf_values = hf_critic(tokens).logits[..., 0]
                entry["max_abs_value_diff_vs_hf_token_classification"] = (values - hf_values).abs().max().item()
                entry["saved_files"] = len(list(out_dir.glob("*.safetensors")))
                from safetensors import safe_open

                writers = set()
                for file in out_dir.glob("*.safetensors"):
                    with safe_open(str(file), "pt") as handle:
                        writers.add(int(handle.metadata()["trident_writer_rank"]))
                entry["writer_ranks"] = sorted(writers)
            else:
                entry["max_abs_value_diff_vs_first_critic_layout"] = (
                    values - values_by_layout[args.critic_layouts[0]]).abs().max().item()
            values_by_layout[text] = values
            family[f"critic {text}"] = entry

    if torch.distributed.get_rank() == 0:
        Path(args.out).write_text(json.dumps(results, indent=2))
    from parallel.state import destroy_model_parallel

    destroy_model_parallel()


if __name__ == "__main__":
    main()
