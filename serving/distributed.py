"""Parallel state of one rank: who am I, how many of us, and the collectives we use.

A worker started with --tp-size/--ep-size runs `world = max(tp, ep)` rank processes in one
torch.distributed process group (NCCL on CUDA, gloo on CPU); tp and ep are each 1 or `world`.
Attention heads, the dense MLP, the shared expert and the vocabulary split over the TP ranks;
routed experts split over the EP ranks (or, with ep 1, over TP by their intermediate size).

Invariants:
- every rank runs the same forward on the same batch, so every collective is entered by every
  rank in the same order; a rank that skips one hangs the others until the group's timeout
  (set at init, so nothing hangs forever);
- tensors that must stay identical across ranks (hidden streams, logits) only ever come out of
  an all-reduce or all-gather, never from rank-local arithmetic on partials; the rest that
  must agree (MLA latents, the indexer's pool scores and selection) come from replicated
  weights applied to replicated inputs by the same deterministic kernels.

Rank 0 talks to the front; control messages (the batch description) go over a gloo group even
on CUDA, so they never touch the GPU stream.

Simulated rank (--simulate-rank R, `init_simulated`): one process runs exactly rank R's shard of a
world of N, its collectives through torch's fake backend, which returns at once. Tensor
collectives leave this rank's own data where it is (an all-reduce yields the local partial; an
all-gather's other parts are zeroed here, so nothing uninitialised reaches the sampler). Object
collectives fail on the fake backend, so this process is the driver and no object collective is
ever issued: min_over_ranks / broadcast_object / gather_object answer locally. Every answer is
meaningless (the other ranks' parts are missing); the per-rank shapes, memory and kernels are
real.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from serving.config import ModelConfig


@dataclass(frozen=True)
class ParallelState:
    rank: int = 0
    tp_size: int = 1
    ep_size: int = 1
    simulated: bool = False  # one process running rank `rank` alone (fake backend)

    @property
    def world(self) -> int:
        return max(self.tp_size, self.ep_size)

    @property
    def processes(self) -> int:
        """Rank processes of this worker that run and answer: the world, or 1 when simulated."""
        return 1 if self.simulated else self.world

    @property
    def tp_rank(self) -> int:
        return self.rank if self.tp_size > 1 else 0

    @property
    def ep_rank(self) -> int:
        return self.rank if self.ep_size > 1 else 0

    @property
    def moe_tp_size(self) -> int:
        """Routed experts split by intermediate size over TP only when EP does not split them."""
        return self.tp_size if self.ep_size == 1 else 1


_state = ParallelState()
_group: Any = None  # NCCL (CUDA) or gloo (CPU): tensors of the forward
_cpu_group: Any = None  # gloo: control objects


def state() -> ParallelState:
    return _state


def set_state(new: ParallelState) -> None:
    """Set the sizes without a process group (tests building one rank's shard in-process)."""
    global _state
    _state = new


def init_parallel(
    rank: int,
    tp_size: int,
    ep_size: int,
    init_method: str,
    device: str,
    timeout_s: float = 600.0,
    backend: str | None = None,
) -> ParallelState:
    """Join the worker's process group (once per rank process). backend: NCCL on CUDA, gloo on
    the CPU, unless given. TEST MODE: backend "gloo" on CUDA lets several ranks share one GPU
    (NCCL refuses two ranks on one device; tests/test_tp_gpu.py). gloo carries CUDA tensors for
    every tensor collective below (all_reduce, all_gather, broadcast) by staging them through
    pinned host memory; it is slow and cannot be captured in a CUDA graph, so never serve with
    it."""
    global _state, _group, _cpu_group
    world = max(tp_size, ep_size)
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend is None:
        backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world, timeout=timeout
    )
    _group = dist.group.WORLD
    _cpu_group = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else _group
    _state = ParallelState(rank, tp_size, ep_size)
    return _state


def init_simulated(rank: int, tp_size: int, ep_size: int) -> ParallelState:
    """Run rank `rank` of a world of max(tp, ep) alone: collectives through the fake backend."""
    global _state, _group, _cpu_group
    from torch.testing._internal.distributed.fake_pg import FakeStore

    world = max(tp_size, ep_size)
    if world < 2 or not 0 <= rank < world:
        raise ValueError(f"a simulated rank needs a world of 2 or more and 0 <= {rank} < {world}")
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    _group = _cpu_group = dist.group.WORLD
    _state = ParallelState(rank, tp_size, ep_size, simulated=True)
    return _state


def destroy_parallel() -> None:
    global _state, _group, _cpu_group
    if dist.is_initialized():
        dist.destroy_process_group()
    _state, _group, _cpu_group = ParallelState(), None, None


def check_sizes(config: ModelConfig, tp_size: int, ep_size: int) -> None:
    """ValueError naming the numbers when the checkpoint does not split over these sizes."""
    world = max(tp_size, ep_size)
    if tp_size not in (1, world) or ep_size not in (1, world):
        raise ValueError(f"--tp-size {tp_size} --ep-size {ep_size}: each must be 1 or {world}")
    moe_tp = tp_size if ep_size == 1 else 1
    # vocab_size is not checked: the vocabulary is padded to a multiple of tp (padded_vocab)
    checks = [
        ("tp", tp_size, "linear_num_heads (KDA heads)", config.linear_num_heads),
        ("tp", tp_size, "num_attention_heads (MLA heads)", config.num_attention_heads),
        ("tp", tp_size, "intermediate_size (dense MLP)", config.intermediate_size),
        (
            "tp",
            tp_size,
            "moe_intermediate_size x n_shared_experts (shared expert)",
            config.moe_intermediate_size * config.n_shared_experts,
        ),
        ("ep", ep_size, "n_routed_experts", config.n_routed_experts),
        ("tp", moe_tp, "moe_intermediate_size (routed experts)", config.moe_intermediate_size),
    ]
    for flag, size, what, n in checks:
        if n % size:
            raise ValueError(f"--{flag}-size {size}: the checkpoint's {what} = {n} does not divide")


def rank_cache_config(config: ModelConfig) -> ModelConfig:
    """The config the caches are sized from on this rank: KDA states hold this rank's heads
    (conv channels and recurrent states split with them); MLA latents and pooled index keys are
    per token and replicated, so nothing else changes."""
    tp = _state.tp_size
    if tp == 1:
        return config
    return dataclasses.replace(config, linear_num_heads=config.linear_num_heads // tp)


def padded_vocab(vocab_size: int, tp_size: int) -> int:
    """Rows of embed_tokens and lm_head over all TP ranks: vocab_size rounded up to a multiple
    of tp_size (SGLang's vocab-parallel embedding pads the same way). The padded rows are zero
    and their logits are cut before anything reads them (Glm5NextForCausalLM.project)."""
    return -(-vocab_size // tp_size) * tp_size


def split(n: int, size: int, rank: int) -> slice:
    """The rank's contiguous share of n items (n divisible by size)."""
    share = n // size
    return slice(rank * share, (rank + 1) * share)


# ---- collectives (no-ops on one rank) ----
# Tally of the tensor collectives issued while `count_collectives` is open: kind -> [calls, bytes
# this rank sends in]. Counted when the Python call runs, so a CUDA graph counts at capture.
_tally: dict[str, list[int]] | None = None


@contextlib.contextmanager
def count_collectives() -> Iterator[dict[str, list[int]]]:
    """{kind: [calls, bytes]} of the tensor collectives issued inside the block (benches)."""
    global _tally
    outer, _tally = _tally, {}
    try:
        yield _tally
    finally:
        _tally = outer


def _count(kind: str, x: torch.Tensor) -> None:
    if _tally is not None:
        entry = _tally.setdefault(kind, [0, 0])
        entry[0] += 1
        entry[1] += x.numel() * x.element_size()


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over every rank (in place): partial sums of TP shards or of EP expert sets."""
    if _state.world == 1:
        return x
    _count("all_reduce", x)
    dist.all_reduce(x, group=_group)
    return x


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum of head-split partials; a no-op where heads are not split (tp 1)."""
    return all_reduce(x) if _state.tp_size > 1 else x


def all_gather_last(x: torch.Tensor) -> torch.Tensor:
    """Concatenate the TP ranks' shards along the last dimension (vocab-parallel logits)."""
    if _state.tp_size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_state.tp_size)]
    _count("all_gather", x)
    dist.all_gather(parts, x, group=_group)
    if _state.simulated:  # the fake backend leaves the parts as they were (or copies x)
        parts = [x if r == _state.tp_rank else torch.zeros_like(x) for r in range(len(parts))]
    return torch.cat(parts, dim=-1)


def min_over_ranks(n: int) -> int:
    """The smallest of every rank's n (sizes that must agree, e.g. the KV pages planned)."""
    if _state.processes == 1:
        return n
    t = torch.tensor([n], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_cpu_group)
    return int(t.item())


def broadcast_tensor(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's x into every rank's x (same shape and dtype on every rank), in place."""
    if _state.processes > 1:
        dist.broadcast(x, src=0, group=_group)
    return x


def gather_object(obj: Any) -> list[Any] | None:
    """Every rank's obj in rank order on rank 0 (None on the others), over the gloo group."""
    if _state.processes == 1:
        return [obj]
    out = [None] * _state.world if _state.rank == 0 else None
    dist.gather_object(obj, out, dst=0, group=_cpu_group)
    return out


def broadcast_object(obj: Any = None) -> Any:
    """Rank 0 sends `obj`; every rank returns it (pickled over the gloo group)."""
    if _state.processes == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=_cpu_group)
    return box[0]
