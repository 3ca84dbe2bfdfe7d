"""The sequences of one HTTP request: sent together, detokenized, streamed or collected."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from tokenizers import Tokenizer

from serving.front.api.errors import APIError
from serving.front.api.sampling import for_sequence
from serving.front.detokenizer import IncrementalDetokenizer, StreamingText
from serving.front.engine_client import EngineClient
from serving.protocol import FinishReason, GenerateRequest, SequenceOutput, TokenLogprob
from serving.sampling_params import SamplingParams

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The HTTP client went away before the response was ready."""


@dataclass
class Seq:
    index: int
    request: GenerateRequest
    text: StreamingText
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    input_logprobs: list[TokenLogprob] = field(default_factory=list)  # the scored prompt
    finish_reason: FinishReason | None = None
    cached_tokens: int = 0
    decode_cached_tokens: int | None = None  # PD decode's own hit (SequenceOutput's)
    stage_times: dict[str, float] = field(default_factory=dict)  # with the finished output

    @property
    def prompt_tokens(self) -> int:
        return len(self.request.input_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def apply(self, out: SequenceOutput) -> Update:
        reason = (out.finish_reason or FinishReason.stop()) if out.finished else None
        text = self.text.push(out.new_token_ids, reason)
        self.output_ids.extend(out.new_token_ids)
        self.logprobs.extend(out.logprobs or [])
        self.input_logprobs.extend(out.input_logprobs or [])
        self.cached_tokens = out.cached_tokens
        self.decode_cached_tokens = out.decode_cached_tokens
        self.stage_times = out.stage_times or self.stage_times
        self.finish_reason = reason
        return Update(self, text, out.logprobs or [], out.input_logprobs or [])

    def error(self) -> APIError | None:
        """A scheduler-side abort before any output token, or one refusing the request (400,
        e.g. an output constraint the scheduler cannot apply): the request failed. Other aborts
        after output keep the output, with finish_reason "abort"."""
        reason = self.finish_reason
        if reason is None or reason.kind != "abort" or (self.output_ids and reason.status != 400):
            return None
        return APIError(reason.status, reason.message or "the request was aborted")


@dataclass
class Update:
    seq: Seq
    text: str
    logprobs: list[TokenLogprob]
    input_logprobs: list[TokenLogprob] = field(default_factory=list)


def make_seqs(
    tokenizer: Tokenizer,
    rid: str | list[str],
    prompts: Sequence[list[int]],
    sampling: Sequence[SamplingParams],
    n: int,
    **request_fields: Any,
) -> list[Seq]:
    """n sequences per prompt (sequence index = prompt * n + i).

    A single rid names one sequence as is, several as "<rid>-<index>"; a list of rids (one per
    prompt) names each prompt's sequences "<rid>" or "<rid>-<i>". A request field given as a
    list (the bootstrap triple of a batch) holds one value per prompt or one per sequence:
    sglang-router sends one triple per sample for a chat completion with n > 1, one per prompt
    for a batch. With one room per prompt, its i-th sequence gets bootstrap_room + i (as
    SGLang): each PD handoff needs a room of its own, and prefill and decode derive the same.
    """
    total = len(prompts) * n
    if isinstance(rid, list) and len(rid) != len(prompts):
        raise APIError(400, f"rid: {len(rid)} values for {len(prompts)} prompts", "rid")
    for name, value in request_fields.items():
        if isinstance(value, list) and len(value) not in (len(prompts), total):
            raise APIError(
                400,
                f"{name}: {len(value)} values for {len(prompts)} prompts of {n} samples each",
                name,
            )
    seqs = []
    for p, ids in enumerate(prompts):
        for i in range(n):
            index = p * n + i
            per_seq = {k: _pick(v, p, index, total) for k, v in request_fields.items()}
            if isinstance(rid, list):
                seq_rid = rid[p] if n == 1 else f"{rid[p]}-{i}"
            else:
                seq_rid = rid if total == 1 else f"{rid}-{index}"
            params = for_sequence(sampling[p], i)
            room = per_seq.get("bootstrap_room")
            if room is not None and not _per_sequence(request_fields.get("bootstrap_room"), total):
                room = (room + i) % 2**63
            detokenizer = IncrementalDetokenizer(tokenizer, params.skip_special_tokens)
            request = GenerateRequest(
                rid=seq_rid,
                input_ids=ids,
                sampling=params,
                **{**per_seq, "bootstrap_room": room},
            )
            text = StreamingText(detokenizer, params.stop, params.no_stop_trim)
            seqs.append(Seq(index, request, text))
    return seqs


def _per_sequence(value: Any, total: int) -> bool:
    """A list with one entry per sequence (when prompts == sequences both readings agree)."""
    return isinstance(value, list) and len(value) == total


def _pick(value: Any, prompt: int, index: int, total: int) -> Any:
    if not isinstance(value, list):
        return value
    return value[index] if _per_sequence(value, total) else value[prompt]


async def run_seqs(client: EngineClient, seqs: Sequence[Seq]) -> AsyncIterator[Update]:
    """Updates of all sequences as they arrive. Closing this early aborts the unfinished ones."""
    queue: asyncio.Queue[tuple[Seq, SequenceOutput] | Exception] = asyncio.Queue()

    async def pump(seq: Seq) -> None:
        try:
            async with aclosing(client.generate(seq.request)) as outputs:
                async for out in outputs:
                    queue.put_nowait((seq, out))
        except Exception as e:
            queue.put_nowait(e)

    tasks = [asyncio.create_task(pump(seq)) for seq in seqs]
    try:
        remaining = len(seqs)
        while remaining:
            item = await queue.get()
            if isinstance(item, Exception):
                raise item
            seq, out = item
            update = seq.apply(out)
            if out.finished:
                remaining -= 1
            yield update
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def start_seqs(
    request: Request, client: EngineClient, seqs: Sequence[Seq]
) -> AsyncIterator[Update]:
    """run_seqs once its first update has arrived. A stream's response head waits for this, so
    a request that fails before its first token (refused, queue full, handoff failed) is an
    HTTP error that a router can retry, not a 200 with an error inside. Raises that error, or
    ClientDisconnected."""
    updates = run_seqs(client, seqs)
    try:
        first = await until_disconnected(request, anext(updates))
    except BaseException:
        await updates.aclose()
        raise
    if (error := first.seq.error()) is not None:
        await updates.aclose()
        raise error
    return _chain(first, updates)


async def _chain(first: Update, rest: AsyncIterator[Update]) -> AsyncIterator[Update]:
    async with aclosing(rest):  # type: ignore[type-var]
        yield first
        async for update in rest:
            yield update


async def collect(request: Request, client: EngineClient, seqs: Sequence[Seq]) -> None:
    """Run the sequences to the end; abort them if the client disconnects first. Raises the
    first sequence's error if one failed before producing output."""

    async def drain() -> None:
        async with aclosing(run_seqs(client, seqs)) as updates:
            async for _ in updates:
                pass

    await until_disconnected(request, drain())
    for seq in seqs:
        if (error := seq.error()) is not None:
            raise error


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`work`, cancelled (ClientDisconnected) if the client disconnects first."""
    work_task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work_task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work_task.done():
            work_task.cancel()
            await asyncio.gather(work_task, return_exceptions=True)
    if work_task.cancelled():
        raise ClientDisconnected
    return work_task.result()


async def _disconnected(request: Request) -> None:
    # The body has been read, so the next ASGI message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
