"""What a long token-id prompt costs between a server's HTTP socket and its scheduler.

    python -m bench.front_overhead --url http://127.0.0.1:30000 [--requests 32] [--len 4096]
        [--route generate|completions] [--rounds 3] [--vocab 1024] [--client httpx|raw]

Each round sends --requests streaming requests at once (/generate with input_ids, or
/v1/completions with a token-id prompt), every prompt --len ids: a shared prefix (cached by a
warm-up request, so the model's compute is one short chunk per request) and 16 ids of its own.
Per request: the client's TTFT (sent -> first chunk with tokens), the scheduler's own part of it
from the finished chunk's meta_info (queue_time + prefill_forward_time: arrival at the scheduler
to the first token committed), and their difference, `host_ms`: the front's intake (body read,
JSON, validation, the request built and sent), the link both ways and the response path, and
this client (which pre-encodes its bodies; --client raw: a bare asyncio connection instead of
httpx, so the client's own share is next to nothing). Needs a
server that reports stage times (every worker does, in the last chunk's meta_info).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from collections.abc import AsyncIterator, Callable
from urllib.parse import urlsplit

import httpx

OWN_IDS = 16  # per request, after the shared prefix: each request prefills a chunk of its own


def bodies(a: argparse.Namespace, round_no: int) -> tuple[bytes, list[bytes]]:
    """(the warm-up body with the shared prefix, one pre-encoded body per request)."""
    rng = random.Random(round_no)
    prefix = [rng.randrange(a.vocab) for _ in range(a.len - OWN_IDS)]
    prompts = [prefix + [rng.randrange(a.vocab) for _ in range(OWN_IDS)] for _ in range(a.requests)]
    return encode(a, prefix), [encode(a, p) for p in prompts]


def encode(a: argparse.Namespace, ids: list[int]) -> bytes:
    if a.route == "generate":
        params = {"max_new_tokens": a.output_len, "temperature": 0, "ignore_eos": True}
        body = {"input_ids": ids, "stream": True, "sampling_params": params}
    else:
        body = {
            "prompt": ids,
            "stream": True,
            "max_tokens": a.output_len,
            "temperature": 0,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
    return json.dumps(body).encode()


async def one(post: Post, a: argparse.Namespace, body: bytes) -> dict[str, float]:
    path = "/generate" if a.route == "generate" else "/v1/completions"
    start, ttft, meta = time.perf_counter(), None, {}
    async for data in post(a.url + path, body):
        if data == "[DONE]":
            continue
        chunk = json.loads(data)
        if ttft is None and _has_tokens(chunk):
            ttft = time.perf_counter() - start
        meta = chunk.get("meta_info") or meta
    total = time.perf_counter() - start
    out = {"ttft_ms": ttft * 1e3, "total_ms": total * 1e3}
    if "queue_time" in meta:
        scheduler = meta["queue_time"] + meta["prefill_forward_time"]
        out["scheduler_ms"] = scheduler * 1e3
        out["host_ms"] = (ttft - scheduler) * 1e3
    return out


def _has_tokens(chunk: dict) -> bool:
    if "output_ids" in chunk:
        return bool(chunk["output_ids"])
    return any(c.get("text") for c in chunk.get("choices", []))


Post = Callable[[str, bytes], AsyncIterator[str]]


def httpx_post(client: httpx.AsyncClient) -> Post:
    """The SSE data of a streamed POST through httpx (as bench/prefix_cache.py sends)."""

    async def post(url: str, body: bytes) -> AsyncIterator[str]:
        headers = {"content-type": "application/json"}
        async with client.stream("POST", url, content=body, headers=headers) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    yield line[6:]

    return post


async def raw_post(url: str, body: bytes) -> AsyncIterator[str]:
    """The same over a bare asyncio connection (HTTP/1.1, chunked SSE): a client whose own
    per-request cost is next to nothing, to tell the server's share from httpx's."""
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    head = (
        f"POST {parts.path} HTTP/1.1\r\nhost: {parts.netloc}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    writer.write(head.encode() + body)
    try:
        status = await reader.readline()
        if b" 200 " not in status:
            raise RuntimeError(f"{url}: {status.decode().strip()}")
        while await reader.readline() not in (b"\r\n", b""):
            pass
        pending = b""
        while size := int((await reader.readline()).strip() or b"0", 16):
            pending += (await reader.readexactly(size + 2))[:-2]  # the chunk's CRLF
            *events, pending = pending.split(b"\n\n")
            for event in events:
                if event.startswith(b"data: "):
                    yield event[6:].decode()
    finally:
        writer.close()


async def run(a: argparse.Namespace) -> dict:
    limits = httpx.Limits(max_connections=a.requests + 4)
    rounds = []
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        post = httpx_post(client) if a.client == "httpx" else raw_post
        for r in range(a.rounds):
            warm, sent = bodies(a, r)
            await one(post, argparse.Namespace(**{**vars(a), "output_len": 1}), warm)
            results = await asyncio.gather(*(one(post, a, b) for b in sent))
            rounds.append(results)
            print(f"round {r}: {summary(results)}", flush=True)
    return summary([x for res in rounds for x in res])


def summary(results: list[dict[str, float]]) -> dict[str, float]:
    keys = results[0].keys()
    return {f"{k}_mean": round(statistics.fmean(r[k] for r in results), 1) for k in keys} | {
        f"{k}_max": round(max(r[k] for r in results), 1) for k in keys
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--url", required=True)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--len", type=int, default=4096)
    ap.add_argument("--output-len", type=int, default=4)
    ap.add_argument("--route", choices=("generate", "completions"), default="generate")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--client", choices=("httpx", "raw"), default="httpx")
    ap.add_argument("--vocab", type=int, default=1024, help="ids are drawn below this")
    a = ap.parse_args()
    print(json.dumps(asyncio.run(run(a))))


if __name__ == "__main__":
    main()
