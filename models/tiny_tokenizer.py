"""The tiny model's tokenizer: byte-level, built in-process, identical on every machine.

Ids 0-2 are the special tokens ``<pad>``, ``<bos>``, ``<eos>``; ids 3-258 are the 256 bytes (in
byte order, through GPT-2's printable byte alphabet), so any text round-trips and nothing is
downloaded. The chat template is ChatML-shaped so environments can render chat messages:

    <bos>user\\nHello<eos>\\n<bos>assistant\\n
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from protocol.errors import ModelError

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")
BYTE_OFFSET = len(SPECIAL_TOKENS)
TINY_VOCAB_MIN = BYTE_OFFSET + 256

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<bos>{{ message['role'] }}\n{{ message['content'] }}<eos>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<bos>assistant\n{% endif %}"
)


def _byte_alphabet() -> list[str]:
    """GPT-2's printable stand-in character for each byte 0..255, in byte order."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    )
    chars = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + n)
            n += 1
    return [chars[b] for b in range(256)]


def build_tiny_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level tokenizer whose ids fit a model with ``vocab_size`` embeddings."""
    if vocab_size < TINY_VOCAB_MIN:
        raise ModelError(f"tiny model vocab_size {vocab_size} < {TINY_VOCAB_MIN} (3 specials + 256 bytes)")
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for i, ch in enumerate(_byte_alphabet()):
        vocab[ch] = BYTE_OFFSET + i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast
