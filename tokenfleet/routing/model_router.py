"""Model routing: send each request to the cheapest model expected to answer it as well as the big one.

A routing alias in the registry (``aliases/<alias>`` with a ``route``; ``tokenfleet models route``) names a
small and a big model and a classifier. For each request the gateway computes cheap features it already has
(prompt size, the last user message's task markers, tool use, a requested JSON format, the tenant's tier,
the requested output length), the classifier gives the probability that the small model's answer agrees with
the big model's, and at or above the policy's threshold the request goes to the small model. Without
features (a plain ``resolve``) the alias means its big model.

The classifier is a logistic regression trained offline (``benchmarks/model_router.py``) on prompts labelled
mechanically: easy when the two models' greedy answers agree by ``answers_agree``. Pure Python, no numpy at
serving time: a dot product of ~20 features per request.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

TIERS = ("interactive", "batch")  # the tenant record's tiers (tokenfleet.tenancy.tenants)
MARKERS = {  # feature name -> words of the last user message that mark the task
    "code": ("code", "python", "function", "program", "script", "sql", "javascript", "regex", "bug"),
    "translate": ("translate", "translation", "french", "spanish", "german", "italian"),
    "explain": ("explain", "why", "how", "describe", "compare", "discuss"),
    "list": ("list", "name three", "give three", "enumerate"),
    "math": ("sum", "plus", "minus", "times", "multiply", "divide", "calculate", "+", "-", "*"),
    "fact": ("capital", "who", "when", "where", "which", "what is"),
    "complete": ("complete", "finish", "continue", "fill in"),
    "creative": ("story", "poem", "haiku", "imagine", "write a"),
    "json": ("json", "object with", "keys"),
}
FEATURES = ("bias_one", "log_chars", "log_words", "num_messages", "has_system", "question", "digits", "tools",
            "json_mode", "log_max_tokens", *(f"tier_{t}" for t in TIERS), *(f"marker_{m}" for m in MARKERS))


@dataclass(frozen=True)
class RouteInput:
    """What the gateway knows about a request before it is tokenized."""

    messages: Sequence[tuple[str, str]]  # (role, text), in order; a completion is one ("user", prompt)
    tools: bool = False
    json_mode: bool = False
    tier: str = "interactive"
    max_tokens: int = 0  # 0: not set


def features(request: RouteInput) -> dict[str, float]:
    texts = [text for _, text in request.messages]
    last_user = next((text for role, text in reversed(request.messages) if role == "user"), texts[-1] if texts else "")
    low = last_user.lower()
    chars = sum(len(t) for t in texts)
    words = sum(len(t.split()) for t in texts)
    out = {
        "bias_one": 1.0,
        "log_chars": math.log1p(chars),
        "log_words": math.log1p(words),
        "num_messages": float(len(texts)),
        "has_system": float(any(role == "system" for role, _ in request.messages)),
        "question": float("?" in last_user),
        "digits": min(sum(c.isdigit() for c in last_user), 20) / 20,
        "tools": float(request.tools),
        "json_mode": float(request.json_mode),
        "log_max_tokens": math.log1p(request.max_tokens),
    }
    for tier in TIERS:
        out[f"tier_{tier}"] = float(request.tier == tier)
    for name, words_ in MARKERS.items():
        out[f"marker_{name}"] = float(any(_has(low, w) for w in words_))
    return out


def _has(text: str, marker: str) -> bool:
    if marker.isalpha() or " " in marker:
        return re.search(rf"\b{re.escape(marker)}\b", text) is not None
    return marker in text


@dataclass
class Classifier:
    """P(the small model's answer agrees) = sigmoid(w . features)."""

    weights: dict[str, float] = field(default_factory=dict)
    # feature scaling learned with the weights (mean, std), so the raw features above go in as they are
    scale: dict[str, tuple[float, float]] = field(default_factory=dict)

    def probability(self, feats: dict[str, float]) -> float:
        z = 0.0
        for name, w in self.weights.items():
            mean, std = self.scale.get(name, (0.0, 1.0))
            z += w * ((feats.get(name, 0.0) - mean) / std if name != "bias_one" else 1.0)
        return 1.0 / (1.0 + math.exp(-max(min(z, 40.0), -40.0)))

    @classmethod
    def train(cls, rows: Sequence[dict[str, float]], labels: Sequence[bool], l2: float = 0.05, steps: int = 3000,
              rate: float = 0.3) -> Classifier:
        """Logistic regression by full-batch gradient descent on standardized features (L2 on all but the bias)."""
        if not rows or len(rows) != len(labels):
            raise ValueError("training needs as many labels as rows, and at least one")
        names = list(FEATURES)
        scale: dict[str, tuple[float, float]] = {}
        for name in names:
            values = [r.get(name, 0.0) for r in rows]
            mean = sum(values) / len(values)
            std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values)) or 1.0
            scale[name] = (mean, std)
        xs = [[1.0 if n == "bias_one" else (r.get(n, 0.0) - scale[n][0]) / scale[n][1] for n in names] for r in rows]
        ys = [1.0 if y else 0.0 for y in labels]
        w = [0.0] * len(names)
        n = len(xs)
        for _ in range(steps):
            grad = [0.0] * len(names)
            for x, y in zip(xs, ys):
                z = sum(wi * xi for wi, xi in zip(w, x))
                p = 1.0 / (1.0 + math.exp(-max(min(z, 40.0), -40.0)))
                for j, xj in enumerate(x):
                    grad[j] += (p - y) * xj
            for j, name in enumerate(names):
                reg = 0.0 if name == "bias_one" else l2 * w[j]
                w[j] -= rate * (grad[j] / n + reg)
        return cls(dict(zip(names, w)), scale)


@dataclass
class RoutePolicy:
    """A routing alias: ``small`` when the classifier's probability is >= ``threshold``, else ``big``."""

    small: str
    big: str
    classifier: Classifier
    threshold: float = 0.5

    def choose(self, request: RouteInput) -> tuple[str, float]:
        """(the model ref to serve, the classifier's probability that the small model agrees)."""
        p = self.classifier.probability(features(request))
        return (self.small if p >= self.threshold else self.big), p

    def to_json(self) -> str:
        return json.dumps({"small": self.small, "big": self.big, "threshold": self.threshold,
                           "weights": self.classifier.weights,
                           "scale": {k: list(v) for k, v in self.classifier.scale.items()}}, sort_keys=True)

    @classmethod
    def from_json(cls, raw: str | dict) -> RoutePolicy:
        data = json.loads(raw) if isinstance(raw, str) else raw
        try:
            weights = {str(k): float(v) for k, v in data["weights"].items()}
            scale = {str(k): (float(v[0]), float(v[1]) or 1.0) for k, v in data.get("scale", {}).items()}
            policy = cls(str(data["small"]), str(data["big"]), Classifier(weights, scale), float(data.get("threshold", 0.5)))
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise ValueError(f"a route policy needs small, big and weights (numbers by feature name): {e}") from e
        unknown = set(weights) - set(FEATURES)
        if unknown:
            raise ValueError(f"a route policy names unknown features: {sorted(unknown)}")
        if not 0.0 <= policy.threshold <= 1.0:
            raise ValueError(f"a route threshold is in [0, 1], got {policy.threshold}")
        return policy


WORD = re.compile(r"[a-z0-9]+")


def answers_agree(small: str, big: str, words: int = 16, min_overlap: float = 0.6) -> bool:
    """The committed agreement check: of the shorter answer's first ``words`` words (lowercase letters and digits),
    at least ``min_overlap`` also appear among the other answer's first ``words``. So "Oslo" agrees with "The capital
    of Norway is Oslo." and "42" with "20 + 22 = 42", while two explanations must share most of their opening. Two
    empty answers agree; one empty answer does not."""
    a, b = WORD.findall(small.lower())[:words], WORD.findall(big.lower())[:words]
    if not a or not b:
        return not a and not b
    shorter, longer = (a, b) if len(a) <= len(b) else (b, a)
    pool = list(longer)
    common = 0
    for token in shorter:
        if token in pool:
            pool.remove(token)
            common += 1
    return common / len(shorter) >= min_overlap
