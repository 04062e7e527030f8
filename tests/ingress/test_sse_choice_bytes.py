"""A streamed choice of plain text is written from a byte template (``_plain_choice``): the same bytes
``json.dumps`` of the choice's dict writes, for texts that need escaping too."""

from __future__ import annotations

import json

import pytest

from ingress.openai_serving import _chat_delta, _dumps, _plain_choice

TEXTS = ["", " the", 'say "hi"', "back\\slash", "line\nbreak\ttab", "é漢字🙂", "\u2028\x00\x1f", "</script>"]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("index", [0, 3])
def test_plain_choice_bytes_equal_the_dicts_json(text, index):
    completion = {"index": index, "text": text, "logprobs": None, "finish_reason": None}
    assert _plain_choice(False, index, text) == _dumps(completion)
    chat = {**_chat_delta(index, text), "logprobs": None, "finish_reason": None}
    assert _plain_choice(True, index, text) == _dumps(chat)
    assert json.loads(_plain_choice(True, index, text))["delta"]["content"] == text
