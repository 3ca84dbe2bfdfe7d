"""The SSE stream both OpenAI routes share: one chunk head, the chunk framing (with vLLM's
usage on every chunk), a failure that ends the stream, the usage chunk last."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing
from typing import Any

from serving.front.api.context import FrontContext
from serving.front.api.responses import SSE_DONE, sse, stream_error
from serving.front.api.sequences import Seq, Update


class ChunkStream(ABC):
    """One streamed response: `opening` before any update, `events` for each update,
    `final_usage` for the last chunk when asked. A sequence's failure or an exception ends
    the stream with its error event and [DONE] (the status is already 200); closing the
    stream closes the updates, which aborts the sequences still running."""

    object_name: str  # the chunks' "object"
    part: str  # the choice's field that carries the new output: "delta" or "text"

    def __init__(
        self, ctx: FrontContext, rid: str, seqs: list[Seq], usage_mode: tuple[bool, bool]
    ) -> None:
        self.ctx = ctx
        self.seqs = seqs
        self.include_usage, self.continuous = usage_mode
        self.head = {
            "id": rid,
            "object": self.object_name,
            "created": int(time.time()),
            "model": ctx.model_name,
        }

    def opening(self) -> Iterator[str]:
        return iter(())

    @abstractmethod
    def events(self, update: Update) -> Iterator[str]: ...

    @abstractmethod
    def final_usage(self) -> dict[str, Any]: ...

    def chunk(self, index: int, output: Any, **choice: Any) -> str:
        fields = {"logprobs": None, "finish_reason": None, **choice}
        out = {**self.head, "choices": [{"index": index, self.part: output, **fields}]}
        if self.continuous:
            out["usage"] = _seq_usage(self.seqs[index])
        return sse(out)

    async def run(self, updates: AsyncIterator[Update]) -> AsyncIterator[str]:
        for event in self.opening():
            yield event
        try:
            async with aclosing(updates):
                async for update in updates:
                    if (error := update.seq.error()) is not None:
                        yield stream_error(error)
                        yield SSE_DONE
                        return
                    for event in self.events(update):
                        yield event
        except Exception as e:
            yield stream_error(e)
            yield SSE_DONE
            return
        if self.include_usage:
            yield sse({**self.head, "choices": [], "usage": self.final_usage()})
        yield SSE_DONE


def _seq_usage(seq: Seq) -> dict[str, int]:
    completion = len(seq.output_ids)
    return {
        "prompt_tokens": seq.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": seq.prompt_tokens + completion,
    }
