"""Reading an HTTP request: who sent it, its body within a size limit, its JSON object (the API's endpoints and the
batch tier's share them)."""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request

from tokenfleet.api.openai_schema import APIError


def peer(request: Request) -> str:
    return f"{request.client.host}:{request.client.port}" if request.client else ""


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it passes ``limit`` bytes: a declared Content-Length
    over it is refused before reading, and a chunked body is counted as it streams in."""
    length = request.headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise APIError(400, "Content-Length is not a number")
        if int(length) > limit:
            raise APIError(413, f"request body over {limit} bytes", code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"request body over {limit} bytes", code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


async def json_body(request: Request, limit: int) -> dict[str, Any]:
    """The body as a JSON object; 400 for one that is not UTF-8 JSON or not an object, 413 past ``limit``."""
    raw = await read_body(request, limit)
    try:
        body = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise APIError(400, f"request body is not valid UTF-8 (byte {e.start})") from e
    except json.JSONDecodeError as e:
        raise APIError(400, f"request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise APIError(400, f"request body must be a JSON object, got {type(body).__name__}")
    return body
