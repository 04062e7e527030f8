"""Tiny random-weight checkpoints with a tokenizer, for the zero-setup demo, tests and benchmarks.

Models cannot be downloaded everywhere pdserve runs (CI, air-gapped machines), so this writes a real
Hugging Face checkpoint directory (config.json, generation_config.json, model.safetensors, and a
``tokenizers`` word-level tokenizer whose vocabulary covers every model token id) that the engine
loads through exactly the code path a real model takes.
"""

from __future__ import annotations

import itertools
import logging
from pathlib import Path

logger = logging.getLogger(__name__)

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
_SPECIAL = ["<unk>", "<s>", "</s>"]
_WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "a",
    "is",
    "that",
    "for",
    "it",
    "as",
    "was",
    "with",
    "be",
    "by",
    "on",
    "not",
    "he",
    "this",
    "are",
    "or",
    "his",
    "from",
    "at",
    "which",
    "but",
    "have",
    "an",
    "they",
    "you",
    "were",
    "her",
    "she",
    "there",
    "been",
    "one",
    "all",
    "we",
    "their",
    "has",
    "would",
    "when",
    "if",
    "so",
    "no",
    "will",
    "more",
    "can",
    "what",
    "up",
    "out",
    "into",
    "time",
    "only",
    "new",
    "some",
    "could",
    "these",
    "two",
    "may",
    "first",
    "then",
    "do",
    "any",
    "like",
    "my",
    "now",
    "over",
    "such",
    "our",
    "man",
    "me",
    "even",
    "most",
    "made",
    "after",
    "also",
    "did",
    "many",
    "before",
    "must",
    "through",
    "back",
    "years",
    "where",
    "much",
    "your",
    "way",
    "well",
    "down",
    "should",
    "because",
    "each",
    "just",
    "those",
    "people",
    "how",
    "too",
    "little",
    "state",
    "good",
    "very",
    "make",
    "world",
    "still",
    "own",
    "see",
    "men",
    "work",
    "long",
    "get",
    "here",
    "between",
    "both",
    "life",
    "being",
    "under",
    "never",
    "day",
    "same",
    "another",
    "know",
    "while",
]


# The ~32M-parameter Llama shape of the demo and the offline benchmark (float32: 126 MB of weights).
LLAMA_32M = dict(
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=1376,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=4096,  # RoPE: no learned positions, so the context is only this limit
)


def _vocabulary(vocab_size: int) -> list[str]:
    words = _SPECIAL + _WORDS
    syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
    for n in itertools.count(2):
        for combo in itertools.product(syllables, repeat=n):
            if len(words) >= vocab_size:
                return words[:vocab_size]
            words.append("".join(combo))
    raise AssertionError("unreachable")


# A plain role-prefixed template, so chat requests work on the demo model like on a real one.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant {% endif %}"
)


def build_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(_vocabulary(vocab_size))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
    )


def make_config(arch: str = "llama", **overrides):
    """A transformers config of ``arch`` with small defaults; ``overrides`` replace any field."""
    import transformers

    if arch not in ARCHITECTURES:
        raise ValueError(f"arch must be one of {ARCHITECTURES}, got {arch!r}")
    fields = dict(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    fields.update(overrides)
    cls = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }[arch]
    return cls(**fields)


def create_tiny_model(
    path: str | Path,
    arch: str = "llama",
    seed: int = 0,
    weight_scale: float = 1.0,
    randomize_all: bool = False,
    max_shard_size: str | None = None,
    **overrides,
) -> Path:
    """Write a random-weight checkpoint + tokenizer to ``path`` and return it.

    ``weight_scale`` multiplies every weight after init: tests use > 1 so logits are not flat and
    greedy comparisons are not decided by rounding. ``randomize_all`` also draws biases and norm
    weights (zeros and ones after a plain init) so that every parameter matters to the output.
    ``max_shard_size`` (e.g. "200KB") writes a sharded checkpoint with an index.
    """
    import torch
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = make_config(arch, **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                if randomize_all:
                    p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                if randomize_all:
                    p.copy_(0.5 * torch.randn_like(p))
            else:
                p.mul_(weight_scale)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    build_tokenizer(config.vocab_size).save_pretrained(path)
    logger.info(
        "wrote a random %s (%d parameters) to %s", arch, sum(p.numel() for p in model.parameters()), path
    )
    return path


BYTE_LEVEL_CORPUS = [
    '{"name": "Ada", "age": 36, "pet": "cat", "tags": [true, false]}',
    '{"location": "Paris", "unit": "celsius"} [1, 2, 3] {"a": {"b": null}}',
    "the quick brown fox jumps over the lazy dog; the world is wide. 0123456789",
]


def build_byte_level_tokenizer(
    vocab_size: int = 600, corpus: list[str] | None = None, chat_template: str | None = CHAT_TEMPLATE
):
    """A byte-level BPE (GPT-2 style: every string is expressible, so JSON, regexes and tool calls
    can be generated) trained on ``corpus`` (default: a little JSON and prose, repeated); ids 0-2
    are pad, BOS and EOS as in ``make_config``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<pad>", "<s>", "</s>"],
        show_progress=False,
    )
    tok.train_from_iterator(corpus if corpus is not None else BYTE_LEVEL_CORPUS * 40, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        chat_template=chat_template,
    )


def create_byte_level_model(path: str | Path, **kw) -> Path:
    """``create_tiny_model`` with a byte-level BPE tokenizer instead of the word-level one."""
    path = create_tiny_model(path, **kw)
    for f in path.glob("*token*"):
        f.unlink()
    build_byte_level_tokenizer().save_pretrained(path)
    return path
