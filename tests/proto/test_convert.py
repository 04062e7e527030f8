"""``proto.convert.tokens_message``: the per-token message built in place is the message the keyword
form builds, with and without logprobs (prompt logprobs from position 1)."""

from __future__ import annotations

import pytest

from proto import pdserve_pb2 as pb
from proto.convert import logprobs_to_proto, prompt_logprobs_to_proto, tokens_message

CASES = [
    (0, [5], None, None),
    (2, [7, 8, 9], None, None),
    (0, [5, 6], [{5: -0.1, 3: -2.5}, None], None),
    (1, [4], [{4: -0.5}], [None, {1: -1.0}, {2: -0.25, 9: -3.0}]),
]


@pytest.mark.parametrize("sample, ids, logprobs, prompt", CASES)
def test_tokens_message_is_the_keyword_forms_message(sample, ids, logprobs, prompt):
    expected = pb.GenerateResponse(
        tokens=pb.TokenChunk(
            sample_index=sample,
            token_ids=ids,
            logprobs=[logprobs_to_proto(lp) for lp in logprobs or []],
            prompt_logprobs=prompt_logprobs_to_proto(prompt),
        )
    )
    msg = tokens_message(sample, ids, logprobs, prompt)
    assert msg == expected and msg.WhichOneof("kind") == "tokens"
    assert msg.SerializeToString() == expected.SerializeToString()
