"""Engine-owned model caches: paged token pools and per-request hybrid state.

Two kinds of buffers, indexed two ways:
- token pool, indexed by KV slot (slot = page * page_size + offset): MLA latents per DSA layer,
  pooled index keys per indexer layer (pool P of a request lives at slot_of(P*kpool) // kpool,
  so page_size must be a multiple of kpool);
- request state, indexed by request row: KDA conv and recurrent states, compression tails;
- state snapshots, indexed by snapshot slot (the prefix cache's, serving/memory/radix_cache.py):
  KDA conv and recurrent states saved at a token position, copied into a row on a cache hit.

Invariant: every request-row buffer has `request_rows(req_to_token)` rows, for the target and
the draft alike. Never size one from max_running_requests: PD decode hands out rows beyond it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from serving.config import KDA, ModelConfig
from serving.forward_batch import to_device


def request_rows(req_to_token: torch.Tensor) -> int:
    """The one place that says how many rows a request-indexed buffer has."""
    return req_to_token.shape[0]


@dataclass
class KDALayerCache:
    conv: torch.Tensor  # [rows, 3*H*Dk, K-1] pre-conv inputs of the last K-1 tokens
    state: torch.Tensor  # [rows, H, Dk, Dv] float32
    # Snapshots (None without a prefix cache); slot 0 is padding, never handed out.
    saved_conv: torch.Tensor | None = None  # [slots, 3*H*Dk, K-1]
    saved_state: torch.Tensor | None = None  # [slots, H, Dk, Dv] float32


@dataclass
class DSALayerCache:
    latent: torch.Tensor  # [slots, kv_lora_rank]
    # Indexer layers only (None on "shared" layers):
    index_keys: torch.Tensor | None  # [slots // kpool, D] pooled keys
    tail_keys: torch.Tensor | None  # [rows, tail_slots, D] ring, position p at p % tail_slots
    tail_gates: torch.Tensor | None  # [rows, tail_slots, D]
    # every page_size-aligned run of a request's positions sits in consecutive slots (the pool's
    # pages; 1: no such guarantee): the union kernel addresses whole key blocks from one slot
    page_size: int = 1

    @property
    def tail_slots(self) -> int:
        assert self.tail_keys is not None
        return self.tail_keys.shape[1]


@dataclass
class ModelCache:
    req_to_token: torch.Tensor  # [rows, max_context] int64 slot of each position; row 0 = padding
    layers: dict[int, KDALayerCache | DSALayerCache]

    def kda(self, layer: int) -> KDALayerCache:
        cache = self.layers[layer]
        assert isinstance(cache, KDALayerCache)
        return cache

    def dsa(self, layer: int) -> DSALayerCache:
        cache = self.layers[layer]
        assert isinstance(cache, DSALayerCache)
        return cache

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Every buffer, named, for registration with a transfer engine and for tests."""
        out: list[tuple[str, torch.Tensor]] = []
        for idx, cache in self.layers.items():
            for name, value in vars(cache).items():
                if isinstance(value, torch.Tensor):
                    out.append((f"layer{idx}.{name}", value))
        return out


def tail_slots_for(config: ModelConfig, num_draft_tokens: int = 1) -> int:
    """Ring size: the open pool (kpool-1) plus every token one forward can append.

    A verify step appends `num_draft_tokens` tokens; the ring must keep the open pool's earlier
    members while they are written, so rejected drafts cannot overwrite a live member.
    """
    return config.index_kpool - 1 + max(1, num_draft_tokens)


def allocate_model_cache(
    config: ModelConfig,
    req_to_token: torch.Tensor,
    num_slots: int,
    dtype: torch.dtype,
    device: torch.device | str,
    layers: list[int] | None = None,
    layer_types: dict[int, str] | None = None,
    num_draft_tokens: int = 1,
    state_slots: int = 0,
    page_size: int = 1,
) -> ModelCache:
    """Allocate caches for `layers` (default: every target layer) of `config`.

    `layer_types` overrides the kind per layer (the NextN draft is one DSA layer with an
    indexer that lives past the target's layers). `state_slots` > 0: KDA layers get that many
    snapshot slots (+1 padding).
    """
    if num_slots % config.index_kpool:
        raise ValueError(f"num_slots={num_slots} must be a multiple of kpool={config.index_kpool}")
    rows = request_rows(req_to_token)
    layers = list(range(config.num_hidden_layers)) if layers is None else layers
    kinds = layer_types or {i: config.layer_types[i] for i in layers}
    tail = tail_slots_for(config, num_draft_tokens)
    caches: dict[int, KDALayerCache | DSALayerCache] = {}
    for i in layers:
        if kinds[i] == KDA:
            conv_shape = (3 * config.kda_qkv_dim, config.linear_conv_kernel_dim - 1)
            dim = config.linear_head_dim
            state_shape = (config.linear_num_heads, dim, dim)
            saved = state_slots + 1 if state_slots else 0
            caches[i] = KDALayerCache(
                conv=torch.zeros(rows, *conv_shape, dtype=dtype, device=device),
                state=torch.zeros(rows, *state_shape, dtype=torch.float32, device=device),
                saved_conv=torch.zeros(saved, *conv_shape, dtype=dtype, device=device)
                if saved
                else None,
                saved_state=torch.zeros(saved, *state_shape, dtype=torch.float32, device=device)
                if saved
                else None,
            )
            continue
        has_indexer = i >= config.num_hidden_layers or config.indexer_types[i] == "full"
        d = config.index_head_dim
        caches[i] = DSALayerCache(
            latent=torch.zeros(num_slots, config.kv_lora_rank, dtype=dtype, device=device),
            index_keys=(
                torch.zeros(num_slots // config.index_kpool, d, dtype=dtype, device=device)
                if has_indexer
                else None
            ),
            tail_keys=torch.zeros(rows, tail, d, dtype=dtype, device=device)
            if has_indexer
            else None,
            tail_gates=torch.zeros(rows, tail, d, dtype=dtype, device=device)
            if has_indexer
            else None,
            page_size=page_size,
        )
    return ModelCache(req_to_token=req_to_token, layers=caches)


# At most this many rows move as plain row copies (one launch each, no index tensors); more go
# through index tensors built once for all layers.
FEW_ROWS = 4


def save_kda_states(cache: ModelCache, rows: list[int], slots: list[int]) -> None:
    """Snapshot the KDA states of request rows into slots."""
    pairs = _kda_pairs(cache, to_slots=True)
    if not pairs or not rows:
        return
    # Their host cost counts: a prefill's launches run barely ahead of the device, and an index
    # gather plus an index_put per tensor cost several times one row copy.
    if len(rows) <= FEW_ROWS:
        for to, frm in pairs:
            for slot, row in zip(slots, rows):
                to[slot].copy_(frm[row])
        return
    device = pairs[0][0].device
    _copy_indexed(pairs, *(to_device(ids, torch.int64, device) for ids in (rows, slots)))


def load_kda_states(
    cache: ModelCache, slots: list[int] | torch.Tensor, rows: list[int] | torch.Tensor
) -> None:
    """Start request rows from snapshots (prefix-cache hits): one gather and one index_copy per
    buffer for all of them. slots, rows: ids, or index tensors on the device (MemoryPool's
    batch uploads them with the rest of its indices)."""
    pairs = _kda_pairs(cache, to_slots=False)
    if not pairs or not len(rows):
        return
    device = pairs[0][0].device
    _copy_indexed(pairs, *(_ids_on(ids, device) for ids in (slots, rows)))


def _ids_on(ids: list[int] | torch.Tensor, device) -> torch.Tensor:
    return ids if isinstance(ids, torch.Tensor) else to_device(ids, torch.int64, device)


def _kda_pairs(cache: ModelCache, to_slots: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(destination, source) of every KDA layer's conv and recurrent state: rows to snapshot
    slots, or back."""
    pairs = []
    for layer in cache.layers.values():
        if not isinstance(layer, KDALayerCache):
            continue
        assert layer.saved_conv is not None and layer.saved_state is not None
        if to_slots:
            pairs += [(layer.saved_conv, layer.conv), (layer.saved_state, layer.state)]
        else:
            pairs += [(layer.conv, layer.saved_conv), (layer.state, layer.saved_state)]
    return pairs


def _copy_indexed(pairs, src: torch.Tensor, dst: torch.Tensor) -> None:
    """to[dst[i]] = frm[src[i]] for every pair (dst distinct)."""
    for to, frm in pairs:
        to.index_copy_(0, dst, frm.index_select(0, src))


def reset_request_state(cache: ModelCache, rows: torch.Tensor) -> None:
    """Zero the per-request state of new rows (KDA states start from zero; tails are empty).

    Hazard: `t[rows] = 0` on CUDA copies the Python 0 from the host with a blocking copy, which
    waits for the step in flight; index_fill_ takes the value as a kernel argument."""
    for layer in cache.layers.values():
        if isinstance(layer, KDALayerCache):
            layer.conv.index_fill_(0, rows, 0)
            layer.state.index_fill_(0, rows, 0)
        elif layer.tail_keys is not None:
            layer.tail_keys.index_fill_(0, rows, 0)
            layer.tail_gates.index_fill_(0, rows, 0)
