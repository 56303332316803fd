"""The tiny test models' tokenizer: a byte-level BPE trained on English that ships with Python.

Nothing can be downloaded, so the text comes from the standard library itself: the language
reference topics in `pydoc_data` (what `help("assert")` prints). It has its own chat template,
so the tests exercise templates other than the real model's ChatML.
"""

from __future__ import annotations

import re

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
SPECIAL_TOKENS = [BOS, EOS, PAD, *ROLE_TOKENS.values()]

# One turn = role marker, newline, content, <|eos|>. A small model learns that shape quickly,
# and ending every turn with EOS makes generation stop on the tokenizer's eos_token_id.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('roles must be system, user or assistant') }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def english_corpus() -> list[str]:
    """The pydoc topics as documents, hard-wrapped prose joined back into paragraphs."""
    from pydoc_data.topics import topics

    return [_unwrap(topics[name]) for name in sorted(topics)]


def _unwrap(text: str) -> str:
    """Join the 72-column wrapped lines of prose paragraphs; keep code, tables and lists as-is."""
    paragraphs = []
    for block in re.split(r"\n\s*\n", text.strip()):
        lines = [line for line in block.split("\n") if not _UNDERLINE.match(line)]
        if any(line.startswith((" ", "+", "|", "* ", "- ")) for line in lines):
            paragraphs.append("\n".join(lines))
        elif lines:
            paragraphs.append(" ".join(line.strip() for line in lines))
    return "\n\n".join(paragraphs)


_UNDERLINE = re.compile(r"^[*=~^-]{3,}$")  # reStructuredText heading underlines


def build_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on texts."""
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_train_bpe(texts, vocab_size),
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=list(ROLE_TOKENS.values()),
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _train_bpe(texts: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    # Like Llama: plain encode() prepends BOS; the chat template writes its own BOS.
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
            ),
        ]
    )
    return tok
