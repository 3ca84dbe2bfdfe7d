"""All serving memory in one place: the request table, its free lists and the model caches.

    request table  req_to_token [rows + 1, max_context]   row 0 = padding (never handed out)
    target caches  ModelCache over every target layer (+ the KDA state snapshots, by slot)
    draft caches   ModelCache over the NextN layer (same request table, same token allocator)

rows = max_running_requests + decode_extra_slots. Every request-row buffer of the target and the
draft is sized by `request_rows(req_to_token)` (memory/cache.py), the same function.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from serving.config import ModelConfig
from serving.distributed import rank_cache_config
from serving.memory.allocator import FreeList, PageAllocator
from serving.memory.cache import (
    ModelCache,
    allocate_model_cache,
    request_rows,
    save_kda_states,
    tail_slots_for,
)
from serving.memory.pool_work import PoolWork, PoolWorkQueue, apply_work

log = logging.getLogger(__name__)


AUX_TOP_LOGPROBS = 20


@dataclass
class AuxRows:
    """Per-request-row extras that a PD handoff carries besides KV and state.

    Host part (pinned on CUDA), written and read by the host only, so decode admits an arrived
    request without waiting for the step in flight:
    ints:         bootstrap_room, first token, cached tokens, number of top logprobs
    floats:       first-token logprob, then its top logprobs; top_ids: their token ids
    Device part, written and read on the device by serving/speculative/eagle.py (the handoff
    carries it, so decode starts from it):
    draft_token:  EAGLE's current proposal d1
    draft_hidden: the NextN draft's hidden state at the last drafted position (EAGLE's stash)

    Hazard: prefill must finish writing the host part before it posts the transfer, and decode
    may read it only after prefill's Success (then every write has landed).
    """

    ints: torch.Tensor  # [rows, 4] int64, host
    floats: torch.Tensor  # [rows, 1 + AUX_TOP_LOGPROBS] float32, host
    top_ids: torch.Tensor  # [rows, AUX_TOP_LOGPROBS] int64, host
    draft_token: torch.Tensor  # [rows] int64, device
    draft_hidden: torch.Tensor  # [rows, hidden] model dtype, device

    @classmethod
    def allocate(cls, rows: int, hidden: int, dtype: torch.dtype, device: str) -> AuxRows:
        pin = torch.device(device).type == "cuda"  # a peer's NIC/engine writes it; no pageable

        def host(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, pin_memory=pin)

        return cls(
            ints=host(rows, 4, dtype=torch.int64),
            floats=host(rows, 1 + AUX_TOP_LOGPROBS, dtype=torch.float32),
            top_ids=host(rows, AUX_TOP_LOGPROBS, dtype=torch.int64),
            draft_token=torch.zeros(rows, dtype=torch.int64, device=device),
            draft_hidden=torch.zeros(rows, hidden, dtype=dtype, device=device),
        )

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        return [(f"aux.{name}", t) for name, t in vars(self).items()]


@dataclass(frozen=True)
class PoolPlan:
    rows: int  # usable request rows (running + extra slots)
    pages: int  # usable KV pages (page 0 excluded)
    page_size: int
    max_context: int  # positions a request row maps (plan_pool: table_width of the context)
    with_draft: bool = False
    num_draft_tokens: int = 1
    state_slots: int = 0  # KDA state snapshots of the prefix cache (0: no prefix cache)


def token_bytes(config: ModelConfig, elem: int, with_draft: bool) -> int:
    """Bytes of token-pool cache per token: MLA latents + pooled index keys (per kpool tokens)."""
    latent_layers = len(config.dsa_layers) + int(with_draft)
    index_layers = len(config.indexer_layers) + int(with_draft)
    return (
        latent_layers * config.kv_lora_rank * elem
        + index_layers * config.index_head_dim * elem // config.index_kpool
    )


def kda_state_bytes(config: ModelConfig, elem: int) -> int:
    """Bytes of one request's KDA conv + recurrent states (a row's, or one snapshot's)."""
    return len(config.kda_layers) * (
        3 * config.kda_qkv_dim * (config.linear_conv_kernel_dim - 1) * elem
        + config.linear_num_heads * config.linear_head_dim**2 * 4
    )


def row_bytes(config: ModelConfig, elem: int, tail_slots: int, with_draft: bool) -> int:
    """Bytes of per-request state per row: KDA conv + recurrent state, compression tails."""
    tails = (len(config.indexer_layers) + int(with_draft)) * 2 * tail_slots
    return kda_state_bytes(config, elem) + tails * config.index_head_dim * elem


@dataclass(frozen=True)
class SnapshotBudget:
    """The prefix cache's KDA state snapshots: `slots` if given (--max-mamba-cache-size), else
    snapshot memory = `ratio` x KV-pool memory (--mamba-full-memory-ratio), and never fewer than
    two per request row: a decoding request holds one privately (its last grid position), and
    the tree should keep at least as many again, or tracking evicts every shared state."""

    ratio: float
    slots: int | None = None


def table_width(context: int, with_draft: bool, num_draft_tokens: int) -> int:
    """Positions a request row maps: the context, and with a draft the positions past it that
    an EAGLE step may write for a request near its end (its verify's num_draft_tokens, and
    under the overlap scheduler the step in flight's as well: DecodeManager._ahead). Without
    them such a request could not grow, and the step would take it for a shortage of pages:
    retractions that free nothing, then a 503."""
    return context + (2 * num_draft_tokens if with_draft else 0)


def fit_kv_tokens(
    total_memory: int,
    mem_fraction_static: float,
    weight_bytes: int,
    rows: int,
    max_context: int,
    per_row: int,
    per_token: int,
) -> int:
    """KV tokens that fit in mem_fraction_static of one device after this rank's weights, the
    request state of rows + 1 rows (padding row 0) and the request table (int64 per position)."""
    budget = int(total_memory * mem_fraction_static) - weight_bytes - (rows + 1) * per_row
    budget -= (rows + 1) * max_context * 8  # request table
    if budget <= 0:
        raise ValueError(
            f"--mem-fraction-static {mem_fraction_static}: weights ({weight_bytes / 2**30:.1f}"
            f" GiB) and request state leave no room for KV pages"
        )
    return budget // per_token


def plan_pool(
    config: ModelConfig,
    *,
    rows: int,
    max_context: int,
    page_size: int,
    dtype: torch.dtype,
    device: str,
    max_total_tokens: int | None,
    mem_fraction_static: float,
    weight_bytes: int,
    with_draft: bool = False,
    num_draft_tokens: int = 1,
    snapshots: SnapshotBudget | None = None,
) -> PoolPlan:
    """Size the token pool: --max-total-tokens if given; on CUDA what fits in
    mem_fraction_static of device memory after weights, request state and the state snapshots
    (`snapshots`, None: no prefix cache); on CPU 131072 tokens."""
    max_context = table_width(max_context, with_draft, num_draft_tokens)
    elem = torch.tensor([], dtype=dtype).element_size()
    config = rank_cache_config(config)  # TP: this rank's KDA heads
    per_token = token_bytes(config, elem, with_draft)
    per_row = row_bytes(config, elem, tail_slots_for(config, num_draft_tokens), with_draft)
    per_snapshot = kda_state_bytes(config, elem)
    ratio = snapshots.ratio if snapshots is not None and snapshots.slots is None else 0.0
    fixed = snapshots.slots * per_snapshot if snapshots and snapshots.slots is not None else 0
    if max_total_tokens is None and device == "cuda":
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        # snapshots by ratio: each KV token carries `ratio` of its bytes in snapshot memory
        max_total_tokens = fit_kv_tokens(
            total,
            mem_fraction_static,
            weight_bytes + fixed,
            rows,
            max_context,
            per_row,
            int(per_token * (1 + ratio)),
        )
    elif max_total_tokens is None:
        max_total_tokens = 131072
    pages = max_total_tokens // page_size
    if pages < 1:
        raise ValueError(f"--max-total-tokens {max_total_tokens}: less than one page")
    slots = 0
    if snapshots is not None and per_snapshot:
        slots = snapshots.slots
        if slots is None:
            slots = max(2 * rows, int(ratio * pages * page_size * per_token / per_snapshot))
    log.info(
        "KV budget: %d tokens (%d B/token), %d request rows (%d B/row), %d state snapshots "
        "(%d B each)",
        pages * page_size,
        per_token,
        rows,
        per_row,
        slots,
        per_snapshot,
    )
    return PoolPlan(rows, pages, page_size, max_context, with_draft, num_draft_tokens, slots)


class MemoryPool:
    def __init__(
        self, config: ModelConfig, plan: PoolPlan, dtype: torch.dtype, device: str
    ) -> None:
        if plan.page_size % config.index_kpool:
            raise ValueError(
                f"page size {plan.page_size} must be a multiple of index_kpool {config.index_kpool}"
            )
        self.config, self.plan, self.device = config, plan, device
        self.req_to_token = torch.zeros(
            plan.rows + 1, plan.max_context, dtype=torch.int64, device=device
        )
        self.rows = FreeList(plan.rows, "request row")
        self.pages = PageAllocator(plan.pages, plan.page_size)
        self.state_slots = FreeList(plan.state_slots, "state slot")
        num_slots = self.pages.num_slots
        local = rank_cache_config(config)  # TP: KDA states hold this rank's heads only
        self.target: ModelCache = allocate_model_cache(
            local,
            self.req_to_token,
            num_slots,
            dtype,
            device,
            num_draft_tokens=plan.num_draft_tokens,
            state_slots=plan.state_slots,
            page_size=plan.page_size,
        )
        self.aux = AuxRows.allocate(
            request_rows(self.req_to_token), config.hidden_size, dtype, device
        )
        # TP rank 0 records what followers must mirror (row resets, page maps, snapshot copies)
        # here; they replay it before the next forward (serving/engine/tp_worker.py). None: not
        # recorded.
        self.journal: list[tuple] | None = None
        self.draft: ModelCache | None = None
        if plan.with_draft:
            self.draft = allocate_model_cache(
                local,
                self.req_to_token,
                num_slots,
                dtype,
                device,
                layers=[config.num_hidden_layers],
                layer_types=config.draft_layer_types,
                num_draft_tokens=plan.num_draft_tokens,
                page_size=plan.page_size,
            )

        self.work = PoolWorkQueue(self._apply)  # resets, maps and loads: at once, or batched()
        self._page_offsets = torch.arange(plan.page_size, device=device)

    def caches(self) -> list[ModelCache]:
        return [self.target] if self.draft is None else [self.target, self.draft]

    def describe(self) -> str:
        total = sum(t.numel() * t.element_size() for c in self.caches() for _, t in c.tensors())
        total += self.req_to_token.numel() * self.req_to_token.element_size()
        return (
            f"request rows {self.plan.rows} (+1 padding), KV pages {self.plan.pages} x "
            f"{self.plan.page_size} tokens = {self.plan.pages * self.plan.page_size} tokens, "
            f"max context {self.plan.max_context}, draft caches {'yes' if self.draft else 'no'}, "
            f"{total / 2**20:.1f} MiB allocated"
        )

    def batched(self):
        """A block whose row resets, page maps and snapshot loads launch as one batch when it
        ends (PoolWorkQueue.batched: the hazards)."""
        return self.work.batched()

    def _apply(self, work: PoolWork) -> None:
        if self.journal is not None:
            self.journal.append(("apply", work))  # a follower replays it through here
        apply_work(work, self.caches(), self.target, self.req_to_token, self._page_offsets)

    # ---- rows ----
    def alloc_row(self) -> int | None:
        """A free request row, its state zeroed (queued inside batched())."""
        got = self.rows.alloc(1)
        if got is None:
            return None
        self.work.do(PoolWork(resets=got))
        return got[0]

    def free_row(self, row: int) -> None:
        self.rows.free([row])

    # ---- pages ----
    def grow(self, row: int, pages: list[int], num_tokens: int) -> bool:
        """Give `row` enough pages for `num_tokens` positions; False (nothing taken) if short."""
        need = self.pages.pages_for(num_tokens) - len(pages)
        if need <= 0:
            return True
        if num_tokens > self.plan.max_context:
            return False
        new = self.pages.alloc(need)
        if new is None:
            return False
        self.map_pages(row, len(pages), new)
        pages.extend(new)
        return True

    def map_pages(self, row: int, first: int, new: list[int]) -> None:
        """Point positions from page index `first` of `row` at pages `new` (queued inside
        batched())."""
        if new:
            self.work.do(PoolWork(maps=[(row, first, list(new))]))

    # ---- state snapshots (the prefix cache's) ----
    def save_states(self, rows: list[int], slots: list[int]) -> None:
        """Snapshot the KDA states of `rows` into `slots` (after a forward wrote them)."""
        assert not self.work.open, "a save inside batched() would run before queued loads"
        if self.journal is not None:
            self.journal.append(("save", rows, slots))
        save_kda_states(self.target, rows, slots)

    def load_states(self, slots: list[int], rows: list[int]) -> None:
        """Start `rows` from the snapshots in `slots` (a prefix-cache hit; queued inside
        batched())."""
        self.work.do(PoolWork(loads=list(zip(slots, rows))))

    def take_journal(self) -> list[tuple]:
        entries, self.journal = self.journal or [], []
        return entries

    def replay(self, entries: list[tuple]) -> None:
        """A TP follower applies rank 0's row resets, page maps and snapshot copies, in order and
        batched as rank 0 applied them, so its request table, fresh states and snapshots equal
        rank 0's (its own allocators stay unused)."""
        for kind, *args in entries:
            if kind == "apply":
                self._apply(*args)
            else:
                self.save_states(*args)

    def free_pages(self, pages: list[int]) -> None:
        self.pages.free(pages)
        pages.clear()

    # ---- invariant ----
    def check(
        self,
        owners: dict[str, tuple[int | None, list[int]]],
        slot_owners: dict[str, list[int]] | None = None,
    ) -> None:
        """Every row, page and state slot is either free or owned by exactly one owner (a live
        request, or the prefix cache)."""
        rows_seen: dict[int, str] = {}
        pages_seen: dict[int, str] = {}
        for rid, (row, pages) in owners.items():
            if row is not None:
                if row in rows_seen:
                    raise AssertionError(f"row {row} owned by {rows_seen[row]} and {rid}")
                rows_seen[row] = rid
            for p in pages:
                if p in pages_seen:
                    raise AssertionError(f"page {p} owned by {pages_seen[p]} and {rid}")
                pages_seen[p] = rid
        if set(rows_seen) != set(self.rows.used):
            raise AssertionError(
                f"rows in use {sorted(self.rows.used)} != rows owned {sorted(rows_seen)}"
            )
        if set(pages_seen) != set(self.pages.used):
            leaked = sorted(set(self.pages.used) - set(pages_seen))
            raise AssertionError(f"pages in use but unowned (leak): {leaked[:16]}")
        slots_seen: dict[int, str] = {}
        for who, slots in (slot_owners or {}).items():
            for s in slots:
                if s in slots_seen:
                    raise AssertionError(f"state slot {s} owned by {slots_seen[s]} and {who}")
                slots_seen[s] = who
        if set(slots_seen) != set(self.state_slots.used):
            raise AssertionError(
                f"state slots in use {sorted(self.state_slots.used)[:16]} != owned "
                f"{sorted(slots_seen)[:16]}"
            )
        log.debug("pool invariant holds: %d rows, %d pages live", len(rows_seen), len(pages_seen))
