"""A character-level tokenizer for the tiny demo model: one token per printable ASCII character.

It is a plain ``transformers.PreTrainedTokenizerFast`` (a ``tokenizers`` WordLevel model over single
characters), so ``save_pretrained`` / ``AutoTokenizer.from_pretrained`` and every consumer of HF
tokenizers (the prompt pipeline, SGLang, ``generate``) treat it like any other.

Vocabulary: four special tokens, then ``\\n`` and the 95 printable ASCII characters (space to ``~``)::

    0 <|pad|>   1 <|im_start|> (bos, starts the assistant turn)   2 <|im_end|> (eos, ends a turn)   3 <|unk|>

The chat template keeps prompts short on purpose (a ~1M-parameter model pays for every character):
each non-assistant turn is its bare content followed by a newline between turns, an assistant turn is
its content then ``<|im_end|>``, and the generation prompt is the single token ``<|im_start|>``.
``[{"role": "user", "content": "Calculate 5 + 3."}]`` renders as ``Calculate 5 + 3.<|im_start|>``.
"""
from __future__ import annotations

PAD_TOKEN = "<|pad|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
UNK_TOKEN = "<|unk|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START_TOKEN, IM_END_TOKEN, UNK_TOKEN)  # ids 0..3, in this order
PAD_TOKEN_ID, BOS_TOKEN_ID, EOS_TOKEN_ID, UNK_TOKEN_ID = range(len(SPECIAL_TOKENS))
# Newline and printable ASCII (0x20-0x7E); tabs and other control characters map to <|unk|>.
CHARACTERS = "\n" + "".join(chr(code) for code in range(0x20, 0x7F))
VOCAB_SIZE = len(SPECIAL_TOKENS) + len(CHARACTERS)

# Turns are joined by "\n"; an assistant turn ends with <|im_end|>; the generation prompt is <|im_start|>.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "<|im_start|>{{ message['content'] }}<|im_end|>"
    "{%- else -%}"
    "{%- if not loop.first and messages[loop.index0 - 1]['role'] != 'assistant' -%}{{ '\\n' }}{%- endif -%}"
    "{{ message['content'] }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>{%- endif -%}"
)


def build_char_tokenizer(model_max_length: int = 256):
    """The character tokenizer as a ``PreTrainedTokenizerFast`` with pad/bos/eos/unk and the chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS + tuple(CHARACTERS))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    # Every character (newline included: [\s\S], not ".") is its own pre-token, hence its own token.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()  # concatenate, no spaces between characters
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token=PAD_TOKEN, bos_token=IM_START_TOKEN, eos_token=IM_END_TOKEN,
        unk_token=UNK_TOKEN, model_max_length=model_max_length, padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
