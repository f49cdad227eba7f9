"""A small real chat tokenizer for the data/reward tests, trained in-process (no model hub).

`build_chat_tokenizer()` trains a byte-level BPE with `tokenizers` and wraps it in transformers'
fast tokenizer with a ChatML chat template, the same kind of object an instruct model ships.
"""
from __future__ import annotations

import functools

CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIAL_TOKENS = ["<pad>", "<|im_start|>", "<|im_end|>"]
_CORPUS = [
    "system user assistant",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "How many clips did Natalia sell altogether in April and May?",
    "Let's think step by step and output the final answer after \"####\".",
    "State the final answer to the following arithmetic problem: 12 + 7 - 3 =",
    "<answer>16</answer> #### 72",
]


@functools.lru_cache(maxsize=1)
def build_chat_tokenizer():
    """A trained byte-level BPE (vocab 400) as a transformers fast tokenizer with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(_CORPUS * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<|im_end|>",
                                   chat_template=CHATML_TEMPLATE)


def test_tokenizer_renders_chatml_and_round_trips():
    tokenizer = build_chat_tokenizer()
    messages = [{"role": "user", "content": "What is 12 + 7?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nWhat is 12 + 7?<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert tokenizer.decode(ids) == text
    assert tokenizer.pad_token_id == 0 and tokenizer.eos_token_id == 2
