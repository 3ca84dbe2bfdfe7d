"""A request inside the scheduler (Req), the scheduler's limits (SchedulerConfig) and the hooks
through which the engine tells a worker role (serving/engine/role.py, workers/) what happened
to a request (RoleHooks)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from serving.executor.sampler import SamplingState
from serving.memory.radix_cache import Node
from serving.protocol import (
    FinishReason,
    GenerateRequest,
    ImageInput,
    SchedulerStats,
    TokenLogprob,
)


class RoleHooks:
    """What the engine calls on a worker role; the plain worker's answers. Role
    (serving/engine/role.py) adds the role's side: intake, polling, its sockets.

    Invariant: a request the role holds (finished() returned True) keeps its row and pages
    until the role calls Scheduler.release_held(); nothing else frees them.
    """

    def chunk_prefilled(self, req: Req, end: int) -> None:
        """The KV and state of req's first `end` tokens are computed (after every prefill
        chunk, once its step completed). Under the overlap scheduler req.cached may already
        count a later chunk the device is still computing: only `end` is safe to read."""

    def finished(self, req: Req) -> bool:
        """req just finished; True = the role holds its memory and reports it later."""
        return False

    def owned(self) -> list[Req]:
        """Requests outside the scheduler's queues that own rows or pages (for the invariant)."""
        return []

    @property
    def queued(self) -> int:
        """Requests the role holds that have not started running (waiting for a peer, for
        memory, for their KV); counted in num_queue_reqs and against the queue bound."""
        return 0

    def report(self, stats: SchedulerStats) -> None:
        """Write the role's own figures (PD queues, failures, transfers) into `stats`; called
        whenever the scheduler refreshes them."""


@dataclass
class SchedulerConfig:
    max_running_requests: int
    chunked_prefill_size: int
    max_prefill_tokens: int
    context_length: int
    max_queued_requests: int | None = None  # None: no bound
    prefix_cache: bool = False  # the radix cache (needs state slots in the pool)
    # PD decode's prefix cache: a tree of KV pages without snapshots, matched only by requests
    # another worker prefills (prefix_cache is off there)
    page_cache: bool = False
    track_interval: int = 256  # decode hands the cache a snapshot every this many tokens
    overlap: bool = True  # launch step N+1 before committing step N (scheduler.py)
    # observability (serving/engine/batch_log.py)
    disaggregation_mode: str = "null"
    decode_log_interval: int = 40
    log_requests: bool = False


@dataclass(eq=False)  # an entity: == is identity, so a membership test compares no fields
class Req:
    rid: str
    input_ids: list[int]
    sampling: SamplingState
    return_logprob: bool = False
    top_logprobs_num: int = 0
    row: int | None = None
    pages: list[int] = field(default_factory=list)  # by position; the row maps these
    cached: int = 0  # leading tokens of fill_ids whose KV/state is in the cache
    # The prefix cache (serving/engine/admission.py). The request KV-locks `prefix`, the tree
    # node at the end of its longest cached run; `shared_pages` are the pages of `pages` the
    # tree owns (never freed by the request). track_slot: a state snapshot the request holds
    # privately, taken at grid position track_pos while decoding (0: none valid yet).
    prefix: Node | None = None
    shared_pages: set[int] = field(default_factory=set)
    track_slot: int | None = None
    track_pos: int = 0
    branch: int = 0  # grid position where its tokens leave the cache's KV (a state is worth it)
    # With an EAGLE draft, the cache keys of pair_tokens (admission.keys), extended as tokens
    # join: rebuilding them per step cost a Python loop over the whole history.
    pair_keys: list[int] = field(default_factory=list)
    pair_tokens: list[int] = field(default_factory=list)
    cached_tokens: int | None = None  # prompt tokens the cache served at its first admission
    # PD decode with its page cache: prompt tokens (whole pages) whose KV decode's own tree held
    # at preallocation, so prefill did not send them (cached_tokens stays prefill's hit); None:
    # no page cache looked up
    decode_cached_tokens: int | None = None
    finish_reason: FinishReason | None = None
    # The overlap scheduler (scheduler.py). in_flight: launched steps holding this request whose
    # results are not processed yet; its row and pages are freed only at 0 (admission.release
    # defers). pending: tokens sampled for it still on the device, each committed when its step
    # is processed (2 at most: step N+1 launched before step N's commit); the newest is at its
    # row of ModelRunner.next_tokens, and the next step's input is FUTURE. An overlapped EAGLE
    # step counts 1 (at least one token; the host learns how many when it is processed), and
    # leaves its next position in Eagle.next_positions.
    in_flight: int = 0
    pending: int = 0
    last_logprob: TokenLogprob | None = None  # of the latest sampled token, when asked for
    # Prompt logprobs: prompt positions below `input_scored` are scored (or not wanted) and in
    # `input_logprobs`, which go out once, with the first output (a retracted request's
    # re-prefill scores nothing twice).
    input_logprobs: list[TokenLogprob] = field(default_factory=list)
    input_scored: int = 0
    input_logprobs_sent: bool = False
    # Queue time: from joining the queue (PD decode: from its KV's arrival) until it first
    # starts running; goes out once, with the first output after that.
    queued_at: float = field(default_factory=time.monotonic)
    queue_time: float | None = None
    queue_time_sent: bool = False
    # Stage times in seconds, by SequenceOutput.stage_times' names; sent with the last output.
    # A PD decode request (adopted) gets prefill's stages from prefill's Success message.
    # decode_time is the one that is not a TTFT part: first token to finish (`finishing`).
    stages: dict[str, float] = field(default_factory=dict)
    started_at: float | None = None  # first admitted (PD decode: adopted)
    first_token_at: float | None = None  # its first token joined it (sampled or adopted)
    adopted: bool = False  # PD decode: the prompt was prefilled by a prefill worker
    # The prompt's images (serving/engine/image_prefill.py encodes them while it prefills);
    # their pixel values stay with the request (a retraction re-encodes them).
    images: list[ImageInput] = field(default_factory=list)

    @classmethod
    def of(cls, request: GenerateRequest, eos_token_ids: frozenset[int]) -> Req:
        """A new request's Req, its prompt logprobs' start set (positions before it count as
        scored)."""
        state = SamplingState(
            params=request.sampling,
            prompt_ids=list(request.input_ids),
            output_ids=[],
            eos_token_ids=eos_token_ids,
        )
        req = cls(
            request.rid,
            list(request.input_ids),
            state,
            request.return_logprob,
            request.top_logprobs_num,
            images=list(request.images),
        )
        start = request.logprob_start_len if request.return_logprob else -1
        req.input_scored = len(req.input_ids) if start < 0 else start
        if start == 0 and req.input_ids:  # nothing predicts the first token: no logprob
            req.input_logprobs.append(TokenLogprob(req.input_ids[0], None))
            req.input_scored = 1
        return req

    def started(self) -> None:
        """It runs (admitted, or adopted by PD decode); a retracted request restarting keeps
        its first queue time."""
        if self.queue_time is None:
            self.started_at = time.monotonic()
            self.queue_time = self.started_at - self.queued_at

    def tokens_joined(self) -> None:
        """Tokens are about to join it (Commit.commit): the stages that end at its first token
        (queue, prefill forward) and, for PD decode, at its first decode step."""
        now = time.monotonic()
        if self.first_token_at is None:
            self.first_token_at = now
            if not self.adopted:
                self.stages["queue_time"] = self.queue_time or 0.0
                self.stages["prefill_forward_time"] = now - (self.started_at or now)
        elif self.adopted and "first_decode_step_time" not in self.stages:
            self.stages["first_decode_step_time"] = now - self.first_token_at

    def finishing(self) -> None:
        """It finishes: decode_time, from its first token to now, is this worker's part of its
        time per output token; a client's TPOT above decode_time / (tokens - 1) is what the path
        to the client (front, router, network) added."""
        if self.first_token_at is not None:
            self.stages["decode_time"] = time.monotonic() - self.first_token_at

    @property
    def output_ids(self) -> list[int]:
        return self.sampling.output_ids

    @property
    def fill_ids(self) -> list[int]:
        """Tokens the model consumes; the last sampled token is consumed by the next step."""
        return self.input_ids + self.output_ids

    @property
    def uncached(self) -> int:
        return len(self.input_ids) + len(self.output_ids) - self.cached

    def prompt_targets(self, n: int) -> range:
        """Prompt positions still to score that the next n-token chunk's logits predict (the
        token at position t is scored by the logits at t - 1)."""
        last = min(self.cached + n, len(self.input_ids) - 1)
        return range(max(self.cached + 1, self.input_scored), last + 1)
