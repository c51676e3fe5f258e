"""The native temperature-sampling kernel (csrc/sampling.c, built with -march=native) checked where it is built,
before the sampler uses it (as models.kernel_check does for the model's kernels).

Known answers: for rows of random logits (a partial last 256-token chunk, masked tokens, four temperatures), each
uniform is put at the middle of one likely token's share (at least half the top one's) of the torch path's
cumulative distribution, so the torch inverse-CDF draw and any correct kernel pick exactly that token; a single
other token fails the check.
"""

from __future__ import annotations

import functools
import time

import structlog
import torch

from tokenfleet.backends.torch.sampling_ops import NativeTemperatureSampler, filtered_probs_batch
from tokenfleet.engine.runner import KernelCheck
from tokenfleet.engine.sampling_params import SamplingParams

log = structlog.get_logger(__name__)


@functools.cache
def checked_native_sampler() -> tuple[NativeTemperatureSampler | None, tuple[KernelCheck, ...]]:
    """The native kernel (None: none could be built, or it failed its check) and its check, once per process."""
    draw = NativeTemperatureSampler.load()
    if draw is None:
        return None, ()
    check = check_temperature_sampler(draw)
    return (draw if check.passed else None), (check,)


TOLERANCE = "the very token the torch inverse-CDF draw picks, for uniforms at the middle of a token's mass"


def check_temperature_sampler(draw: NativeTemperatureSampler) -> KernelCheck:
    start = time.perf_counter()
    g = torch.Generator().manual_seed(7)
    mismatches, detail = 0, ""
    try:
        for vocab in (3 * 256 + 100, 2048):
            rows = 16
            logits = torch.randn(rows, vocab, generator=g) * 3
            logits[::5, ::3] = float("-inf")
            params = [SamplingParams(max_tokens=1, temperature=t) for t in (0.3, 0.7, 1.0, 1.6) * (rows // 4)]
            probs = filtered_probs_batch(logits.clone(), params).double()
            cdf = probs.cumsum(-1) / probs.sum(-1, keepdim=True)
            # a token per row with at least half the top token's mass: far above fp32 rounding of the sums
            picks = torch.multinomial((probs >= probs.amax(-1, keepdim=True) / 2).float(), 1, generator=g).squeeze(1)
            below = torch.where(picks > 0, cdf.gather(1, (picks - 1).clamp(min=0)[:, None]).squeeze(1), 0.0)
            uniforms = ((below + cdf.gather(1, picks[:, None]).squeeze(1)) / 2).float()
            got = draw(logits, params, uniforms)
            wrong = (got != picks).nonzero().flatten().tolist()
            mismatches += len(wrong)
            if wrong and not detail:
                r = wrong[0]
                detail = (f"vocab {vocab}, row {r} (temperature {params[r].temperature}): drew token {int(got[r])}, "
                          f"the reference {int(picks[r])}")
    except Exception as e:  # noqa: BLE001 - a kernel that fails to run here is a failed check
        detail = f"raised {e!r}"
    name = "native temperature sampler (csrc/sampling.c)"
    check = KernelCheck("temperature_sampling", name, not detail, float(mismatches), TOLERANCE,
                        time.perf_counter() - start, detail, name if not detail else "torch sampler")
    if check.passed:
        log.info("kernel_check", kernel=check.kernel, implementation=check.implementation, result="passed",
                 seconds=round(check.seconds, 3))
    else:
        log.error("kernel_check_failed", kernel=check.kernel, implementation=check.implementation, case=detail,
                  fallback="torch reference", note="this kernel draws wrong tokens on this machine")
    return check
