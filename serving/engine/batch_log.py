"""SGLang's batch log lines and the per-request finish line.

    Prefill batch, #new-seq: .., #new-token: .., #cached-token: .., token usage: ..,
        #running-req: .., #queue-req: .., [PD prefill: #prealloc-req: .., #inflight-req: ..,
        input throughput (token/s): ..,]
    Decode batch, #running-req: .., #token: .., token usage: .., [EAGLE: accept len: ..,
        accept rate: ..,] [PD decode: pre-allocated usage: .., #prealloc-req: ..,
        #transfer-req: ..,] cuda graph: .., gen throughput (token/s): .., #queue-req: ..,

in SGLang's words (its scheduler_metrics_mixin), a prefill line after every prefill batch and a
decode line every --decode-log-interval decode batches. Token usage is the pages requests hold
(cached pages no request locks are free) over the pool's; #token counts those pages' tokens.
PD prefill's #prealloc-req are the rooms waiting for decode's destinations (its bootstrap queue),
#inflight-req the prefilled ones whose KV is still being written; PD decode's #prealloc-req wait
for prefill or memory, #transfer-req for their KV, and pre-allocated usage is the pages they hold.
A finished request's stage times go to the log at info with --log-requests, else at debug.
"""

from __future__ import annotations

import logging
import time

from serving.engine.request import Req, RoleHooks, SchedulerConfig
from serving.executor.model_runner import ModelRunner
from serving.protocol import SchedulerStats, SequenceOutput
from serving.speculative.eagle import Eagle

log = logging.getLogger(__name__)


class BatchLog:
    def __init__(
        self,
        cfg: SchedulerConfig,
        stats: SchedulerStats,
        runner: ModelRunner,
        spec: Eagle | None,
        hooks: RoleHooks,
    ) -> None:
        self.cfg, self.stats, self.runner, self.spec, self.hooks = cfg, stats, runner, spec, hooks
        cuda = str(runner.pool.device).startswith("cuda")
        self.graph_name = "cuda graph" if cuda else "cpu graph"
        self.decode_batches = 0
        self.rebase()

    def rebase(self) -> None:
        """Count from the stats as they are now: at start, and after the warm-up zeroes the
        _total counters (the lines report differences of counters, which must not go back)."""
        stats, now = self.stats, time.perf_counter()
        self.last_prefill, self.last_decode = now, now
        self.hits = stats.cache_hit_tokens_total
        self.decoded = stats.decode_tokens_total
        self.verify = (stats.spec_verify_steps, stats.spec_committed_tokens)

    def _usage(self) -> tuple[int, float]:
        s = self.stats
        return s.used_pages * s.page_size, s.used_pages / max(s.total_pages, 1)

    def prefill(self, plan: list[tuple[Req, int]], running: int, queued: int) -> None:
        """After a prefill batch (`plan`: its requests and chunk tokens; `running`: requests
        decoding when it was scheduled; `queued`: requests still waiting)."""
        s, now = self.stats, time.perf_counter()
        new_tokens = sum(n for _, n in plan)
        hits, self.hits = s.cache_hit_tokens_total - self.hits, s.cache_hit_tokens_total
        _, usage = self._usage()
        msg = (
            f"Prefill batch, #new-seq: {len(plan)}, #new-token: {new_tokens}, "
            f"#cached-token: {hits}, token usage: {usage:.2f}, "
            f"#running-req: {running}, #queue-req: {queued}, "
        )
        if self.cfg.disaggregation_mode == "prefill":
            throughput = new_tokens / max(now - self.last_prefill, 1e-9)
            msg += (
                f"#prealloc-req: {s.num_prefill_prealloc_queue_reqs}, "
                f"#inflight-req: {s.num_prefill_inflight_queue_reqs}, "
                f"input throughput (token/s): {throughput:.2f}, "
            )
        self.last_prefill = now
        log.info(msg)

    def decode(self, batch_size: int, queued: int) -> None:
        """After a decode batch of `batch_size` requests; logs every decode_log_interval."""
        self.decode_batches += 1
        if self.decode_batches % self.cfg.decode_log_interval:
            return
        s, now = self.stats, time.perf_counter()
        decoded, self.decoded = s.decode_tokens_total - self.decoded, s.decode_tokens_total
        throughput = decoded / max(now - self.last_decode, 1e-9)
        self.last_decode = now
        tokens, usage = self._usage()
        msg = (
            f"Decode batch, #running-req: {batch_size}, #token: {tokens}, "
            f"token usage: {usage:.2f}, "
        )
        graphs = self.runner.graphs
        if self.spec is not None:
            steps = s.spec_verify_steps - self.verify[0]
            committed = s.spec_committed_tokens - self.verify[1]
            self.verify = (s.spec_verify_steps, s.spec_committed_tokens)
            length = committed / max(steps, 1)
            rate = length / (self.spec.steps + 1)
            msg += f"accept len: {length:.2f}, accept rate: {rate:.2f}, "
            graphs = self.spec.graphs
        if self.cfg.disaggregation_mode == "decode":
            held = sum(len(r.pages) for r in self.hooks.owned())
            msg += (
                f"pre-allocated usage: {held / max(s.total_pages, 1):.2f}, "
                f"#prealloc-req: {s.num_decode_prealloc_queue_reqs}, "
                f"#transfer-req: {s.num_decode_transfer_queue_reqs}, "
            )
        graph = graphs is not None and graphs.fits(batch_size)
        msg += (
            f"{self.graph_name}: {graph}, gen throughput (token/s): {throughput:.2f}, "
            f"#queue-req: {queued}, "
        )
        log.info(msg)

    def finished(self, outputs: list[SequenceOutput]) -> None:
        """One line per finished request: its tokens, finish reason and stage times."""
        level = logging.INFO if self.cfg.log_requests else logging.DEBUG
        if not log.isEnabledFor(level):
            return
        for out in outputs:
            if not out.finished:
                continue
            stages = ", ".join(f"{k}: {v:.4f}" for k, v in (out.stage_times or {}).items())
            reason = out.finish_reason.to_json() if out.finish_reason else None
            log.log(
                level,
                "Finish: rid: %s, prompt tokens: %d, completion tokens: %d, cached tokens: %d, "
                "finish reason: %s, stage times (s): {%s}",
                out.rid,
                out.prompt_tokens,
                out.completion_tokens,
                out.cached_tokens,
                reason,
                stages,
            )
