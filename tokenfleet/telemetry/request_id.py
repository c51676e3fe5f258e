"""One request id per client request, carried across every hop in gRPC metadata.

The gateway takes the client's ``X-Request-Id`` when it is well formed (else makes one), returns it
in the response header, and sends it as ``x-request-id`` metadata on Pick and Generate; every gRPC
handler binds it into structlog's context, so the gateway's, router's and worker's log lines for
one request share ``request_id``.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Sequence

HEADER = "x-request-id"
_VALID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


def new_request_id(client_value: str | None = None) -> str:
    if client_value and _VALID.match(client_value):
        return client_value
    return uuid.uuid4().hex


def metadata(request_id: str) -> tuple[tuple[str, str], ...]:
    return ((HEADER, request_id),)


def from_metadata(items: Sequence[tuple[str, str | bytes]] | None) -> str | None:
    for key, value in items or ():
        if key == HEADER and isinstance(value, str) and _VALID.match(value):
            return value
    return None
