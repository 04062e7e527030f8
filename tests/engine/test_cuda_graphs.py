"""The CUDA-graph decode path: buckets, and the static-buffer path (padding, pad block) token-identical
to the plain path. On CPU it runs eagerly (capture=False) with the Triton kernels under their
interpreter; on a GPU the test also captures and replays real graphs.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined (see test_triton_kernels)

import pytest

from engine import EngineConfig, EngineCore, SamplingParams
from engine.cuda_graphs import DecodeGraphRunner, batch_buckets, graph_max_batch, graphs_apply

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(3) == [1, 2, 3]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert batch_buckets(256)[-3:] == [240, 248, 256]
    with pytest.raises(ValueError):
        batch_buckets(0)


def _generate(core: EngineCore, prompts, params) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        core.add_request(f"r{i}", p, params)
    while core.has_unfinished():
        for o in core.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


@pytest.mark.parametrize("capture", [False, True] if DEVICE == "cuda" else [False])
def test_static_decode_path_is_token_identical(tiny_llama, capture):
    cfg = dict(model=str(tiny_llama), block_size=8, num_blocks=48, attention_backend="triton", device=DEVICE)
    prompts = [[5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45], [7, 8, 9], [100, 200, 300, 400, 500, 600]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    plain = EngineCore(EngineConfig(**cfg, cuda_graphs=False))
    expected = _generate(plain, prompts, params)

    core = EngineCore(EngineConfig(**cfg, cuda_graphs=False))
    full = core.runner.kv_cache  # a view of the pool; the tensor behind it has the pad block
    with_pad = full.as_strided((full.shape[0] + 1, *full.shape[1:]), full.stride())
    graphs = DecodeGraphRunner(
        core.model, core.runner.backend, with_pad, 8, core.max_model_len, max_batch=4, capture=capture
    )
    with_pad[48].fill_(float("nan"))  # a real row reading the pad block would turn its output to NaN
    used = []
    run = graphs.run

    def counting_run(*a):
        used.append(len(a[2].seq_lens_list))
        return run(*a)

    graphs.run = counting_run
    core.runner.decode_graphs = graphs
    assert _generate(core, prompts, params) == expected
    assert 3 in used  # the three-sequence decode batch ran padded to the bucket of 4
    stats = core.stats()
    assert stats.num_free_blocks == 48
    # Every graph replay is counted as one, and the prompt steps (eager) as steps only.
    assert stats.num_graph_steps == len(used) and stats.num_steps > len(used)
    pad = with_pad[48]  # [layers, K/V, block_size, heads, head_dim]
    assert torch.isfinite(pad[:, :, 0]).all()  # the padded row wrote its K/V into slot 0 of the pad block
    assert torch.isnan(pad[:, :, 1:]).all()  # and nothing else wrote there


@pytest.mark.parametrize("capture", [False, True] if DEVICE == "cuda" else [False])
def test_adapter_decode_steps_run_from_the_graph_token_identical(tiny_llama, lora_adapter_factory, capture):
    """Decode steps mixing two adapters and the base model replay the graph path (per-token LoRA
    kernels reading the static slot buffer; a padding row in the bucket), token-identical to the
    eager path, which test_lora checks against HF transformers + peft."""
    adapters = {
        "a": str(lora_adapter_factory(tiny_llama, seed=11)),
        "b": str(lora_adapter_factory(tiny_llama, seed=12, r=4, targets=("q_proj", "v_proj", "down_proj"))),
    }
    cfg = dict(
        model=str(tiny_llama), block_size=8, num_blocks=48, attention_backend="triton", device=DEVICE,
        lora_modules=adapters, max_loras=2, cuda_graphs=False,
    )  # fmt: skip
    prompts = [[5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45], [7, 8, 9], [100, 200, 300, 400, 500, 600]]
    loras = ["a", None, "b"]

    def generate(core):
        out: dict[str, list[int]] = {}
        for i, (p, lora) in enumerate(zip(prompts, loras, strict=True)):
            core.add_request(
                f"r{i}", p, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, lora=lora)
            )
        while core.has_unfinished():
            for o in core.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
        return out

    expected = generate(EngineCore(EngineConfig(**cfg)))
    base = _generate(
        EngineCore(EngineConfig(**{**cfg, "lora_modules": {}})),
        prompts,
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
    )
    assert expected["r0"] != base["r0"] and expected["r2"] != base["r2"]  # the adapters matter here
    assert expected["r1"] == base["r1"]

    core = EngineCore(EngineConfig(**cfg))
    full = core.runner.kv_cache
    with_pad = full.as_strided((full.shape[0] + 1, *full.shape[1:]), full.stride())
    graphs = DecodeGraphRunner(
        core.model, core.runner.backend, with_pad, 8, core.max_model_len, max_batch=4, capture=capture,
        lora=core.lora_slots,
    )  # fmt: skip
    used = []
    run = graphs.run

    def counting_run(*a):
        used.append((len(a[2].seq_lens_list), a[2].lora is not None))
        return run(*a)

    graphs.run = counting_run
    core.runner.decode_graphs = graphs
    assert generate(core) == expected
    assert (3, True) in used  # adapter decodes of three rows ran in the bucket of four
    assert core.stats().num_free_blocks == 48


def _graph_core(model_dir, capture, max_batch, **extra):
    """An engine whose runner replays the static-buffer path of a DecodeGraphRunner of ``max_batch``,
    recording each replayed step's (decodes, spans, tokens, prompt key pairs)."""
    cfg = dict(model=str(model_dir), block_size=8, num_blocks=48, attention_backend="triton", device=DEVICE)
    core = EngineCore(EngineConfig(**cfg, **extra, cuda_graphs=False))
    full = core.runner.kv_cache
    with_pad = full.as_strided((full.shape[0] + 1, *full.shape[1:]), full.stride())
    graphs = DecodeGraphRunner(
        core.model, core.runner.backend, with_pad, 8, core.max_model_len, max_batch=max_batch, capture=capture,
        lora=core.lora_slots,
    )  # fmt: skip
    with_pad[48].fill_(float("nan"))  # a real row reading the pad block would turn its output to NaN
    replayed = []
    run = graphs.run

    def recording_run(input_ids, positions, meta):
        qsl, lens, nd = meta.query_start_loc, meta.seq_lens_list, meta.num_decodes
        keys = sum((qsl[i + 1] - qsl[i]) * lens[i] for i in range(nd, len(lens)))
        replayed.append((nd, len(lens), qsl[-1], keys))
        hidden = run(input_ids, positions, meta)
        b = qsl[-1]
        bucket = next(x for x in graphs.buckets if x >= b)
        # Every row past the step's own is padding when it runs: a row left from an earlier, larger
        # step would write its K/V into a slot a sequence may own by now.
        g, pad = graphs, graphs.pad_block
        assert (g.slot_blocks[b:bucket] == pad).all() and (g.block_tables[b:bucket] == pad).all()
        assert (
            (g.seq_lens[b:bucket] == 1).all()
            and not g.input_ids[b:bucket].any()
            and not g.positions[b:bucket].any()
        )
        assert g.lora_slots is None or (g.lora_slots[b:bucket] == -1).all()
        return hidden

    graphs.run = recording_run
    core.runner.decode_graphs = graphs
    return core, graphs, replayed


def _staggered(core, arrivals, params, everything: bool = False) -> dict:
    """Requests added as others decode: ``arrivals[k]`` (id, prompt) join before step ``k``. Each
    request's tokens, or (``everything``) its tokens, logprobs and prompt logprobs."""
    out: dict = {}
    k = 0
    while k < len(arrivals) or core.has_unfinished():
        for rid, prompt in arrivals[k] if k < len(arrivals) else []:
            core.add_request(rid, prompt, params)
        for o in core.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
            if everything:
                for name in ("new_logprobs", "prompt_logprobs"):
                    for d in getattr(o, name) or []:
                        out[o.request_id].append(d)
        k += 1
    return out


@pytest.mark.parametrize("arch", ["llama", "mistral-swa"])
@pytest.mark.parametrize("capture", [False, True] if DEVICE == "cuda" else [False])
def test_mixed_steps_replay_the_graph_token_identical(tiny_model_factory, arch, capture):
    """Steps mixing new prompts (one over a cached prefix, under a sliding window of 6) with running
    decodes replay the graph with each prompt token as a decode row: token-identical to the plain
    path, which test_correctness checks against HF; a step over the graph's rows or the budget runs
    eagerly; the pad block stays untouched by real rows and every block comes back."""
    model_dir = (
        tiny_model_factory("llama") if arch == "llama" else tiny_model_factory("mistral", sliding_window=6)
    )
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    shared = [5, 9, 13, 17, 21, 25, 29, 33]  # one full block: r2 finds it cached
    arrivals = [
        [("r0", [*shared, 37, 41, 45]), ("r1", [7, 8, 9])],
        [],
        [("r2", [*shared, 50, 51, 52, 53, 54])],  # a 5-token chunk over 8 cached tokens
        [],
        [("r3", list(range(60, 80)))],  # 20 tokens + 3 decodes: more rows than the graph has
        [("r4", list(range(90, 102)))],  # 12 x 12 keys: over the budget below
        [("r5", [3, 4])],
    ]
    plain = EngineCore(EngineConfig(model=str(model_dir), block_size=8, num_blocks=48, cuda_graphs=False))
    expected = _staggered(plain, arrivals, params)

    core, graphs, replayed = _graph_core(model_dir, capture, max_batch=16)
    graphs.mixed_budget = 130
    assert _staggered(core, arrivals, params) == expected
    mixed = [r for r in replayed if r[0] < r[1]]
    assert (2, 3, 7, 65) in mixed  # r2's chunk (5 tokens at contexts up to 13) beside two decodes
    assert (0, 2, 14, 11 * 11 + 3 * 3) in mixed  # the first step: two prompts alone, at the budget
    assert (5, 6, 7, 4) in mixed  # r5's two tokens beside five decodes
    assert all(tokens <= 16 and keys <= 130 for _, _, tokens, keys in replayed)
    stats = core.stats()
    assert stats.num_steps > stats.num_graph_steps == len(replayed)  # r3's and r4's steps ran eagerly
    assert stats.num_free_blocks == 48
    pad = core.runner.decode_graphs.kv_cache[48]
    assert torch.isnan(pad[:, :, 1:]).all()  # padding rows write slot 0 of the pad block, nothing else


def test_mixed_steps_stay_eager_when_turned_off(tiny_llama):
    core, graphs, replayed = _graph_core(tiny_llama, False, max_batch=16)
    graphs.mixed = False
    out = _staggered(
        core, [[("a", [1, 2, 3])], [("b", [4, 5, 6, 7])]], SamplingParams(max_tokens=4, ignore_eos=True)
    )
    assert len(out["b"]) == 4 and replayed and all(nd == spans for nd, spans, _, _ in replayed)
    assert core.stats().num_free_blocks == 48


def test_mixed_adapter_steps_replay_the_graph_token_identical(tiny_llama, lora_adapter_factory):
    """Prompts of two adapters and the base model joining running decodes replay the graph, each
    token's adapter slot in the static buffer: token-identical to the eager path."""
    adapters = {
        "a": str(lora_adapter_factory(tiny_llama, seed=11)),
        "b": str(lora_adapter_factory(tiny_llama, seed=12)),
    }
    extra = dict(lora_modules=adapters, max_loras=2)
    arrivals = [[("r0", [5, 9, 13, 17], "a")], [("r1", [7, 8, 9], None)], [("r2", [100, 200, 300], "b")]]

    def generate(core):
        out: dict[str, list[int]] = {}
        for k in range(len(arrivals)):
            for rid, prompt, lora in arrivals[k]:
                core.add_request(
                    rid, prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, lora=lora)
                )
            for o in core.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
        while core.has_unfinished():
            for o in core.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
        return out

    cfg = dict(model=str(tiny_llama), block_size=8, num_blocks=48, attention_backend="triton", device=DEVICE)
    expected = generate(EngineCore(EngineConfig(**cfg, **extra, cuda_graphs=False)))
    core, _, replayed = _graph_core(tiny_llama, False, max_batch=8, **extra)
    assert generate(core) == expected
    assert (1, 2, 4, 9) in replayed and (2, 3, 5, 9) in replayed  # r1's and r2's prompts beside decodes
    assert core.stats().num_free_blocks == 48


def test_token_spans_and_a_mixed_step_without_its_offsets_on_the_device(tiny_llama):
    """Each token's span comes from the span offsets the step's upload carries; a mixed step whose
    metadata lacks them runs eagerly rather than search on the host."""
    _, graphs, _ = _graph_core(tiny_llama, False, max_batch=8)
    qsl = [0, 1, 2, 5, 7]
    tables = torch.zeros(4, 2, dtype=torch.int64)
    meta = SimpleNamespace(
        query_start_loc=qsl, query_start_loc_tensor=torch.tensor(qsl, device=DEVICE), block_tables=tables,
        lora=None, num_decodes=2, seq_lens_list=[4, 9, 3, 2],
    )  # fmt: skip
    assert graphs._token_spans(meta, 7).tolist() == [0, 1, 2, 2, 2, 3, 3]
    assert graphs.can_run(meta)
    meta.query_start_loc_tensor = None
    assert not graphs.can_run(meta)


MODES = {
    "chunked": (dict(max_num_batched_tokens=8), {}),
    "ngram-verify": (
        dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}),
        {},
    ),
    "logprobs": (dict(max_num_batched_tokens=8), dict(logprobs=2, prompt_logprobs=2)),
    "async": (dict(async_scheduling="on"), {}),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_mixed_steps_keep_every_mode_exact(tiny_llama, mode):
    """Through the graph path, as the plain path: chunked prefill (middle chunks that do not
    sample), speculative decoding's verify steps (several query rows per sequence), logprobs and
    prompt logprobs (values within 1e-4), overlapped scheduling (input ids patched on the device)."""
    extra, more = MODES[mode]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, **more)
    repeats = [3, 4, 5, 6, 7] * 4  # n-gram drafts find matches
    arrivals = [
        [("a", repeats[:13]), ("b", [9, 8, 7, 6, 5])],
        [],
        [("c", repeats[:18])],
        [],
        [("d", list(range(30, 41)))],
    ]
    plain = EngineCore(
        EngineConfig(model=str(tiny_llama), block_size=8, num_blocks=48, cuda_graphs=False, **extra)
    )
    expected = _staggered(plain, arrivals, params, everything=True)
    core, _, replayed = _graph_core(tiny_llama, False, max_batch=32, **extra)
    got = _staggered(core, arrivals, params, everything=True)
    assert got.keys() == expected.keys()
    for rid, items in expected.items():  # tokens exact; logprobs' keys exact, values to 1e-4
        assert len(got[rid]) == len(items)
        for a, b in zip(got[rid], items, strict=True):
            if isinstance(b, dict):
                assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in b), rid
            else:
                assert a == b, rid
    mixed = [r for r in replayed if r[0] < r[1]]
    assert mixed
    if mode == "ngram-verify":  # a verify step: drafts as a span of several rows, no prompt beside
        assert core.stats().spec_accepted_tokens > 0
        assert any(tokens > spans for _, spans, tokens, _ in mixed)
    assert core.stats().num_free_blocks == 48


@pytest.mark.parametrize(
    ("mixed", "seqs", "tokens", "rows"),
    [(True, 16, 2048, 256), (True, 16, 64, 64), (False, 16, 2048, 16), (False, 512, 2048, 256)],
)
def test_graphs_are_sized_for_the_rows_a_step_can_bring(mixed, seqs, tokens, rows):
    config = SimpleNamespace(
        cuda_graph_mixed=mixed, max_num_seqs=seqs, max_num_batched_tokens=tokens, cuda_graph_max_batch=256
    )
    assert graph_max_batch(config) == rows


def test_graphs_apply_on_a_gpu_with_triton_but_not_to_a_quantized_cache_or_an_emulated_accelerator():
    """An emulated accelerator (``pdserve/emulated``) waits in its forward: a replay would skip the
    wait, so its steps run eagerly on a GPU too."""
    from engine.models.zero_cost import ZeroCostForCausalLM, spec_from_config
    from engine.tiny_model import make_config

    spec = spec_from_config(make_config(vocab_size=64, max_position_embeddings=64))
    plain = ZeroCostForCausalLM.from_spec(spec)
    emulated = ZeroCostForCausalLM.from_spec(
        spec, step_time={"base_s": 0.01, "per_token_s": 0.0, "per_ctx_s": 0.0}
    )
    config = SimpleNamespace(cuda_graphs=True, kv_cache_dtype="auto")
    assert graphs_apply(config, "cuda", "triton", None, plain)
    assert not graphs_apply(config, "cuda", "triton", None, emulated)
    assert not graphs_apply(config, "cuda", "triton", torch.int8, plain)  # a quantized cache
    assert not graphs_apply(config, "cpu", "triton", None, plain)
    assert not graphs_apply(config, "cuda", "torch", None, plain)
    assert not graphs_apply(SimpleNamespace(cuda_graphs=False), "cuda", "triton", None, plain)
