"""SGLang's native POST /generate and POST /abort_request."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from tokenizers import Tokenizer

from serving.front.api.context import FrontContext
from serving.front.api.errors import APIError
from serving.front.api.image_request import attach_images, load_images
from serving.front.api.logprobs import native_logprobs
from serving.front.api.native_protocol import AbortBody, GenerateBody, NativeSamplingParams
from serving.front.api.responses import SSE_DONE, event_stream, sse, stream_error
from serving.front.api.sampling import (
    check_n,
    check_prompt_ids,
    check_top_logprobs,
    request_sampling,
)
from serving.front.api.sequences import Seq, Update, collect, make_seqs, start_seqs
from serving.protocol import ImageInput, SchedulerReady
from serving.sampling_params import SamplingParams

NATIVE_DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's


def native_router(ctx: FrontContext) -> APIRouter:
    router = APIRouter()

    @router.post("/generate")
    async def generate(body: GenerateBody, request: Request) -> Response:
        ready = ctx.scheduler()
        prompts, batched = await _prompts(ctx, body, ready)
        prompts, images = await _prompt_images(ctx, body, prompts, batched)
        params = body.sampling_params or NativeSamplingParams()
        if isinstance(params, list):
            if len(params) != len(prompts):
                raise APIError(
                    400,
                    f"sampling_params: {len(params)} entries for {len(prompts)} prompts",
                    "sampling_params",
                )
        else:
            params = [params] * len(prompts)
        n = params[0].n
        check_n(n)
        if any(p.n != n for p in params):
            raise APIError(400, "sampling_params.n: must be the same for every prompt", "n")
        check_top_logprobs(body.top_logprobs_num, "top_logprobs_num")
        if body.logprob_start_len < -1:
            raise APIError(
                400,
                f"logprob_start_len: must be -1 (no prompt logprobs) or >= 0, "
                f"got {body.logprob_start_len}",
                "logprob_start_len",
            )
        think_end = _think_end(ctx) if body.require_reasoning else None
        texts = ctx.tokenizer if body.return_text_in_logprobs else None
        scoring = body.return_logprob and body.logprob_start_len >= 0
        samplings = [_sampling(ctx, p, ready, len(ids), scoring) for p, ids in zip(params, prompts)]
        seqs = make_seqs(
            ctx.tokenizer,
            body.rid or uuid.uuid4().hex,
            prompts,
            samplings,
            n,
            return_logprob=body.return_logprob,
            top_logprobs_num=body.top_logprobs_num,
            logprob_start_len=body.logprob_start_len,
            bootstrap_host=body.bootstrap_host,
            bootstrap_port=body.bootstrap_port,
            bootstrap_room=body.bootstrap_room,
            images=images,
        )
        many = batched or n > 1
        if body.stream:
            updates = await start_seqs(request, ctx.client, seqs)
            return event_stream(_stream(ctx, updates, many, think_end, texts))
        await collect(request, ctx.client, seqs)
        results = [_result(ctx, seq, think_end, texts) for seq in seqs]
        return JSONResponse(results if many else results[0])

    @router.post("/abort_request")
    async def abort_request(body: AbortBody) -> Response:
        rids = [
            rid
            for rid in ctx.client.inflight_rids()
            if body.abort_all or rid == body.rid or rid.startswith(f"{body.rid}-")
        ]
        for rid in rids:
            ctx.client.abort(rid, "aborted by /abort_request")
        return JSONResponse({"aborted": rids})

    return router


async def _prompts(
    ctx: FrontContext, body: GenerateBody, ready: SchedulerReady
) -> tuple[list[list[int]], bool]:
    """Token ids of each prompt, and whether the request was a batch."""
    if (body.text is None) == (body.input_ids is None):
        raise APIError(400, "give exactly one of text and input_ids", "text")
    vocab_size = ready.vocab_size
    if body.text is not None:
        texts = body.text if isinstance(body.text, list) else [body.text]
        for text in texts:
            ctx.check_text_length(len(text), ready.context_length, "text")
        prompts = [await ctx.encode_checked(t, True, ready.context_length, "text") for t in texts]
        batched = isinstance(body.text, list)
    else:
        ids = body.input_ids
        batched = bool(ids) and isinstance(ids[0], list)
        prompts = [list(p) for p in ids] if batched else [list(ids)]
    if not prompts:
        raise APIError(400, "the batch is empty", "text" if body.text is not None else "input_ids")
    for ids in prompts:
        check_prompt_ids(ids, vocab_size, "input_ids")
    return prompts, batched


async def _prompt_images(
    ctx: FrontContext, body: GenerateBody, prompts: list[list[int]], batched: bool
) -> tuple[list[list[int]], list[list[ImageInput]]]:
    """SGLang's image_data: each prompt's images loaded and its placeholders expanded."""
    data = body.image_data
    if data is None:
        per_prompt: list = [None] * len(prompts)
    elif batched:
        if not isinstance(data, list) or len(data) != len(prompts):
            raise APIError(400, f"image_data: one entry per prompt ({len(prompts)})", "image_data")
        per_prompt = data
    else:
        per_prompt = [data]
    expanded, images = [], []
    for ids, sources in zip(prompts, per_prompt):
        listed = [sources] if isinstance(sources, str) else list(sources or [])
        if any(not isinstance(s, str) for s in listed):
            raise APIError(400, "image_data: an image is a string (a URL or base64)", "image_data")
        loaded = await load_images(ctx.vision, listed, "image_data")
        ids, inputs = attach_images(ctx.vision, ids, loaded, "image_data")
        expanded.append(ids)
        images.append(inputs)
    return expanded, images


def _sampling(
    ctx: FrontContext,
    p: NativeSamplingParams,
    ready: SchedulerReady,
    prompt_len: int,
    scoring_prompt: bool,
) -> SamplingParams:
    sampling = request_sampling(
        ctx.sampling_defaults,
        p,
        ready,
        prompt_len,
        max_tokens=p.max_new_tokens,
        default_max_tokens=NATIVE_DEFAULT_MAX_NEW_TOKENS,
        seed=p.sampling_seed if p.sampling_seed is not None else p.seed,
        min_new_tokens=p.min_new_tokens,
        scoring_prompt=scoring_prompt,
        json_schema=p.json_schema,
        regex=p.regex,
        ebnf=p.ebnf,
    )
    ctx.check_constraint(sampling)
    return sampling


def _think_end(ctx: FrontContext) -> int:
    """`</think>`'s id, for require_reasoning (SGLang: the output starts in reasoning)."""
    if ctx.args.reasoning_parser is None or ctx.glm_tokens is None:
        raise APIError(
            400,
            "require_reasoning: needs a server started with --reasoning-parser",
            "require_reasoning",
        )
    return ctx.glm_tokens.think_end


def _result(
    ctx: FrontContext, seq: Seq, think_end: int | None = None, texts: Tokenizer | None = None
) -> dict[str, Any]:
    """SGLang's /generate result. With think_end (require_reasoning), meta_info's
    reasoning_tokens counts the output up to and including `</think>` (all of it while the
    reasoning is still open), as SGLang counts it. With `texts` (return_text_in_logprobs)
    every logprob entry carries its token's text."""
    meta: dict[str, Any] = {
        "id": seq.request.rid,
        "finish_reason": seq.finish_reason.to_json() if seq.finish_reason else None,
        "prompt_tokens": seq.prompt_tokens,
        "completion_tokens": len(seq.output_ids),
        "cached_tokens": seq.cached_tokens,
        **seq.stage_times,  # where the time to first token went (docs/PROTOCOL.md)
    }
    if seq.decode_cached_tokens is not None:  # PD decode's page cache; cached_tokens: prefill's
        meta["decode_cached_tokens"] = seq.decode_cached_tokens
    if think_end is not None:
        ids = seq.output_ids
        meta["reasoning_tokens"] = ids.index(think_end) + 1 if think_end in ids else len(ids)
    if seq.request.return_logprob:
        meta.update(native_logprobs(seq.logprobs, "output", texts))
        if seq.request.logprob_start_len >= 0:
            # In PD the decode worker answers with the prompt's logprobs (prefill sends them
            # with the KV); sglang-router concatenates prefill's input_token_logprobs before
            # decode's, so a prefill worker answers with none.
            prefill = ctx.args.disaggregation_mode == "prefill"
            meta.update(native_logprobs([] if prefill else seq.input_logprobs, "input", texts))
    return {"text": seq.text.text, "output_ids": list(seq.output_ids), "meta_info": meta}


async def _stream(
    ctx: FrontContext,
    updates: AsyncIterator[Update],
    many: bool,
    think_end: int | None,
    texts: Tokenizer | None,
) -> AsyncIterator[str]:
    """Cumulative results, one event per update; batch items carry their "index"."""
    try:
        async with aclosing(updates):
            async for update in updates:
                seq = update.seq
                if (error := seq.error()) is not None:
                    yield stream_error(error)
                    break
                result = _result(ctx, seq, think_end, texts)
                yield sse({**result, "index": seq.index} if many else result)
    except Exception as e:
        yield stream_error(e)
    yield SSE_DONE
