"""Shared factories and fixtures."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

# Triton kernels (models.triton_attention) run in Triton's interpreter where there is no GPU; the variable is
# read when a kernel is defined, at import.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tokenfleet.engine.block_manager import BlockManager
from tokenfleet.engine.request import Request
from tokenfleet.engine.sampling_params import SamplingParams
from tokenfleet.engine.scheduler import Scheduler, SchedulerConfig

# Hypothesis profiles of the kernel property tests (tests/unit/models/test_kernel_properties.py), chosen with
# TOKENFLEET_KERNEL_PROFILE: "kernels" (the default suite: a fixed seed, a few dozen examples a test) or
# "kernels-long" (manual runs: a thousand fresh random examples a test).
_KERNEL_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
                      print_blob=True)
settings.register_profile("kernels", derandomize=True, max_examples=40, **_KERNEL_COMMON)
settings.register_profile("kernels-long", max_examples=1000, **_KERNEL_COMMON)

_ids = itertools.count()


def make_request(
    num_prompt_tokens: int = 10,
    max_tokens: int = 8,
    priority: int = 0,
    arrival_time: float | None = None,
    prompt_token_ids: list[int] | None = None,
    request_id: str | None = None,
    eos_token_ids: tuple[int, ...] = (),
    **params: object,
) -> Request:
    n = next(_ids)
    prompt = prompt_token_ids if prompt_token_ids is not None else [100 + (n * 7 + i) % 500 for i in range(num_prompt_tokens)]
    return Request(
        request_id=request_id or f"r{n}",
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0, **params),  # type: ignore[arg-type]
        arrival_time=float(n) if arrival_time is None else arrival_time,
        priority=priority,
        max_tokens=max_tokens,
        eos_token_ids=eos_token_ids,
    )


def make_scheduler(num_blocks: int = 64, block_size: int = 4, **config: object) -> Scheduler:
    return Scheduler(SchedulerConfig(**config), BlockManager(num_blocks, block_size), hash_salt="test")  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from tokenfleet.models.gguf_import import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session", autouse=True)
def internal_certs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Every service a test starts runs on the default, secure internal plane: a CA and role
    certificates for the session, found through TOKENFLEET_CERTS (never the user's own folder)."""
    from tokenfleet.security import certs

    folder = tmp_path_factory.mktemp("certs")
    certs.ensure(folder)
    previous = os.environ.get("TOKENFLEET_CERTS")
    os.environ["TOKENFLEET_CERTS"] = str(folder)
    yield folder
    if previous is None:
        os.environ.pop("TOKENFLEET_CERTS", None)
    else:
        os.environ["TOKENFLEET_CERTS"] = previous
