"""Worker: the converted SmolLM2-135M-Instruct folder in Megatron at TP2, against transformers.

SmolLM2 has 3 key/value heads, so TP2 exercises query-group padding. Checks, for a few chat
prompts batched with right padding: next-token logits equal HF's (each prompt run alone in HF),
the same greedy next token; and the HF -> Megatron -> HF export is bit-exact. Rank 0 writes the
measurements to --out.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

PROMPTS = (
    "What is 2+3?",
    "Name a colour of the sky.",
    "Write the word 'hello' backwards, then explain in one sentence why reversing strings is useful.",
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hf-dir", required=True)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.models.checkpoint import export_hf_state_dict, load_hf_weights
    from engine.models.forward import forward_only
    from engine.models.gpt import build_model_chunks
    from parallel.layout import ParallelLayout
    from parallel.state import destroy_model_parallel, initialize_model_parallel

    hf_dir = Path(args.hf_dir)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True,
                                      return_dict=True)["input_ids"]
        for p in PROMPTS
    ]
    lengths = [len(ids) for ids in prompts]
    batch = torch.full((len(prompts), max(lengths)), tokenizer.pad_token_id, dtype=torch.long)
    for row, ids in enumerate(prompts):
        batch[row, : len(ids)] = torch.tensor(ids)

    # Plain TP: the prompts' lengths are not multiples of the TP size, which sequence parallelism needs.
    layout = ParallelLayout(tensor_model_parallel_size=args.tp, sequence_parallel=False)
    initialize_model_parallel(layout, seed=5)
    chunks = build_model_chunks(hf_dir, layout, initialize_weights=False)
    assert load_hf_weights(chunks, hf_dir) == []
    logits = forward_only(chunks, batch, micro_batch_size=1)
    ours = torch.stack([logits[row, length - 1] for row, length in enumerate(lengths)])
    exported = export_hf_state_dict(chunks, destination_rank=0)

    if torch.distributed.get_rank() == 0:
        hf_model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            reference = torch.stack([hf_model(torch.tensor([ids])).logits[0, -1] for ids in prompts])
        original = load_file(hf_dir / "model.safetensors")
        assert sorted(exported) == sorted(original), set(exported) ^ set(original)
        not_equal = [name for name in original if not torch.equal(original[name], exported[name])]
        assert not not_equal, f"round trip differs for {not_equal[:5]}"
        log_probs = torch.log_softmax(ours, -1), torch.log_softmax(reference, -1)
        result = {
            "prompt_tokens": lengths,
            "max_abs_logit_diff": (ours - reference).abs().max().item(),
            "max_abs_logit": reference.abs().max().item(),
            "max_abs_logprob_diff": (log_probs[0] - log_probs[1]).abs().max().item(),
            "greedy_tokens_equal": torch.equal(ours.argmax(-1), reference.argmax(-1)),
            "round_trip_bit_exact": True,
            "tensors": len(exported),
        }
        Path(args.out).write_text(json.dumps(result, indent=2))
    destroy_model_parallel()


if __name__ == "__main__":
    main()
