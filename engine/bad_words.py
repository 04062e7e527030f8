"""``bad_words`` strings -> the token sequences the sampler bans (torch-free: the ingress uses it).

A word is banned as the tokenizer would produce it in running text: its own encoding (leading
spaces stripped) and, where the tokenizer marks word starts with a space, the encoding of " word"
as well, as vLLM does. The sampler bans a sequence's last token where the output ends with the rest.
"""

from __future__ import annotations


def bad_words_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    sequences: list[list[int]] = []
    for word in words:
        bare = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if bare and bare not in sequences:
            sequences.append(bare)
        spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        # " word" is another way to write the word only when the space joins its first token
        # (byte-level BPE's "Ġword"), not when it becomes a token of its own.
        if spaced and spaced not in sequences and len(spaced) == len(bare) and spaced[0] != bare[0]:
            sequences.append(spaced)
    return sequences
