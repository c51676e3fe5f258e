"""OpenAI's Files and Batch endpoints on the gateway: the official ``openai`` client's ``files.create``,
``files.retrieve``, ``files.list``, ``files.delete``, ``files.content``, ``batches.create``, ``batches.retrieve``,
``batches.list`` and ``batches.cancel`` work unchanged. Everything a tenant stores is visible only to that tenant;
the state lives in the ledger's database (tokenfleet.batch.store), so every gateway opening the same file sees
the same files and batches. A gateway started with ``--batch-tier off`` (or ``--ledger none``) has no batch tier
and says so (404, with where the fleet serves it)."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from tokenfleet.services.gateway.http_body import json_body, peer, read_body
from tokenfleet.services.gateway.pipeline import Gateway

from tokenfleet.api.openai_schema import APIError
from tokenfleet.batch.formats import BatchError
from tokenfleet.batch.store import BatchStore
from tokenfleet.tenancy.admission import Caller

MULTIPART_OVERHEAD = 64 << 10  # the form's boundaries and other fields, over the file's own limit


def add_batch_routes(app: FastAPI, gateway: Gateway, store: BatchStore | None, batch_url: str = "") -> None:
    """``store`` None: this gateway does not serve the batch tier (``--batch-tier off`` or ``--ledger none``); the
    endpoints answer 404 naming ``batch_url``, the gateway that does (a fleet whose gateways do not share one
    database pins the batch tier to one gateway: deploy/kubernetes/gateway-batch.yaml)."""
    where = f" This fleet serves it at {batch_url}." if batch_url else ""

    def caller(request: Request) -> tuple[Caller, BatchStore]:
        who = gateway.admission.authenticate(request.headers.get("authorization"), peer(request))
        if store is None:
            raise APIError(404, f"The batch tier (files and batches) is not served by this gateway.{where}",
                           code="batch_tier_off")
        return who, store

    async def call(fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return await asyncio.to_thread(fn, *args, **kwargs)
        except BatchError as e:
            raise APIError(e.status, str(e), "invalid_request_error", e.param, e.code) from e

    async def answer(request: Request, method: Any, *args: Any) -> JSONResponse:
        """``method`` of the store (e.g. ``BatchStore.file``) for the caller's tenant, as JSON."""
        who, batches = caller(request)
        return JSONResponse(await call(method, batches, who.tenant.name, *args))

    @app.post("/v1/files")
    async def upload(request: Request) -> JSONResponse:
        who, files = caller(request)
        limit = files.limits.max_file_bytes
        request._body = await read_body(request, limit + MULTIPART_OVERHEAD)  # starlette's form() reads it from here
        try:
            form = await request.form()
        except Exception as e:  # python-multipart's parse errors, a body that is not a form
            raise APIError(400, f"the body is not a multipart form: {e}") from e
        try:
            upload, purpose = form.get("file"), form.get("purpose")
            if upload is None or isinstance(upload, str):
                raise APIError(400, "file is required (a multipart file field)", param="file")
            if not isinstance(purpose, str) or not purpose:
                raise APIError(400, "purpose is required", param="purpose")
            expires_after = _expiry(form.get("expires_after[anchor]"), form.get("expires_after[seconds]"),
                                    "created_at")
            content = await upload.read()
        finally:
            await form.close()  # its spooled temporary files
        del request._body
        return JSONResponse(await call(files.add_file, who.tenant.name, purpose, upload.filename or "upload.jsonl",
                                       content, expires_after))

    @app.get("/v1/files")
    async def list_files(request: Request, purpose: str | None = None, limit: int = 10000, after: str | None = None,
                         order: str = "desc") -> JSONResponse:
        return await answer(request, BatchStore.files, purpose, limit, after, order)

    @app.get("/v1/files/{file_id}")
    async def retrieve_file(request: Request, file_id: str) -> JSONResponse:
        return await answer(request, BatchStore.file, file_id)

    @app.delete("/v1/files/{file_id}")
    async def delete_file(request: Request, file_id: str) -> JSONResponse:
        return await answer(request, BatchStore.delete_file, file_id)

    @app.get("/v1/files/{file_id}/content")
    async def file_content(request: Request, file_id: str) -> Response:
        who, files = caller(request)
        return Response(await call(files.file_content, who.tenant.name, file_id), media_type="application/octet-stream")

    @app.post("/v1/batches")
    async def create_batch(request: Request) -> JSONResponse:
        who, batches = caller(request)
        body = await json_body(request, 1 << 20)
        for name in ("input_file_id", "endpoint", "completion_window"):
            if not isinstance(body.get(name), str) or not body[name]:
                raise APIError(400, f"{name} is required (a string)", param=name)
        output = body.get("output_expires_after")
        expires = _expiry(output.get("anchor"), output.get("seconds"), "created_at") if isinstance(output, dict) else None
        return JSONResponse(await call(batches.create, who.tenant.name, who.key_id, body["input_file_id"],
                                       body["endpoint"], body["completion_window"], body.get("metadata"), expires))

    @app.get("/v1/batches")
    async def list_batches(request: Request, limit: int = 20, after: str | None = None) -> JSONResponse:
        return await answer(request, BatchStore.batches, limit, after)

    @app.get("/v1/batches/{batch_id}")
    async def retrieve_batch(request: Request, batch_id: str) -> JSONResponse:
        return await answer(request, BatchStore.batch, batch_id)

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(request: Request, batch_id: str) -> JSONResponse:
        return await answer(request, BatchStore.cancel, batch_id)


def _expiry(anchor: Any, seconds: Any, expected_anchor: str) -> int | None:
    """``expires_after``'s seconds (None when not given); 400 for a bad anchor or a life outside 1 h..30 days
    (OpenAI's bounds)."""
    if anchor is None and seconds is None:
        return None
    if anchor != expected_anchor:
        raise APIError(400, f"expires_after.anchor must be {expected_anchor!r}", param="expires_after.anchor")
    try:
        value = int(seconds)
    except (TypeError, ValueError):
        raise APIError(400, "expires_after.seconds must be an integer", param="expires_after.seconds") from None
    if not 3600 <= value <= 30 * 86400:
        raise APIError(400, "expires_after.seconds must be between 3600 and 2592000", param="expires_after.seconds")
    return value
