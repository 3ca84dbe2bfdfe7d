"""KDA states at a verify position, from the history EAGLE's verify forward records
(ForwardBatch.kda_history: per KDA layer, the conv inputs and the recurrent state after every
verify position): the roll-back to the last accepted token, and the prefix cache's snapshots at
grid positions an accepted run crossed."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kernels import fast_path
from serving.forward_batch import to_device
from serving.memory.cache import ModelCache

if TYPE_CHECKING:
    from serving.speculative.graphs import Verified

# the fast path's roll-back in one launch (off: the torch ops below, eight launches a KDA layer;
# bench.fast_path's A/B switch)
ROLL_BACK_ONE_LAUNCH = True


def _kda_states_at(
    conv_inputs: torch.Tensor, states: torch.Tensor, batch: torch.Tensor, index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One KDA layer's (conv, recurrent) states after verify position index[i] of batch entry
    batch[i], from the history the verify forward recorded."""
    width = conv_inputs.shape[-1] - states.shape[1]  # K-1 inputs ending at the position
    idx = index[:, None] + 1 + torch.arange(width, device=index.device)
    idx = idx[:, None, :].expand(-1, conv_inputs.shape[1], -1)
    return conv_inputs[batch].gather(2, idx), states[batch, index]


def restore_kda_states(
    cache: ModelCache, verified: Verified, rows: torch.Tensor, last: torch.Tensor
) -> None:
    """Set each row's KDA state to the one after chunk position last[b] (0-based), from the
    verify program's history. On the fast path one launch for every layer
    (kernels/triton/kda_roll_back.py), its table of addresses kept on `verified` for the next
    roll-back from the same outputs (a captured step's replays)."""
    history = verified.kda_history
    if ROLL_BACK_ONE_LAUNCH and fast_path(rows) and history:
        from kernels.triton.kda_roll_back import kda_roll_back

        caches = [cache.kda(layer) for layer in history]
        inputs = list(history.values())
        verified.kda_table = kda_roll_back(caches, inputs, rows, last, verified.kda_table)
        return
    b = torch.arange(rows.numel(), device=rows.device)
    for layer, (conv_inputs, states) in history.items():
        kc = cache.kda(layer)
        conv, state = _kda_states_at(conv_inputs, states, b, last)
        kc.state[rows] = state.to(kc.state.dtype)
        kc.conv[rows] = conv.to(kc.conv.dtype)


def save_kda_states_from_history(
    cache: ModelCache, history: dict[int, list[torch.Tensor]], captures: list[tuple[int, int, int]]
) -> None:
    """Snapshot, for each (batch entry, verify position, slot) of `captures`, the KDA states
    after that position into that slot (the prefix cache's state at a grid position that an
    accepted run crossed)."""
    if not captures:
        return
    device = cache.req_to_token.device
    batch, index, slots = to_device(list(zip(*captures)), torch.int64, device)
    for layer, (conv_inputs, states) in history.items():
        kc = cache.kda(layer)
        conv, state = _kda_states_at(conv_inputs, states, batch, index)
        kc.saved_state[slots] = state.to(kc.saved_state.dtype)
        kc.saved_conv[slots] = conv.to(kc.saved_conv.dtype)
