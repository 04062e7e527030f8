"""The batched LoRA update's Triton kernels against the torch reference, under the interpreter here
(compiled on a CUDA machine): mixed adapters and base-model tokens in one batch, runs longer than a
tile, ranks and widths that are not powers of two.

NOTE: ``TRITON_INTERPRET=1`` is set (without CUDA) before ``engine.lora.kernels`` is imported, as in
``test_fused_ops.py``: ``@triton.jit`` picks the interpreter or the compiler when a kernel is defined.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import triton

from engine.lora.batch import TILE, lora_update_ref, make_tiles
from engine.lora.kernels import lora_update, lora_update_per_token

INTERPRETED = triton.knobs.runtime.interpret
if not INTERPRETED and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET=0 needs a CUDA GPU", allow_module_level=True)
DEVICE = "cpu" if INTERPRETED else "cuda"
TOL = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (3e-2, 3e-2)}


def test_tiles_are_runs_of_one_slot_up_to_a_tile_long():
    slots = [-1, 0, 0, 1, -1, 1, *([2] * (TILE + 3)), 0]
    starts, lengths, tile_slots = make_tiles(slots)
    assert tile_slots == [0, 1, 1, 2, 2, 0]
    assert starts == [1, 3, 5, 6, 6 + TILE, 9 + TILE]
    assert lengths == [2, 1, 1, TILE, 3, 1]


def per_token(y, x, slots, a, parts):
    """The update token by token: what both implementations must add."""
    out, r = y.clone().float(), a.shape[2] // len(parts)
    for t, s in enumerate(slots):
        if s >= 0:
            xa = x[t].float() @ a[s].float()
            for i, (b, lo, hi) in enumerate(parts):
                out[t, lo:hi] += xa[i * r : (i + 1) * r] @ b[s].float()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("k", "r", "outs"), [(64, 16, (96,)), (40, 12, (100, 36, 36)), (48, 16, (80, 80))])
def test_kernel_matches_the_reference(dtype, k, r, outs):
    gen = torch.Generator().manual_seed(0)
    slots_list = [0] * 21 + [-1] * 3 + [2, 1, 2, -1, 1] + [1] * 5  # a prefill run, base tokens, decodes
    t = len(slots_list)
    x = torch.randn(t, k, generator=gen).to(dtype).to(DEVICE)
    a = (0.2 * torch.randn(3, k, len(outs) * r, generator=gen)).to(dtype).to(DEVICE)
    cols = [sum(outs[:i]) for i in range(len(outs) + 1)]
    parts = tuple(
        ((0.2 * torch.randn(3, r, o, generator=gen)).to(dtype).to(DEVICE), cols[i], cols[i + 1])
        for i, o in enumerate(outs)
    )
    y0 = torch.randn(t, cols[-1], generator=gen).to(dtype).to(DEVICE)
    want = per_token(y0, x, slots_list, a, parts)
    ref = y0.clone()
    lora_update_ref(ref, x, torch.tensor(slots_list, device=DEVICE), a, parts)
    out = y0.clone()
    tiles = tuple(torch.tensor(part, dtype=torch.int32, device=DEVICE) for part in make_tiles(slots_list))
    lora_update(out, x, tiles, a, parts, TILE)
    per_token_out = y0.clone()  # the CUDA-graph decode path's kernels, one program per token
    lora_update_per_token(per_token_out, x, torch.tensor(slots_list, device=DEVICE), a, parts)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(ref.float().cpu(), want.cpu(), atol=atol, rtol=rtol)
    torch.testing.assert_close(out.float().cpu(), want.cpu(), atol=atol, rtol=rtol)
    torch.testing.assert_close(per_token_out.float().cpu(), want.cpu(), atol=atol, rtol=rtol)
    assert torch.equal(
        per_token_out[[i for i, s in enumerate(slots_list) if s < 0]],
        y0[[i for i, s in enumerate(slots_list) if s < 0]],
    )
    base = [i for i, s in enumerate(slots_list) if s < 0]
    assert torch.equal(out[base], y0[base])  # base-model tokens are untouched
    assert not torch.allclose(out.float(), y0.float())  # the adapters did change the others


def test_an_eager_steps_tiles_are_made_on_its_first_update_and_a_graph_step_makes_none():
    """``LoraBatch`` as built for CUDA: its tiles come from the slots when an eagerly launched step
    first updates a projection (the kernels then add the right update); a decode step replayed from
    a CUDA graph reads only ``token_slots`` and never pays for them."""
    from types import SimpleNamespace

    from engine.lora.batch import LoraBatch

    gen = torch.Generator().manual_seed(3)
    slots_list = [1] * 18 + [-1, 0, 1, 0]
    k, r, outs = 32, 8, (40, 24)
    x = torch.randn(len(slots_list), k, generator=gen).to(DEVICE)
    a = (0.2 * torch.randn(2, k, len(outs) * r, generator=gen)).to(DEVICE)
    parts = (
        ((0.2 * torch.randn(2, r, 40, generator=gen)).to(DEVICE), 0, 40),
        (
            (0.2 * torch.randn(2, r, 24, generator=gen)).to(DEVICE),
            40,
            64,
        ),
    )
    weights = SimpleNamespace(max_loras=2, layer_weights=lambda layer, proj: (a, parts))
    replayed = LoraBatch(weights, torch.tensor(slots_list, device=DEVICE), slot_list=slots_list)
    assert replayed.tiles is None  # built, never updated eagerly: no tiles made
    batch = LoraBatch(weights, torch.tensor(slots_list, device=DEVICE), slot_list=slots_list)
    y0 = torch.randn(len(slots_list), 64, generator=gen).to(DEVICE)
    want = per_token(y0, x, slots_list, a, parts)
    atol, rtol = TOL[torch.float32]
    y = y0.clone()
    batch.update(y, x, 0, "qkv")
    tiles = batch.tiles
    assert [t.tolist() for t in tiles] == [list(part) for part in make_tiles(slots_list)]
    torch.testing.assert_close(y.float().cpu(), want.cpu(), atol=atol, rtol=rtol)
    y = y0.clone()
    batch.update(y, x, 1, "qkv")  # the next projection reuses them
    assert batch.tiles is tiles
    torch.testing.assert_close(y.float().cpu(), want.cpu(), atol=atol, rtol=rtol)
