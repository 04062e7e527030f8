"""The default tiny model's cached checkpoint follows today's shape where it can without new weights."""

from __future__ import annotations

import json

from cli.tiny_model import _widen_context


def test_a_cached_model_with_a_shorter_context_gets_todays(tmp_path):
    short, long_ = tmp_path / "short.json", tmp_path / "long.json"
    short.write_text(json.dumps({"max_position_embeddings": 1024, "hidden_size": 512}))
    long_.write_text(json.dumps({"max_position_embeddings": 8192}))
    _widen_context(short, 4096)
    _widen_context(long_, 4096)
    assert json.loads(short.read_text()) == {"max_position_embeddings": 4096, "hidden_size": 512}
    assert json.loads(long_.read_text())["max_position_embeddings"] == 8192


def test_the_demo_model_round_trips_any_text_and_chats_in_words(tmp_path):
    """Its tokenizer is byte-level with the model's vocabulary: a chat's text round-trips (no <unk>),
    greedy chat output decodes to text, the cached model is kept, an older recipe's is made anew."""
    from transformers import AutoConfig, AutoTokenizer

    from cli.tiny_model import DEMO_VERSION, demo_version, ensure_tiny_model
    from engine import LLM, SamplingParams

    old = tmp_path / "demo"
    old.mkdir()
    (old / "config.json").write_text("{}")  # a model cached by an older pdserve: no recipe marker
    assert demo_version(old) == 0
    path = ensure_tiny_model(old)
    assert demo_version(path) == DEMO_VERSION
    tok = AutoTokenizer.from_pretrained(path)
    assert len(tok) == AutoConfig.from_pretrained(path).vocab_size
    messages = [{"role": "user", "content": "hello! Wie geht's? def f(x): return x ** 2  # café ✓"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.unk_token_id is None or tok.unk_token_id not in ids
    assert tok.decode(ids) == text
    out = LLM(str(path), num_blocks=64).generate(
        [ids], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False
    )[0]
    assert out.outputs[0].text.strip()  # words, not an empty string for 8 tokens
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_model(path) == path and (path / "model.safetensors").stat().st_mtime_ns == stamp
