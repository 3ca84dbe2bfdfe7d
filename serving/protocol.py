"""Messages between the HTTP front and the scheduler process (ZMQ, pickled dataclasses).

front --GenerateRequest / AbortRequest--> scheduler --BatchOutput--> front
front --ControlRequest--> scheduler --ControlReply--> front   (admin routes: /flush_cache,
                                                              /start_profile, /stop_profile)

Every request is identified by `rid`, unique per sequence (a request with n > 1 becomes n
sequences with rids "<id>-<i>"). The scheduler sends each sequence's new tokens as they are
sampled and exactly one message with `finished=True` per rid, aborted or not.
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any, Literal

from serving.sampling_params import SamplingParams

SHUTDOWN = "shutdown"  # front -> scheduler: finish up and exit
# SGLang's bootstrap_host for a PD request that runs on one worker alone (health probes).
FAKE_BOOTSTRAP_HOST = "2.2.2.2"


@dataclass
class ImageInput:
    """One image of a request, preprocessed by the front (serving/front/images.py): what the
    vision tower takes, and where its embeddings go. Its run is input_ids[start : start +
    num_tokens], all <|image|>; the runs of a request's images ascend and never overlap."""

    # numpy float32 [patches, channels * temporal * patch * patch]; None on a PD decode worker,
    # whose front only counts the image's tokens (prefill encodes it; decode gets KV and states)
    pixel_values: Any
    grid_thw: tuple[int, int, int]  # in patches
    start: int
    num_tokens: int
    content_hash: int  # of the image's bytes (the front's): its positions' prefix-cache key


@dataclass
class GenerateRequest:
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    return_logprob: bool = False
    top_logprobs_num: int = 0
    # Prompt logprobs (SGLang's): with return_logprob, the prompt tokens from this position on
    # are scored by the prefill forward; -1 = none.
    logprob_start_len: int = -1
    # PD disaggregation (filled by the router; unused by a plain worker)
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None
    images: list[ImageInput] = field(default_factory=list)  # in prompt order


@dataclass
class AbortRequest:
    rid: str
    reason: str = "client disconnected"


@dataclass
class ControlRequest:
    """An admin command (one of the subclasses below); the scheduler answers each with one
    ControlReply carrying the same `id`, whatever else it is doing."""

    id: str = field(default_factory=lambda: uuid.uuid4().hex)


@dataclass
class FlushCache(ControlRequest):
    """Empty the prefix cache (refused while requests are live)."""


@dataclass
class StartProfile(ControlRequest):
    """SGLang's /start_profile body: torch profiler traces of every rank, written when profiling
    stops (/stop_profile, or after `num_steps` forward steps)."""

    output_dir: str | None = None  # None: --profile-dir / $SGLANG_TORCH_PROFILER_DIR / /tmp
    num_steps: int | None = None  # None: until /stop_profile
    activities: list[str] = field(default_factory=lambda: ["CPU", "GPU"])
    with_stack: bool = True
    record_shapes: bool = False
    profile_prefix: str = ""
    profile_id: str = ""  # the traces' file name stem (SGLang: the start time)


@dataclass
class StopProfile(ControlRequest):
    """Stop profiling and write the traces."""


@dataclass
class ControlReply:
    id: str
    error: str | None = None  # why the command was refused or failed (an HTTP 400); None: done
    message: str = ""  # what was done (e.g. the trace files written)


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float | None  # None only for a prompt's first token (nothing predicts it)
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(frozen=True)
class FinishReason:
    """Why a sequence ended.

    stop: a stop token (matched = its id), a stop string (matched = the string) or a completed
    grammar (matched = None); length: max_new_tokens or the context; abort: the request failed or
    was cancelled, `status` is the HTTP status the front answers with and `message` says why."""

    kind: Literal["stop", "length", "abort"]
    matched: int | str | None = None
    status: int = 200
    message: str = ""

    @classmethod
    def stop(cls, matched: int | str | None = None) -> FinishReason:
        return cls("stop", matched)

    @classmethod
    def length(cls) -> FinishReason:
        return cls("length")

    @classmethod
    def abort(cls, message: str, status: int) -> FinishReason:
        return cls("abort", status=status, message=message)

    def to_json(self) -> dict[str, Any]:
        """SGLang's meta_info.finish_reason."""
        if self.kind == "abort":
            return {"type": "abort", "message": self.message, "status_code": self.status}
        return {"type": self.kind, "matched": self.matched}


@dataclass
class SequenceOutput:
    rid: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    # PD decode with its page cache: prompt tokens whose KV it held, which prefill did not send
    # (meta_info.decode_cached_tokens; not part of cached_tokens, which is prefill's hit)
    decode_cached_tokens: int | None = None
    logprobs: list[TokenLogprob] | None = None
    # the scored prompt tokens (logprob_start_len on), once, with the sequence's first output
    input_logprobs: list[TokenLogprob] | None = None
    # seconds from joining the queue to starting to run (SGLang's queue time), once, with the
    # first output after it started
    queue_time: float | None = None
    # With the finished output: where its time to first token went, in seconds (those that
    # apply; docs/PROTOCOL.md): queue_time, prefill_forward_time; PD decode also
    # decode_prealloc_time, prefill_arrival_wait_time, kv_transfer_time (with its parts
    # kv_ship_wait_time and kv_write_time), decode_queue_time, first_decode_step_time; PD
    # prefill the same prefill parts and kv_transfer_time (its prompt done -> writes done); and
    # decode_time, not a TTFT part: from its first token to its finish, in this worker
    stage_times: dict[str, float] | None = None

    def __reduce__(self):
        # Pickled as the class and its field values in order, not a dict per output: one step's
        # BatchOutput holds one per running request, and this halves its pickling both ways.
        return (SequenceOutput, _SEQUENCE_OUTPUT_FIELDS(self))


_SEQUENCE_OUTPUT_FIELDS = attrgetter(*(f.name for f in dataclasses.fields(SequenceOutput)))


@dataclass
class SchedulerStats:
    """The scheduler's state, sent to the front after every step that changed it; the front's
    /metrics reads it (serving/front/metrics.py). Fields ending in _total only grow."""

    running: int = 0
    queued: int = 0
    used_rows: int = 0  # request rows: each holds a request's KDA state (the state pool)
    peak_used_rows: int = 0  # highest request row handed out so far (PD extra slots in use)
    total_rows: int = 0
    used_pages: int = 0
    total_pages: int = 0
    page_size: int = 0
    retractions: int = 0
    spec_verify_steps: int = 0  # per request: accept length = committed tokens / verify steps
    spec_committed_tokens: int = 0
    spec_num_steps: int = 0  # draft tokens proposed per verify step (0: no speculation)
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    decode_tokens_total: int = 0  # committed by decode steps: not prefill's or a handoff's first
    # The prefix cache's lookups at admission: prompt tokens looked up, and those found cached
    # (both 0 with --disable-radix-cache); /metrics turns them into cache_hit_rate.
    cache_lookup_tokens_total: int = 0
    cache_hit_tokens_total: int = 0
    # The vision tower (a checkpoint with one): images encoded so far, and requests holding
    # image embeddings now (only while part-way through an image's tokens; else a leak)
    images_encoded_total: int = 0
    image_embeddings_held: int = 0
    # PD, filled by the role (RoleHooks.report), with SGLang's meanings
    num_prefill_prealloc_queue_reqs: int = 0  # prefill: rooms waiting for decode's destinations
    num_prefill_inflight_queue_reqs: int = 0  # prefill: prefilled, their KV still being written
    num_decode_prealloc_queue_reqs: int = 0  # decode: finding prefill, or waiting for memory
    num_decode_transfer_queue_reqs: int = 0  # decode: destinations sent, KV not all arrived
    num_bootstrap_failed_reqs_total: int = 0  # failed before any KV was on its way (not 499)
    num_transfer_failed_reqs_total: int = 0  # failed while their KV was on its way (not 499)
    kv_transfer_latency_ms: float = 0.0  # prefill, last room: its last write order to all done
    kv_transfer_speed_gb_s: float = 0.0  # prefill, last room: its bytes / time its writes ran
    kv_transfer_total_mb: float = 0.0  # prefill, last room: bytes written (10^6 B)
    # the prefix cache
    cached_pages: int = 0  # pages it holds (those no request locks count as free, not used)
    cached_states: int = 0  # KDA state snapshots it holds
    total_state_slots: int = 0


@dataclass
class BatchOutput:
    outputs: list[SequenceOutput]
    stats: SchedulerStats | None = None


@dataclass
class SchedulerReady:
    """First message from the scheduler: it loaded the model and can take requests."""

    vocab_size: int
    context_length: int
    eos_token_ids: list[int]
    max_running_requests: int
    total_rows: int
    total_pages: int
    page_size: int
    device: str
    dtype: str
    # which weights run block FP8 and why (serving/models/fp8_choice.summary); None: no FP8
    fp8: dict | None = None


@dataclass
class SchedulerFailed:
    """The scheduler could not start (or died); `message` is one line for the operator."""

    message: str
