"""The Llama family's fused Triton kernels against their torch references; a model forward with and without.

NOTE: as in ``test_triton_kernels.py``, ``TRITON_INTERPRET=1`` is set (without CUDA) before
``fused_ops`` is imported, because ``@triton.jit`` picks the interpreter or the compiler when a kernel
is defined. The engine imports ``fused_ops`` only on first fused use, so earlier test modules do not
define its kernels first. On a GPU machine the same tests run compiled on CUDA.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import triton

from engine.models import fused_ops as fo
from engine.models.loader import load_model
from engine.models.rotary import RotaryEmbedding

INTERPRETED = triton.knobs.runtime.interpret
if not INTERPRETED and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET=0 needs a CUDA GPU", allow_module_level=True)
DEVICE = "cpu" if INTERPRETED else "cuda"

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: (1e-6, 1e-6), torch.bfloat16: (2e-2, 2e-2)}  # (atol, rtol)
TOKENS = [1, 7, 64]
EPS = 1e-6


def _randn(*shape, dtype=torch.float32, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(shape, generator=gen)).to(dtype).to(DEVICE)


def _close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    atol, rtol = TOL[out.dtype]
    torch.testing.assert_close(out.float().cpu(), ref.float().cpu(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [64, 257])
@pytest.mark.parametrize("tokens", TOKENS)
def test_rms_norm_matches_torch(tokens: int, hidden: int, dtype: torch.dtype) -> None:
    x = _randn(tokens, hidden, dtype=dtype, scale=3.0)
    w = _randn(hidden, dtype=dtype, seed=1)
    _close(fo.rms_norm(x, w, EPS), fo.rms_norm_ref(x, w, EPS))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [64, 257])
@pytest.mark.parametrize("tokens", TOKENS)
def test_add_rms_norm_returns_the_norm_and_the_new_residual(
    tokens: int, hidden: int, dtype: torch.dtype
) -> None:
    x, res = _randn(tokens, hidden, dtype=dtype), _randn(tokens, hidden, dtype=dtype, seed=2, scale=4.0)
    w = _randn(hidden, dtype=dtype, seed=1)
    out, new_res = fo.add_rms_norm(x, res, w, EPS)
    ref_out, ref_res = fo.add_rms_norm_ref(x, res, w, EPS)
    if dtype == torch.float32 or not INTERPRETED:
        assert torch.equal(new_res.cpu(), ref_res.cpu())  # one rounded add either way
    else:  # NOTE: Triton's interpreter truncates float32 to bfloat16 where GPUs round to nearest even
        _close(new_res, ref_res)
    _close(out, ref_out)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_over_heads_of_a_strided_view(dtype: torch.dtype) -> None:
    """Qwen3's q/k norm: per-head rows of a view into the fused qkv output."""
    heads, head_dim = 4, 32
    qkv = _randn(7, heads * head_dim + 64, dtype=dtype)
    q = qkv[:, : heads * head_dim].view(7, heads, head_dim)
    w = _randn(head_dim, dtype=dtype, seed=1)
    _close(fo.rms_norm(q, w, EPS), fo.rms_norm_ref(q, w, EPS))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("tokens", "heads", "kv_heads", "head_dim"), [(1, 4, 2, 64), (7, 6, 1, 80), (64, 4, 2, 64), (7, 8, 8, 32)]
)
def test_rotary_matches_torch(
    tokens: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    rope = RotaryEmbedding(head_dim, 256, {"rope_theta": 10000.0}).to(DEVICE)
    positions = torch.randint(0, 256, (tokens,), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    cos, sin = rope.lookup(positions, dtype)
    qkv = _randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)  # q and k as views, like Attention
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    q = qkv[:, :q_size].view(tokens, heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(tokens, kv_heads, head_dim)
    before = qkv.clone()
    q_out, k_out = fo.rotary(q, k, cos, sin)
    q_ref, k_ref = fo.rotary_ref(q, k, cos, sin)
    _close(q_out, q_ref)
    _close(k_out, k_ref)
    assert q_out.is_contiguous() and k_out.is_contiguous()
    assert torch.equal(qkv, before), "the rotation is out of place"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("inter", [128, 173, 1500])
@pytest.mark.parametrize("tokens", TOKENS)
def test_silu_mul_matches_torch(tokens: int, inter: int, dtype: torch.dtype) -> None:
    gate_up = _randn(tokens, 2 * inter, dtype=dtype, scale=3.0)
    _close(fo.silu_mul(gate_up), fo.silu_mul_ref(gate_up))


class _CausalAttention:
    """Plain causal attention over one sequence, ignoring the KV cache: the test needs the model's own ops."""

    name = "causal"

    def forward(self, layer, q, k, v, kv_cache, meta, scale, sliding_window):
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=scale
        )
        return out.transpose(0, 1)


@pytest.mark.parametrize(
    ("arch", "overrides", "dtype"),
    [("llama", {}, torch.float32), ("llama", {}, torch.bfloat16), ("qwen3", {"head_dim": 32}, torch.float32)],
    ids=str,
)
def test_model_forward_fused_matches_torch(tiny_model_factory, arch: str, overrides: dict, dtype) -> None:
    """Every fused op in place (Qwen3 adds q/k norm over strided heads); the logits agree."""
    model = load_model(tiny_model_factory(arch, **overrides), dtype, DEVICE, _CausalAttention())
    ids = torch.randint(3, model.spec.vocab_size, (12,), generator=torch.Generator().manual_seed(4)).to(
        DEVICE
    )
    positions = torch.arange(12, device=DEVICE)
    with torch.no_grad():
        logits = {
            fused: model.compute_logits(model(ids, positions, None, None, fused=fused), fused=fused)
            for fused in (False, True)
        }
    atol = 1e-4 if dtype == torch.float32 else 0.25  # logits of a weight-scaled model are large
    torch.testing.assert_close(
        logits[True].cpu(), logits[False].cpu(), atol=atol, rtol=1e-2 if atol > 1e-3 else 1e-5
    )
    assert torch.equal(logits[True].argmax(-1), logits[False].argmax(-1)) or dtype != torch.float32
