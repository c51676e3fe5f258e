"""The request's cache_salt field (prefix-cache isolation within a tenant): accepted, bounded."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tokenfleet.api.openai_schema import MAX_CACHE_SALT, ChatCompletionRequest


def test_cache_salt_is_accepted_and_bounded():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert ChatCompletionRequest.model_validate({**body, "cache_salt": "user-1"}).cache_salt == "user-1"
    assert ChatCompletionRequest.model_validate(body).cache_salt is None
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({**body, "cache_salt": "x" * (MAX_CACHE_SALT + 1)})
