"""The compute stream, and the device memory Mooncake copies.

Every forward, graph replay and copy of a scheduler process runs on one stream from torch's pool
(non-blocking: it does not order itself with the legacy default stream), made current by
`use_compute_stream` before the rank builds anything. Mooncake's TCP transport reads and writes
device memory with blocking cudaMemcpy calls on the legacy default stream, one per 64 KiB slice.
Were the forwards on that stream too, each slice would wait for every forward queued before
it: a prefill's handoff behind the next prefill batch, decode's landing writes behind the
steps in flight. On separate streams nothing orders the two, so two rules hold instead:
- the sender reads pages only after an event recorded on the compute stream behind the writes
  (workers/rank_transfer.RankSender);
- device memory Mooncake wrote is read only after `landed_writes` (the compute stream waits for
  the legacy one): a host-to-device cudaMemcpy from pageable memory may return before its DMA
  lands. RDMA writes go NIC to memory, on no stream, and are complete when prefill says Success.
PDSERVE_DEFAULT_STREAM=1 keeps everything on the legacy default stream (the A/B measurement).
"""

from __future__ import annotations

import os

import torch

SIDE_STREAM = os.environ.get("PDSERVE_DEFAULT_STREAM") != "1"


def use_compute_stream(device: str) -> None:
    """Make a pool stream this thread's current stream (CUDA; nothing elsewhere)."""
    if str(device).startswith("cuda") and SIDE_STREAM:
        torch.cuda.synchronize()  # whatever ran on the old stream is done before the switch
        torch.cuda.set_stream(torch.cuda.Stream())


def landed_writes(device: str) -> None:
    """Order the compute stream after every copy Mooncake has issued so far (no host wait)."""
    if str(device).startswith("cuda") and SIDE_STREAM:
        torch.cuda.current_stream().wait_stream(torch.cuda.default_stream())
