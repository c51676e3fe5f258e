"""The batch tier's formats, apart from where they are stored: OpenAI's file and list objects, a batch's input
lines and their checks, completion windows, ids, and the errors and limits the tier answers with."""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
MAX_ERRORS = 100  # validation errors reported per batch
_WINDOW = re.compile(r"^(\d+)([smhd])$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


class BatchError(Exception):
    """A request the batch tier refuses: ``status`` and an OpenAI error ``code`` (the routes render it)."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.code, self.param = status, code, param


@dataclass(frozen=True)
class Limits:
    max_file_bytes: int = 100 << 20  # an upload's size
    max_lines: int = 50_000  # lines in one batch's input file
    max_queued_lines: int = 100_000  # a tenant's lines not yet finished, over all its active batches
    max_window_seconds: int = 7 * 86400
    default_output_expiry: int = 30 * 86400  # an output or error file's life unless the batch asks otherwise
    default_input_expiry: int = 30 * 86400  # an uploaded file's life unless the upload asks otherwise (OpenAI's)
    max_tenant_bytes: int = 10 << 30  # what one tenant's files may hold together


def window_seconds(window: str) -> int:
    """"24h", "30m", "90s", "2d" -> seconds (ValueError otherwise)."""
    match = _WINDOW.match(window.strip()) if isinstance(window, str) else None
    if match is None or int(match.group(1)) <= 0:
        raise ValueError(f"completion_window must be a duration such as '24h', got {window!r}")
    return int(match.group(1)) * _UNITS[match.group(2)]


def line_id(batch_id: str, index: int) -> str:
    """A line's id: its output line's ``id``, its response's ``request_id`` and its ledger record's."""
    return f"batch_req_{batch_id.removeprefix('batch_')}_{index}"


def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


def parse_lines(content: bytes, endpoint: str, max_lines: int) -> tuple[list[tuple[str, str]], list[dict[str, Any]]]:
    """An input file's lines as (custom_id, body JSON), and the errors found (OpenAI's batch error objects, with
    the 1-based line number): not UTF-8 JSON objects, a custom_id missing or repeated, a method other than POST, a
    url other than the batch's endpoint, a body that is not an object or asks to stream."""
    lines: list[tuple[str, str]] = []
    errors: list[dict[str, Any]] = []
    seen: set[str] = set()

    def bad(number: int, code: str, message: str, param: str | None = None) -> None:
        if len(errors) < MAX_ERRORS:
            errors.append({"code": code, "message": message, "param": param, "line": number})

    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as e:
        return [], [{"code": "invalid_json_line", "message": f"the file is not UTF-8 (byte {e.start})",
                     "param": None, "line": None}]
    number = 0
    for number, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            line = json.loads(raw)
        except json.JSONDecodeError as e:
            bad(number, "invalid_json_line", f"line {number} is not valid JSON: {e.msg}")
            continue
        if not isinstance(line, dict):
            bad(number, "invalid_json_line", f"line {number} is not a JSON object")
            continue
        custom_id = line.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            bad(number, "missing_required_parameter", "custom_id is required (a non-empty string)", "custom_id")
            continue
        if custom_id in seen:
            bad(number, "duplicate_custom_id", f"custom_id {custom_id!r} is not unique in the file", "custom_id")
            continue
        seen.add(custom_id)
        if line.get("method", "POST") != "POST":
            bad(number, "invalid_method", f"method must be POST, got {line.get('method')!r}", "method")
            continue
        if line.get("url") != endpoint:
            bad(number, "invalid_url", f"url must be the batch's endpoint {endpoint}, got {line.get('url')!r}", "url")
            continue
        body = line.get("body")
        if not isinstance(body, dict):
            bad(number, "invalid_request", "body must be a JSON object", "body")
            continue
        if body.get("stream"):
            bad(number, "invalid_request", "stream is not supported in a batch", "body.stream")
            continue
        lines.append((custom_id, json.dumps(body, separators=(",", ":"))))
    if not lines and not errors:
        errors.append({"code": "empty_file", "message": "the input file has no requests", "param": None,
                       "line": None})
    if len(lines) > max_lines:
        errors.append({"code": "too_many_lines", "message": f"the input file has {len(lines)} requests; a batch "
                       f"takes at most {max_lines}", "param": None, "line": None})
    return lines, errors


def file_object(row: tuple) -> dict[str, Any]:
    file_id, purpose, filename, size, created_at, expires_at = row
    return {"id": file_id, "object": "file", "bytes": size, "created_at": created_at, "filename": filename,
            "purpose": purpose, "status": "processed", "expires_at": expires_at, "status_details": None}


def page(items: list[dict[str, Any]], limit: int, after: str | None) -> dict[str, Any]:
    if not 1 <= limit <= 10000:
        raise BatchError(400, "limit must be between 1 and 10000", None, "limit")
    if after is not None:
        ids = [item["id"] for item in items]
        items = items[ids.index(after) + 1:] if after in ids else []
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}
