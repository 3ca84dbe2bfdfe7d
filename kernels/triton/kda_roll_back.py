"""EAGLE's KDA roll-back in one launch for every KDA layer (serving/speculative/kda_history.py's
restore_kda_states is the reference: same results).

After a verify forward of L tokens per request, each request row's KDA states are set to the ones
after its last accepted position `last[b]`: the recurrent state from the verify history's
[B, L, H, Dk, Dv] states, the conv state (the K-1 inputs ending there) from its
[B, C, K-1+L] conv inputs. As torch ops that is eight small kernels per KDA layer (272 a step on
the real rank's 34 KDA layers); here one grid of (layer, request, block) programs copies them
all, each layer's four tensors found through a table of addresses. H100, the rank cut to 28
layers (21 KDA): the EAGLE step 4.08 / 4.11 against 4.62 / 4.74 ms at batch 1
(docs/notebook/benchmarks_real_size_archive.md, rank28).

Hazard: the table holds raw addresses, valid while the history and the caches they came from
live. Each call compares them with the tensors it is given and makes a new table where they
differ (an eager step: a new history each time); a graph-captured step makes its table in the
capture's warm-up from the captured program's static history, which the graphs keep alive, and
its replays copy nothing from the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.pdl import LAUNCH, grid_dependency

BLOCK = 4096  # elements a program copies


@triton.jit
def _kda_roll_back_kernel(
    table_ptr,  # [layers, 4] int64: history states, history conv inputs, cache state, cache conv
    rows_ptr,  # [B] int64 request rows
    last_ptr,  # [B] int64 the last accepted verify position (0-based)
    hist_state_t,  # layer 0's tensors, for their element types only
    hist_conv_t,
    state_t,
    conv_t,
    S: tl.constexpr,  # H * Dk * Dv
    L: tl.constexpr,  # verify positions a request
    C: tl.constexpr,  # conv channels
    W: tl.constexpr,  # K - 1
    STATE_BLOCKS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    grid_dependency()  # first: kernels/triton/pdl.py
    layer = tl.program_id(0)
    b = tl.program_id(1)
    j = tl.program_id(2)
    row = tl.load(rows_ptr + b)
    last = tl.load(last_ptr + b)
    at = table_ptr + layer * 4
    if j < STATE_BLOCKS:
        hist_state = tl.load(at).to(hist_state_t.dtype)
        state = tl.load(at + 2).to(state_t.dtype)
        e = j * BLOCK + tl.arange(0, BLOCK)
        m = e < S
        s = tl.load(hist_state + (b * L + last) * S + e, mask=m)
        tl.store(state + row * S + e, s.to(state_t.dtype.element_ty), mask=m)
    else:
        hist_conv = tl.load(at + 1).to(hist_conv_t.dtype)
        conv = tl.load(at + 3).to(conv_t.dtype)
        e = (j - STATE_BLOCKS) * BLOCK + tl.arange(0, BLOCK)
        m = e < C * W
        c = e // W
        w = e % W
        # the K-1 inputs ending at position `last`: [last + 1, last + K - 1] of K-1 old ++ L new
        x = tl.load(hist_conv + (b * C + c) * (W + L) + last + 1 + w, mask=m)
        tl.store(conv + row * (C * W) + e, x.to(conv_t.dtype.element_ty), mask=m)


# (the addresses, the table on the device) of one call, for the next to reuse
Table = tuple[list[list[int]], torch.Tensor]


def _addresses(caches: list, history: list[list[torch.Tensor]]) -> list[list[int]]:
    """Per KDA layer the addresses of its verify history's states and conv inputs and its
    cache's state and conv. Checks that every layer has layer 0's shapes, dtypes and contiguous
    tensors (the kernel takes one set of sizes)."""
    first = (*history[0], caches[0].state, caches[0].conv)
    out = []
    for cache, (conv_inputs, states) in zip(caches, history, strict=True):
        layer = (conv_inputs, states, cache.state, cache.conv)
        for t, t0 in zip(layer, first):
            same = t.shape == t0.shape and t.dtype == t0.dtype
            assert t.is_contiguous() and same, (t.shape, t0.shape, t.dtype, t0.dtype)
        out.append([t.data_ptr() for t in (states, conv_inputs, cache.state, cache.conv)])
    return out


def kda_roll_back(
    caches: list,
    history: list[list[torch.Tensor]],
    rows: torch.Tensor,
    last: torch.Tensor,
    table: Table | None = None,
) -> Table | None:
    """Every layer's caches[i].state / .conv at rows[b] set to the states after verify position
    last[b] in history[i] = [conv inputs [B, C, K-1+L], states [B, L, H, Dk, Dv]]. table: what
    an earlier call returned, reused where the addresses are the same (a captured step's is made
    in the capture's warm-up, so the capture copies nothing from the host); returns the table
    used."""
    if not caches or rows.numel() == 0:
        return table
    addresses = _addresses(caches, history)
    if table is None or table[0] != addresses:
        # through pinned memory, not waiting for the device (serving.forward_batch.to_device's
        # way): a blocking copy would sync the overlap scheduler's step in flight
        device = caches[0].state.device
        host = torch.tensor(addresses, dtype=torch.int64, pin_memory=device.type == "cuda")
        table = (addresses, host.to(device, non_blocking=True))
    conv_inputs, states = history[0]
    batch, positions = states.shape[:2]
    s = states[0, 0].numel()
    c, w = caches[0].conv.shape[1:]
    assert conv_inputs.shape == (batch, c, w + positions), (conv_inputs.shape, batch, c, w)
    assert rows.shape == last.shape == (batch,), (rows.shape, last.shape, batch)
    state_blocks = triton.cdiv(s, BLOCK)
    grid = (len(caches), batch, state_blocks + triton.cdiv(c * w, BLOCK))
    _kda_roll_back_kernel[grid](
        table[1],
        rows,
        last,
        states,
        conv_inputs,
        caches[0].state,
        caches[0].conv,
        S=s,
        L=positions,
        C=c,
        W=w,
        STATE_BLOCKS=state_blocks,
        BLOCK=BLOCK,
        num_warps=4,
        **LAUNCH,
    )
    return table
