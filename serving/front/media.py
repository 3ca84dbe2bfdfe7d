"""Where an image's bytes come from: a data: URL (base64), an http(s) URL on an allowed host, a
file under the allowed local directory, or (SGLang's image_data) bare base64. Every refusal is
an ImageError naming the problem (a 400); nothing here blocks the event loop.

Policy (MediaPolicy, from the flags): http(s) only for hosts on --allowed-media-domains (off by
default, as vLLM's), matched exactly (case-insensitive), redirects not followed (a redirect
could leave the list); each fetch bounded by --media-fetch-timeout as a whole (not per read, so
a slow drip cannot hold it open) and by the byte cap, streamed so a large body is cut off, never
buffered whole. file:// URLs (and SGLang's bare absolute paths) only under
--allowed-local-media-path, judged after resolving symlinks and `..`.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

import httpx

from serving.front.images import MAX_IMAGE_BYTES, ImageError


@dataclass(frozen=True)
class MediaPolicy:
    allowed_domains: frozenset[str] = frozenset()
    local_root: Path | None = None
    timeout: float = 5.0
    max_bytes: int = MAX_IMAGE_BYTES

    @classmethod
    def of(cls, domains: str | None, local_root: str | None, timeout: float) -> MediaPolicy:
        hosts = frozenset(h.strip().lower() for h in (domains or "").replace(" ", ",").split(","))
        root = Path(local_root).resolve() if local_root else None
        return cls(hosts - {""}, root, timeout)


async def image_bytes(source: str, policy: MediaPolicy) -> bytes:
    """The bytes an image reference names (a URL, or SGLang's bare base64 or path)."""
    scheme = source[: source.find(":")].lower() if ":" in source[:12] else ""
    if scheme == "data":
        return _data_url(source, policy.max_bytes)
    if scheme in ("http", "https"):
        return await _fetch(source, policy)
    if scheme == "file" or source.startswith("/"):
        return await asyncio.to_thread(_local_file, source, policy)
    if scheme:
        raise ImageError(f"image URL scheme {scheme!r} is not supported (data, http(s), file)")
    return _base64(source, policy.max_bytes)


def _data_url(url: str, max_bytes: int) -> bytes:
    head, comma, payload = url.partition(",")
    if not comma or not head.lower().endswith(";base64"):
        raise ImageError("image data URL must be data:<type>;base64,<data>")
    return _base64(payload, max_bytes)


def _base64(payload: str, max_bytes: int) -> bytes:
    if len(payload) * 3 // 4 > max_bytes + 3:  # judged before decoding
        raise ImageError(
            f"image of about {len(payload) * 3 // 4} bytes is over the limit of {max_bytes} bytes"
        )
    try:
        return base64.b64decode(payload.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("image data is not valid base64") from None


async def _fetch(url: str, policy: MediaPolicy) -> bytes:
    host = (urlsplit(url).hostname or "").lower()
    if host not in policy.allowed_domains:
        raise ImageError(
            f"image URL host {host!r} is not allowed (--allowed-media-domains"
            + (f": {', '.join(sorted(policy.allowed_domains))})" if policy.allowed_domains else
               " is not set)")
        )  # fmt: skip
    try:
        return await asyncio.wait_for(_download(url, policy), policy.timeout)
    except TimeoutError:
        raise ImageError(f"image URL {url!r} timed out after {policy.timeout:g} s") from None
    except httpx.HTTPError as e:
        raise ImageError(f"image URL {url!r} could not be fetched: {e}") from None


async def _download(url: str, policy: MediaPolicy) -> bytes:
    async with httpx.AsyncClient(follow_redirects=False, timeout=policy.timeout) as client:
        async with client.stream("GET", url) as response:
            if response.status_code != 200:
                raise ImageError(f"image URL {url!r} answered HTTP {response.status_code}")
            data = bytearray()
            async for chunk in response.aiter_bytes():
                data += chunk
                if len(data) > policy.max_bytes:
                    raise ImageError(
                        f"image at {url!r} is over the limit of {policy.max_bytes} bytes"
                    )
            return bytes(data)


def _local_file(source: str, policy: MediaPolicy) -> bytes:
    if policy.local_root is None:
        raise ImageError("local image files are not allowed (no --allowed-local-media-path)")
    raw = unquote(urlsplit(source).path) if source.lower().startswith("file:") else source
    path = Path(raw).resolve()
    if not path.is_relative_to(policy.local_root):
        raise ImageError(f"image file {raw!r} is outside --allowed-local-media-path")
    try:
        size = path.stat().st_size
        if size > policy.max_bytes:
            raise ImageError(f"image of {size} bytes is over the limit of {policy.max_bytes} bytes")
        return path.read_bytes()
    except OSError as e:
        raise ImageError(f"image file {raw!r} cannot be read: {e.strerror}") from None
