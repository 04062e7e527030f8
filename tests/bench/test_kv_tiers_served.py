"""The served multi-turn workload's conversations: each turn's prompt continues the last one (the
prefix a tier or a peer can serve), every configuration gets the same tokens, lengths as asked."""

from bench.kv_tiers_served import conversations


def test_each_turn_extends_its_conversation_and_the_workload_is_reproducible():
    rounds = conversations(tenants=3, rounds=3, system=40, user=8, reply=5)
    assert rounds == conversations(tenants=3, rounds=3, system=40, user=8, reply=5)
    assert [len(r) for r in rounds] == [3, 3, 3]
    for c in range(3):
        prompts = [rounds[r][c].prompt for r in range(3)]
        assert [len(p) for p in prompts] == [48, 61, 74]  # + the last reply's 5 and a user turn's 8
        assert prompts[1][:48] == prompts[0] and prompts[2][:61] == prompts[1]
        assert all(rounds[r][c].max_tokens == 5 and rounds[r][c].tenant == c for r in range(3))
    firsts = {tuple(rounds[0][c].prompt[:40]) for c in range(3)}
    assert len(firsts) == 3  # a system prompt of its own per conversation
