"""Engine metrics as plain counters and gauges; services export them (Prometheus) later."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from tokenfleet.engine.request import Request

# Seconds a prefill rate is trusted to refuse a prompt that has nothing queued ahead of it (see predicted_wait).
PREFILL_RATE_FRESH_S = 10.0
# A step's fixed cost (launching every layer, sampling, Python) dwarfs a few prompt tokens' compute: a 4-token
# prefill in 60 ms says "66 tokens/s" of an engine that prefills 1,300, and would refuse every long prompt.
# Smaller prefill steps do not move the rate.
MIN_RATE_SAMPLE_TOKENS = 128


@dataclass
class EngineStats:
    # counters
    num_steps: int = 0
    num_scheduled_tokens: int = 0
    num_finished: int = 0
    num_aborted: int = 0
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_prefix_hit_tokens: int = 0
    num_preemptions: int = 0
    num_prompt_tokens_computed: int = 0  # prompt tokens run through the model here (not cached, not remote)
    num_remote_prefills: int = 0  # requests whose prompt KV came from a prefill replica
    num_remote_fallbacks: int = 0  # of those, recomputed here after the transfer failed
    num_kv_blocks_received: int = 0
    num_kv_bytes_received: int = 0
    num_kv_blocks_sent: int = 0
    num_transfer_timeouts: int = 0  # held blocks released because the decode side never finished
    num_forks: int = 0  # n > 1: samples forked from their request once its prompt was computed
    num_fork_shared_blocks: int = 0  # blocks those forks share with their request instead of copying
    num_block_copies: int = 0  # partially filled shared blocks copied on write
    num_peer_blocks_received: int = 0  # peer fetch: blocks another replica sent instead of a recompute here
    num_peer_blocks_served: int = 0  # blocks this replica sent to peers
    num_peer_fetch_failures: int = 0  # peer fetches that failed or timed out (the blocks were recomputed)
    total_step_seconds: float = 0.0
    model_flops: float = 0.0  # the steps' model FLOPs and bytes read (the runner's step_cost estimate; MFU/MBU)
    model_bytes: float = 0.0
    # speculative decoding (engine.spec_decode): proposed and accepted tokens, verifications (a request's
    # proposals verified in one step), and decode-only steps' time with and without verifications
    num_spec_proposed_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    num_spec_verifications: int = 0
    num_spec_steps: int = 0
    spec_step_seconds: float = 0.0
    num_plain_decode_steps: int = 0
    plain_decode_step_seconds: float = 0.0
    # overlapped scheduling (CoreParts.overlap): steps queued behind the one running, and their rows for
    # requests that ended with the step before (a stop token the host had not read yet): computed, discarded
    num_overlapped_steps: int = 0
    num_overlap_discarded_rows: int = 0
    # retention (engine.retention, engine.prefetch): conversations released early and expired, retained blocks
    # the pool evicted under pressure (all of them) and of those the ones offered to the second tier, blocks
    # prefetched back from it and prefetched blocks a request then took
    num_retention_releases: int = 0
    num_retention_expiries: int = 0
    num_retained_evicted: int = 0
    num_retained_demoted: int = 0
    num_prefetched_blocks: int = 0
    num_prefetch_hits: int = 0
    # gauges (filled by snapshot)
    num_running: int = 0
    num_waiting: int = 0
    num_blocks_used: int = 0
    num_blocks_free: int = 0
    last_step_seconds: float = 0.0
    num_queued_prompt_tokens: int = 0  # prompt tokens waiting to be computed
    prefill_tokens_per_s: float = 0.0  # recent rate of steps that prefilled (EMA)
    prefill_rate_at: float = 0.0  # time.monotonic() of prefill_tokens_per_s's last sample
    # the second KV tier (engine.kv_tier; zeros without one): counters, then gauges
    tier_hit_blocks: int = 0  # restored into the pool instead of recomputed
    tier_stored_blocks: int = 0
    tier_dropped_blocks: int = 0
    tier_evicted_blocks: int = 0
    tier_corrupt_blocks: int = 0
    tier_bytes_written: int = 0
    tier_bytes_read: int = 0
    tier_restore_seconds: float = 0.0
    tier_bytes_used: int = 0
    tier_entries: int = 0
    # retention gauges: distinct blocks retained (pool or tier), those idle in the pool, bytes retained per tenant
    num_retained_blocks: int = 0
    num_retained_idle_blocks: int = 0
    retained_bytes_per_tenant: dict[str, int] = field(default_factory=dict)

    @property
    def mean_step_seconds(self) -> float:
        return self.total_step_seconds / self.num_steps if self.num_steps else 0.0

    @property
    def spec_acceptance_rate(self) -> float:
        return self.num_spec_accepted_tokens / self.num_spec_proposed_tokens if self.num_spec_proposed_tokens else 0.0

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens a verification yields on average (accepted proposals + the target's own token)."""
        return 1 + self.num_spec_accepted_tokens / self.num_spec_verifications if self.num_spec_verifications else 0.0

    def record_step(self, seconds: float, num_tokens: int) -> None:
        self.num_steps += 1
        self.num_scheduled_tokens += num_tokens
        self.total_step_seconds += seconds
        self.last_step_seconds = seconds

    def record_prefill_rate(self, tokens: int, seconds: float, alpha: float = 0.2, now: float | None = None) -> None:
        if seconds > 0 and tokens >= MIN_RATE_SAMPLE_TOKENS:
            rate = tokens / seconds
            self.prefill_tokens_per_s = rate if not self.prefill_tokens_per_s else (
                alpha * rate + (1 - alpha) * self.prefill_tokens_per_s)
            self.prefill_rate_at = time.monotonic() if now is None else now

    def forget_prefill_rate(self) -> None:
        """Unknown again, e.g. after the warm-up: its step built the kernels, and a rate measured while they
        compiled (seconds for a few tokens) would predict minutes for every real prompt."""
        self.prefill_tokens_per_s = 0.0
        self.prefill_rate_at = 0.0

    def predicted_wait(self, prompt_tokens: int, now: float | None = None,
                       fresh_for: float = PREFILL_RATE_FRESH_S) -> float:
        """Seconds before a new prompt's prefill would be done, at the recent rate. 0 when unknown, and when
        nothing is queued ahead of the prompt and the rate is older than ``fresh_for`` seconds: only prefills
        update the rate, so one measured while the GPU was shared or a kernel compiled would otherwise refuse
        every prompt for good; an idle replica serves one to find out (a queue drains by itself first)."""
        if not self.prefill_tokens_per_s:
            return 0.0
        now = time.monotonic() if now is None else now
        if not self.num_queued_prompt_tokens and now - self.prefill_rate_at > fresh_for:
            return 0.0
        return (self.num_queued_prompt_tokens + prompt_tokens) / self.prefill_tokens_per_s

    def record_finished(self, request: Request) -> None:
        self.num_finished += 1
        self.num_prompt_tokens += request.num_prompt_tokens
        self.num_generated_tokens += len(request.output_token_ids)
        self.num_prefix_hit_tokens += request.num_cached_tokens

    def snapshot(self, **gauges: object) -> EngineStats:
        return dataclasses.replace(self, **gauges)  # type: ignore[arg-type]


class StepTimer:
    """Context manager measuring the model-execution time of a step."""

    def __init__(self) -> None:
        self.last = 0.0
        self._start = 0.0

    def __enter__(self) -> StepTimer:
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.last = time.perf_counter() - self._start
