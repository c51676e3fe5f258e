"""What tokens cost: GPU time at a price per GPU-hour, through each model's throughput.

A request's cost is the replica time its tokens take, at the model's configured throughput, times the replica's
GPUs and the price of a GPU-hour:

    seconds = (prompt tokens - cached prompt tokens) / prefill_tokens_per_s + output tokens / decode_tokens_per_s
    usd     = seconds * gpus * usd_per_gpu_hour / 3600

Cached prompt tokens cost nothing to compute (their KV was kept); the throughputs are one replica's aggregate at
its usual batch (`tokenfleet plan`, or a serving benchmark, gives them). The gateway charges every settled request
to ``tokenfleet_gateway_tenant_cost_usd_total{tenant,model}``; `tokenfleet usage` prints the same cost per row.

A pricing file (YAML or JSON; gateway ``--pricing``, `tokenfleet usage --pricing`, or ``$TOKENFLEET_PRICING``):

    usd_per_gpu_hour: 2.0
    default: {gpus: 1, prefill_tokens_per_s: 2000, decode_tokens_per_s: 500}
    models:
      llama-70b: {gpus: 8, prefill_tokens_per_s: 60000, decode_tokens_per_s: 6000}

Without one, ``Pricing()``'s defaults apply: $2 per GPU-hour (the simulator's default) and placeholder throughputs
that say nothing about any real deployment: set yours.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenfleet import envs


@dataclass(frozen=True)
class ModelPrice:
    gpus: float = 1.0  # GPUs one replica holds
    prefill_tokens_per_s: float = 2000.0  # one replica's prompt throughput
    decode_tokens_per_s: float = 500.0  # one replica's output throughput (all its streams together)

    def __post_init__(self) -> None:
        if self.gpus <= 0 or self.prefill_tokens_per_s <= 0 or self.decode_tokens_per_s <= 0:
            raise ValueError(f"a model's gpus and throughputs must be > 0, got {self}")


@dataclass(frozen=True)
class Pricing:
    usd_per_gpu_hour: float = 2.0
    default: ModelPrice = field(default_factory=ModelPrice)
    models: dict[str, ModelPrice] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.usd_per_gpu_hour < 0:
            raise ValueError(f"usd_per_gpu_hour must be >= 0, got {self.usd_per_gpu_hour}")

    def price(self, model: str) -> ModelPrice:
        """``model`` may be name@version: the name's entry then applies."""
        return self.models.get(model) or self.models.get(model.partition("@")[0]) or self.default

    def gpu_seconds(self, model: str, prompt_tokens: int, cached_tokens: int, output_tokens: int) -> float:
        p = self.price(model)
        computed = max(0, prompt_tokens - cached_tokens)
        return (computed / p.prefill_tokens_per_s + output_tokens / p.decode_tokens_per_s) * p.gpus

    def cost(self, model: str, prompt_tokens: int, cached_tokens: int, output_tokens: int) -> float:
        """US dollars for one request's tokens."""
        return self.gpu_seconds(model, prompt_tokens, cached_tokens, output_tokens) * self.usd_per_gpu_hour / 3600

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Pricing:
        unknown = set(data) - {"usd_per_gpu_hour", "default", "models"}
        if unknown:
            raise ValueError(f"unknown pricing keys: {', '.join(sorted(unknown))}")
        default = ModelPrice(**data.get("default", {}))
        models = {name: ModelPrice(**{**vars(default), **spec}) for name, spec in (data.get("models") or {}).items()}
        return cls(float(data.get("usd_per_gpu_hour", 2.0)), default, models)

    @classmethod
    def load(cls, path: str | Path | None = None) -> Pricing:
        """From ``path`` (YAML or JSON), else ``$TOKENFLEET_PRICING``, else the defaults."""
        path = path or envs.pricing_file()
        if not path:
            return cls()
        text = Path(path).read_text()
        if str(path).endswith(".json"):
            return cls.from_dict(json.loads(text))
        import yaml

        return cls.from_dict(yaml.safe_load(text) or {})
