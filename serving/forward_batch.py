"""What one model forward needs to know about its batch: the ragged layout and cache addresses."""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from itertools import accumulate, chain
from operator import add

import torch


@dataclass
class KDAPass:
    """One pass of a KDA extend in pieces: these tokens of the batch (a slice when contiguous,
    else an index tensor) for these request rows and lengths; then the states of save_rows are
    snapshotted into save_slots (empty: none)."""

    index: slice | torch.Tensor
    rows: torch.Tensor
    lens: list[int]
    save_rows: torch.Tensor
    save_slots: torch.Tensor


@dataclass
class KDASaves:
    """Snapshot KDA states at positions inside a ragged extend (the prefix cache's states at
    grid positions inside a chunk). KDA layers then run the extend in passes, each continuing
    the rows' states where the last one left them: pass k covers every request's k-th segment
    (a request's chunk is cut at its save points), and the states are saved between passes.
    Only requests with a save inside their tokens come here: a save at a request's last token
    is ModelRunner.forward's, after the model (so there are always two passes or more)."""

    passes: list[KDAPass]

    @classmethod
    def plan(
        cls, saves: list[list[tuple[int, int]]], rows: list[int], lens: list[int], device
    ) -> KDASaves:
        """saves[b]: (after how many of request b's new tokens, slot), ascending."""
        t = lambda ids: to_device(ids, torch.int64, device)  # noqa: E731
        starts = [0, *accumulate(lens)][:-1]
        cuts = [[0] + [a for a, _ in request if a < n] + [n] for request, n in zip(saves, lens)]
        passes = []
        for k in range(max(len(c) for c in cuts) - 1):
            members = [b for b, c in enumerate(cuts) if len(c) > k + 1]
            ranges = [(starts[b] + cuts[b][k], starts[b] + cuts[b][k + 1]) for b in members]
            contiguous = all(ranges[i][1] == ranges[i + 1][0] for i in range(len(ranges) - 1))
            index = (
                slice(ranges[0][0], ranges[-1][1])
                if contiguous
                else t(list(chain.from_iterable(range(lo, hi) for lo, hi in ranges)))
            )
            saved = [
                (rows[b], slot) for b in members for a, slot in saves[b] if a == cuts[b][k + 1]
            ]
            passes.append(
                KDAPass(
                    index,
                    t([rows[b] for b in members]),
                    [hi - lo for lo, hi in ranges],
                    t([r for r, _ in saved]),
                    t([slot for _, slot in saved]),
                )
            )
        return cls(passes)


def to_device(values, dtype: torch.dtype, device) -> torch.Tensor:
    """Host values as a tensor on `device`, the host not waiting for the device. A blocking copy
    (torch.tensor(values, device=cuda), .to(cuda)) synchronizes the stream, and a non-blocking
    one from pageable memory may wait for it too (the driver stages it): either waits for the
    step in flight and undoes the overlap scheduler. On CUDA the values go through pinned memory
    (torch's caching host allocator: a block is reused only once its copy has run)."""
    pinned = torch.device(device).type == "cuda" and len(values) > 0
    host = _int64_host(values) if dtype == torch.int64 else None
    if host is None:
        return torch.tensor(values, dtype=dtype, pin_memory=pinned).to(device, non_blocking=True)
    return (host.pin_memory() if pinned else host).to(device, non_blocking=True)


def _int64_host(values) -> torch.Tensor | None:
    """A flat list of ints as an int64 host tensor, through array's C loop (a step's metadata is
    tens of thousands of ids: torch.tensor(list) takes 3-4x as long); None for anything else."""
    if type(values) is not list or not values or type(values[0]) is not int:
        return None
    try:
        return torch.frombuffer(array("q", values), dtype=torch.int64)
    except (TypeError, OverflowError):  # not all ints after all
        return None


def upload(host: torch.Tensor, device) -> torch.Tensor:
    """A host tensor's copy on `device`, without waiting for the device (to_device's way)."""
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


# A token id in a batch's input (StepInput): the token sampled for this row by the step launched
# before, still on the device (ModelRunner.next_tokens; the overlap scheduler's futures).
FUTURE = -1


def resolve_future(ids: torch.Tensor, rows: torch.Tensor, next_tokens: torch.Tensor) -> None:
    """In place: every FUTURE entry of `ids` (a token of request row rows[i]) becomes the token
    published for that row. Device ops only (no host sync, capturable)."""
    ids.copy_(torch.where(ids == FUTURE, next_tokens[rows], ids))


@dataclass
class ForwardBatch:
    """A ragged batch: request b contributes lens[b] new tokens at positions starts[b]...

    Tokens are flattened request after request. `token_slots` are the KV slots of the new tokens
    (already written into req_to_token by the caller). `logit_index` selects which of the T
    tokens produce logits.
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    token_slots: torch.Tensor  # [T] int64
    req_rows: torch.Tensor  # [B] int64 request-table rows
    token_req: torch.Tensor  # [T] int64 batch index of each token
    logit_index: torch.Tensor  # [N] int64 indices into T
    req_to_token: torch.Tensor  # the request table (position -> KV slot per row)
    max_seq_len: int  # bound on start + len over the batch (static under CUDA graphs)
    # The host's copies of starts, lens and req_rows: a ragged extend (build) reads these, never
    # the device tensors (reading those back would sync). Batches built from device tensors
    # (uniform, captured graphs) hold placeholders and take the graph-safe paths.
    starts_cpu: list[int]
    lens_cpu: list[int]
    rows_cpu: list[int]
    # Speculative verify: KDA layers record {layer: [conv inputs, per-position states]} here so
    # the state after the last accepted token can be restored (serving/speculative/eagle.py).
    kda_history: dict[int, list[torch.Tensor]] | None = None
    # Set when every request adds exactly step_len tokens (decode: 1; speculative verify and
    # draft catch-up: N+1). Layers then take their graph-safe paths: no host syncs, no
    # per-request Python loops, shapes fixed by (batch size, step_len).
    step_len: int | None = None
    # Prefill: KDA states to snapshot at positions inside the chunk (the prefix cache).
    kda_saves: KDASaves | None = None
    # What layers derive from the batch once per forward and share (index tensors of a ragged
    # extend), by the deriver's key. Hazard: valid for this batch only; never kept across steps.
    derived: dict = field(default_factory=dict)

    @property
    def is_decode(self) -> bool:
        """Every request adds exactly one token."""
        return self.step_len == 1 or all(n == 1 for n in self.lens_cpu)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @classmethod
    def build(
        cls,
        input_ids: list[int],
        req_rows: list[int],
        starts: list[int],
        lens: list[int],
        req_to_token: torch.Tensor,
        logits: str | list[bool] = "last",
        saves: list[list[tuple[int, int]]] | None = None,
    ) -> ForwardBatch:
        """Build from host lists; `logits` is "last" (one per request), "all", or per request
        whether all its tokens give logits (else its last one does). saves: per request,
        (after how many of its tokens, state slot) to snapshot its KDA state into."""
        device = req_to_token.device
        positions = list(chain.from_iterable(map(range, starts, map(add, starts, lens))))
        token_req = list(chain.from_iterable([b] * n for b, n in enumerate(lens)))
        ends = list(accumulate(lens))
        if logits == "all":
            index: list[int] | range = range(len(input_ids))
        elif isinstance(logits, str):
            index = [end - 1 for end in ends]
        else:
            index = []
            for n, end, every in zip(lens, ends, logits):
                index += range(end - n, end) if every else [end - 1]
        # the step's metadata in one host-to-device copy (each copy is a driver call)
        parts = [input_ids, positions, token_req, req_rows, index]
        packed = to_device(list(chain.from_iterable(parts)), torch.int64, device)
        ids_t, pos_t, tok_req_t, rows_t, logit_index = packed.split([len(p) for p in parts])
        return cls(
            input_ids=ids_t,
            positions=pos_t,
            token_slots=req_to_token[rows_t[tok_req_t], pos_t].to(torch.int64),
            req_rows=rows_t,
            token_req=tok_req_t,
            logit_index=logit_index,
            req_to_token=req_to_token,
            max_seq_len=max(s + n for s, n in zip(starts, lens)),
            starts_cpu=list(starts),
            lens_cpu=list(lens),
            rows_cpu=list(req_rows),
            kda_saves=KDASaves.plan(saves, req_rows, lens, device)
            if saves is not None and any(saves)
            else None,
        )

    @classmethod
    def uniform(
        cls,
        input_ids: torch.Tensor,
        req_rows: torch.Tensor,
        starts: torch.Tensor,
        step_len: int,
        req_to_token: torch.Tensor,
        max_seq_len: int,
        logits: str = "all",
    ) -> ForwardBatch:
        """Every request adds step_len tokens at starts[b].., built from device tensors with
        tensor ops only (capturable in a CUDA graph). input_ids: [B * step_len]."""
        num_reqs = req_rows.shape[0]
        offsets = torch.arange(step_len, device=req_rows.device)
        positions = (starts[:, None] + offsets).flatten()
        token_req = torch.arange(num_reqs, device=req_rows.device).repeat_interleave(step_len)
        logit_index = torch.arange(num_reqs * step_len, device=req_rows.device)
        if logits == "last":
            logit_index = logit_index[step_len - 1 :: step_len]
        return cls(
            input_ids=input_ids,
            positions=positions,
            token_slots=req_to_token[req_rows[token_req], positions],
            req_rows=req_rows,
            token_req=token_req,
            logit_index=logit_index,
            req_to_token=req_to_token,
            max_seq_len=max_seq_len,
            starts_cpu=[],
            lens_cpu=[step_len] * num_reqs,
            rows_cpu=[],
            step_len=step_len,
        )
