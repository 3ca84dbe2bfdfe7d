"""Load a running server with concurrent streaming requests; report throughput and latency.

    python -m serving.tools.bench_serving --url http://127.0.0.1:30000 --concurrency 16 \
        --requests 32 --input-len 128 --output-len 64

Each request is a streaming POST /generate with random token ids and ignore_eos, so every
request produces exactly --output-len tokens. With `--image-size N` each request is instead a
one-image chat: a user message of one N x N PNG (a data: URL; noise under a few filled shapes,
drawn from the request's own seed, so the prefix cache, which keys images by content, never
hits across requests) and a short question; --input-len does not apply, the prompt is the
image's tokens and a few more (`prompt_tokens_mean`). `--image-api generate` (the default)
sends it to /generate as SGLang's image_data under GLM's chat format, streamed and counted as
the token prompts are; `--image-api chat` to /v1/chat/completions with the image_url part,
tokens counted from the usage on every chunk (continuous_usage_stats; `image_tokens_mean` from
it too), no stage times. A chat chunk is sent only when its token brings text, so the chat's
TTFT and ITL are exact only where every token decodes to text: not on a tiny_model checkpoint
whose model vocabulary outgrows its tokenizer (the bench preset: 154,880 ids, a 1,024-token
tokenizer; the ids past it decode to nothing).

Reports output tokens/s over the whole run, time to first token (TTFT: mean, p50, p99), time
per output token (TPOT: per request (end - TTFT) / (tokens - 1), then averaged, as SGLang's
bench_serving defines it), each request's decode-phase tokens/s (the inverse, averaged), and
inter-token latency (ITL: the gaps between stream events that brought new tokens; with
speculative decoding one event can bring several tokens, so TPOT is the figure to compare
across configurations). `ttft_parts_ms_mean` averages the stage times that the last chunk's
meta_info carries (queue, prefill forward, KV transfer, decode queue, first decode step:
docs/PROTOCOL.md), so a TTFT splits into its parts. `worker_tpot_ms` is the same TPOT from the
worker's own clock (its decode_time over tokens - 1), and `tpot_over_worker_ms` each request's
TPOT less it, averaged: how much the path from the worker to this client (front, router,
network) stretched the stream per token, whatever the load's shape made the worker's steps take
(negative where the first token took longer to arrive than the last: stream set-up). Router
minus --direct, on this figure, is the router's per-token cost without the load-shape
difference that TPOT alone carries.

`--direct PREFILL_URL BOOTSTRAP_PORT` (with --url the decode worker) plays the router's part
itself: each request goes to the prefill worker and to the decode worker with the same
bootstrap triple, and streams from decode. Against a run through the router (same stack), the
difference is what the router adds.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import random
import statistics
import time

import httpx
import numpy as np
from PIL import Image, ImageDraw

ROOMS = random.Random()  # bootstrap rooms of --direct requests (the router's are 63-bit too)


def drawn_png(size: int, seed: tuple[int, ...]) -> bytes:
    """A size x size PNG: uniform noise under 3 to 5 filled rectangles, ellipses and triangles
    of random colours, all from `seed` (noise: no two requests' images alike)."""
    rng = np.random.default_rng(seed)
    image = Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))
    draw = ImageDraw.Draw(image)
    for _ in range(rng.integers(3, 6)):
        (x0, x1), (y0, y1) = np.sort(rng.integers(0, size, (2, 2)), axis=1).tolist()
        fill = tuple(rng.integers(0, 256, 3).tolist())
        kind = rng.integers(0, 3)
        if kind == 0:
            draw.rectangle((x0, y0, x1, y1), fill=fill)
        elif kind == 1:
            draw.ellipse((x0, y0, x1, y1), fill=fill)
        else:
            draw.polygon([(x0, y1), (x1, y1), ((x0 + x1) // 2, y0)], fill=fill)
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


# what GLM's chat template renders for one user message of an image and a text
GLM_IMAGE_CHAT = (
    "[gMASK]<sop><|user|><|begin_of_image|><|image|><|end_of_image|>{}<|assistant|><think>"
)
IMAGE_QUESTION = "What shapes are in this picture, and what colours?"


def image_request(png: bytes, n: int, api: str) -> dict:
    """A streaming request for n tokens (ignore_eos) about one image: /generate's (SGLang's
    image_data) or, api "chat", a chat completion's with usage on every chunk."""
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    if api == "generate":
        sampling = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
        text = GLM_IMAGE_CHAT.format(IMAGE_QUESTION)
        return {"text": text, "image_data": [url], "stream": True, "sampling_params": sampling}
    content = [
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": IMAGE_QUESTION},
    ]
    return {
        "messages": [{"role": "user", "content": content}],
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "max_tokens": n,
        "temperature": 0,
        "ignore_eos": True,
    }


def token_request(ids: list[int], n: int) -> dict:
    return {
        "input_ids": ids,
        "stream": True,
        "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
    }


async def one_request(
    client: httpx.AsyncClient, url: str, body: dict, direct: tuple | None = None
) -> dict:
    """`body` is token_request's or image_request's."""
    chat = "messages" in body
    path = "/v1/chat/completions" if chat else "/generate"
    start = time.perf_counter()
    prefill = None
    if direct is not None:
        prefill_url, bootstrap_port = direct
        host = httpx.URL(prefill_url).host
        body = {**body, "bootstrap_host": host, "bootstrap_port": bootstrap_port,
                "bootstrap_room": ROOMS.getrandbits(63)}  # fmt: skip
        alone = {k: v for k, v in body.items() if k != "stream_options"}  # stream only
        prefill = asyncio.create_task(
            client.post(prefill_url + path, json={**alone, "stream": False})
        )
    stamps: list[float] = []
    seen = 0
    meta: dict = {}
    usage: dict = {}
    async with client.stream("POST", url + path, json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"{path} stream failed: {chunk['error']}")
            if chat:
                usage = chunk.get("usage") or usage
                count = usage.get("completion_tokens", 0)
            else:
                count, meta = len(chunk["output_ids"]), chunk.get("meta_info") or meta
            if count > seen:
                stamps.append(time.perf_counter())
                seen = count
    end = time.perf_counter()
    if prefill is not None:
        (await prefill).raise_for_status()
    return {
        "ttft": stamps[0] - start,
        "e2e": end - start,
        "itl": [b - a for a, b in zip(stamps, stamps[1:])],
        "tokens": seen,
        "stages": {k: v for k, v in meta.items() if k.endswith("_time") and v is not None},
        "decode_time": meta.get("decode_time"),
        "prompt_tokens": (usage if chat else meta).get("prompt_tokens"),
        "image_tokens": (usage.get("prompt_tokens_details") or {}).get("image_tokens"),
    }


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def run(args: argparse.Namespace) -> dict:
    if args.image_size:  # drawn before the clock starts; the warm-up's image is its own
        bodies = [
            image_request(drawn_png(args.image_size, (args.seed, i)), n, args.image_api)
            for i, n in enumerate([args.output_len] * args.requests + [2])
        ]
        warm_up, bodies = bodies[-1], bodies[:-1]
    else:
        rng = random.Random(args.seed)
        bodies = [
            token_request([rng.randrange(0, args.vocab) for _ in range(args.input_len)],
                          args.output_len)
            for _ in range(args.requests)
        ]  # fmt: skip
        warm_up = token_request(bodies[0]["input_ids"], 2)
    direct = (args.direct[0], int(args.direct[1])) if args.direct else None
    sem = asyncio.Semaphore(args.concurrency)
    limits = httpx.Limits(max_connections=args.concurrency * 2)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def bounded(body: dict) -> dict:
            async with sem:
                return await one_request(client, args.url, body, direct)

        await one_request(client, args.url, warm_up, direct)
        t0 = time.perf_counter()
        results = await asyncio.gather(*(bounded(b) for b in bodies))
        wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in results)
    ttft = [r["ttft"] * 1000 for r in results]
    itl = [x * 1000 for r in results for x in r["itl"]]
    # Decode phase of each request: after its first token, (tokens - 1) more.
    decoding = [
        (r["e2e"] - r["ttft"], r["tokens"] - 1, r["decode_time"])
        for r in results
        if r["tokens"] > 1
    ]
    tpot = [1000 * t / n for t, n, _ in decoding]
    decode_rate = [n / t for t, n, _ in decoding if t > 0]
    # per request: its TPOT and the worker's own over the same tokens
    own = [(1000 * t / n, 1000 * w / n) for t, n, w in decoding if w is not None]
    report = {
        "concurrency": args.concurrency,
        "requests": args.requests,
        "input_len": None if args.image_size else args.input_len,
        "output_len": args.output_len,
        "output_tok_per_s": round(tokens / wall, 1),
        "ttft_ms_mean": round(statistics.mean(ttft), 1),
        "ttft_ms_p50": round(pct(ttft, 0.5), 1),
        "ttft_ms_p99": round(pct(ttft, 0.99), 1),
        "e2e_ms_mean": round(statistics.mean(r["e2e"] * 1000 for r in results), 1),
        "tpot_ms": round(statistics.mean(tpot), 3) if tpot else None,
        "tpot_ms_p50": round(pct(tpot, 0.5), 3) if tpot else None,
        "decode_tok_per_s_per_req": round(statistics.mean(decode_rate), 1) if decode_rate else None,
        "itl_ms_mean": round(statistics.mean(itl), 3) if itl else None,
        "itl_ms_p50": round(pct(itl, 0.5), 2) if itl else None,
        "itl_ms_p99": round(pct(itl, 0.99), 2) if itl else None,
        "worker_tpot_ms": round(statistics.mean(w for _, w in own), 3) if own else None,
        "tpot_over_worker_ms": round(statistics.mean(c - w for c, w in own), 3) if own else None,
        "ttft_parts_ms_mean": {
            name: round(1000 * statistics.mean(r["stages"].get(name, 0.0) for r in results), 1)
            for name in sorted({n for r in results for n in r["stages"]} - {"decode_time"})
        },
    }
    if args.image_size:
        report["image_size"], report["image_api"] = args.image_size, args.image_api
        for key in ("prompt_tokens", "image_tokens"):
            counts = [r[key] for r in results if r[key] is not None]
            report[f"{key}_mean"] = round(statistics.mean(counts), 1) if counts else None
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:30000")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=1000)
    ap.add_argument(
        "--image-size",
        type=int,
        default=0,
        metavar="N",
        help="image chats: one N x N PNG and a short text per request (see above; 0: token "
        "prompts to /generate)",
    )
    ap.add_argument(
        "--image-api",
        choices=("generate", "chat"),
        default="generate",
        help="with --image-size: the route the image chats go to (see above)",
    )
    ap.add_argument(
        "--seed",
        type=int,
        default=0,
        help="of the random prompts: runs against one server that should not share a prefix "
        "cache's hits need different seeds",
    )
    ap.add_argument(
        "--direct",
        nargs=2,
        metavar=("PREFILL_URL", "BOOTSTRAP_PORT"),
        help="PD without a router: --url is the decode worker (see above)",
    )
    print(json.dumps(asyncio.run(run(ap.parse_args()))))


if __name__ == "__main__":
    main()
