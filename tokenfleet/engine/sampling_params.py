"""Per-request sampling parameters, validated at construction (before anything is scheduled)."""

from __future__ import annotations

from dataclasses import dataclass

from tokenfleet.engine.grammar import Guided

_GREEDY_EPS = 1e-5
MAX_N = 16  # samples per request (they share the prompt's KV blocks)


@dataclass(frozen=True)
class SamplingParams:
    """What to sample and when to stop.

    temperature 0 means greedy. ``max_tokens=None`` means "up to the model's context".
    ``stop`` strings are matched on detokenized text and never appear in the output;
    ``stop_token_ids`` end the request like EOS does (and are not detokenized into the text).
    ``logprobs`` is the number of top alternatives to return per token (0 = only the sampled
    token's logprob, None = no logprobs); values are the log-softmax of the raw logits, before
    temperature and penalties.
    ``n`` samples share the prompt's KV blocks (forked, copy-on-write) and are told apart by index.
    ``logit_bias`` (token id, bias in [-100, 100]) is added to the logits after penalties;
    ``guided`` constrains the output to a grammar (token masks after the bias).
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    n: int = 1
    prompt_logprobs: int | None = None  # like logprobs, for the prompt's tokens (echo); disables prefix-cache hits
    logit_bias: tuple[tuple[int, float], ...] = ()
    guided: Guided | None = None
    speculative: bool = True  # False: never speculate for this request (where the engine speculates)

    def __post_init__(self) -> None:
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        elif isinstance(stop, (list, tuple)):
            if not all(isinstance(s, str) for s in stop):
                raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
            stop = tuple(stop)
        else:
            raise ValueError(f"stop must be a string or a list of strings, got {type(stop).__name__}")
        if any(s == "" for s in stop):
            raise ValueError("stop strings must not be empty")
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in bias)))
        self._validate()

    def output_limit(self, max_model_len: int, num_prompt_tokens: int) -> int:
        """How many tokens the request may generate (per sample): ``max_tokens``, capped by what the
        model's context leaves after the prompt. The one place this is computed (engine, TensorRT-LLM
        adapter, gateway budgets and resumes); <= 0 means the prompt alone fills the context."""
        room = max_model_len - num_prompt_tokens
        return room if self.max_tokens is None else min(self.max_tokens, room)

    def _validate(self) -> None:
        if self.max_tokens is not None and (
            isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens <= 0
        ):
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not self.temperature >= 0:  # also rejects NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if not self.repetition_penalty > 0:  # also rejects NaN
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.seed is not None and (isinstance(self.seed, bool) or not 0 <= self.seed < 2**64):
            raise ValueError(f"seed must be an integer in [0, 2**64), got {self.seed!r}")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        for token_id, bias in self.logit_bias:
            if token_id < 0 or not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias entries must map token ids >= 0 to values in [-100, 100], "
                                 f"got {token_id}: {bias}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise ValueError(f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def temperature_only(self) -> bool:
        """A random draw with no top_k, top_p or min_p filter: the whole softmax at the temperature."""
        return not self.is_greedy and self.top_k <= 0 and self.top_p >= 1.0 and self.min_p <= 0.0

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)
