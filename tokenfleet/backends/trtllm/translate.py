"""Our types <-> TensorRT-LLM's: sampling params (a fresh object per request: the library mutates
it), finish reasons, DisaggregatedParams on the wire, iteration stats and KV events. The API
module is passed in (``spec.load_api()`` or a test double), never imported here."""

from __future__ import annotations

import base64
import dataclasses
import json
from collections.abc import Iterable, Mapping
from typing import Any

from tokenfleet.engine.output import TokenLogprobs
from tokenfleet.engine.request import FinishReason
from tokenfleet.engine.sampling_params import SamplingParams
from tokenfleet.kvcache.block_hash import hash_block, root_hash

FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "cancelled": FinishReason.ABORT,
          "timeout": FinishReason.ABORT}
# 'not_finished' (a context_only request on the TRT backend) is not an end: the decode side continues.


def sampling(api: Any, p: SamplingParams, max_tokens: int, *, context_only: bool = False,
             guided_backend: str | None = None, vocab_size: int = 0) -> Any:
    """A new ``api.SamplingParams`` for one request. ``max_tokens`` is always set (the library's
    default is 32); 1 for a context_only (prefill) request, which the TRT backend does not force.
    Greedy is ``top_k=1`` with no temperature/top_p (the library's documented greedy rule)."""
    kwargs: dict[str, Any] = {
        "max_tokens": 1 if context_only else max_tokens,
        "n": 1 if context_only else p.n,
        "stop": list(p.stop) or None,
        "stop_token_ids": list(p.stop_token_ids) or None,
        "include_stop_str_in_output": p.include_stop_str_in_output,
        "ignore_eos": p.ignore_eos,
        "min_tokens": min(p.min_tokens, 1) if context_only else p.min_tokens,
        "skip_special_tokens": p.skip_special_tokens,
        "seed": p.seed,
    }
    if p.is_greedy:
        kwargs["top_k"] = 1
    else:
        kwargs.update(temperature=p.temperature, top_p=p.top_p if p.top_p < 1.0 else None,
                      top_k=p.top_k if p.top_k > 0 else None, min_p=p.min_p or None)
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(p, name):
            kwargs[name] = getattr(p, name)
    if p.repetition_penalty != 1.0:
        kwargs["repetition_penalty"] = p.repetition_penalty
    if p.logprobs is not None:
        kwargs["logprobs"] = p.logprobs
    if p.prompt_logprobs is not None:
        kwargs["prompt_logprobs"] = p.prompt_logprobs
    if p.guided is not None:
        kwargs["guided_decoding"] = guided(api, p.guided.kind, p.guided.spec, guided_backend)
    if p.logit_bias:
        kwargs["embedding_bias"] = _embedding_bias(p.logit_bias, vocab_size)
    return api.SamplingParams(**{k: v for k, v in kwargs.items() if v is not None})


def guided(api: Any, kind: str, spec: str, backend: str | None) -> Any:
    if backend is None:
        raise ValueError("guided decoding is off on this worker (no guided_decoding_backend)")
    if kind == "json_object":
        return api.GuidedDecodingParams(json_object=True)
    if kind == "json_schema":
        return api.GuidedDecodingParams(json=json.loads(spec))
    if kind == "regex":
        return api.GuidedDecodingParams(regex=spec)
    if backend != "llguidance":  # our Lark dialect (tool calls embed JSON schemas) is llguidance's
        raise ValueError(f"grammar ({kind}) needs the llguidance guided decoding backend; this worker uses {backend}")
    return api.GuidedDecodingParams(grammar=spec)


def _embedding_bias(bias: Iterable[tuple[int, float]], vocab_size: int) -> Any:
    import torch  # the TensorRT-LLM image has it; only requests with logit_bias get here

    if vocab_size <= 0:
        raise ValueError("logit_bias needs the model's vocabulary size")
    values = torch.zeros(vocab_size, dtype=torch.float32)
    for token_id, value in bias:
        if token_id >= vocab_size:
            raise ValueError(f"logit_bias token id {token_id} is outside the vocabulary ({vocab_size})")
        values[token_id] = value
    return values


def finish_reason(value: str | None) -> FinishReason | None:
    if value is None or value == "not_finished":
        return None
    if value not in FINISH:  # a newer release's reason: end the sample rather than fail the worker
        return FinishReason.ABORT
    return FINISH[value]


def token_logprobs(entries: Any, token_ids: list[int]) -> list[TokenLogprobs]:
    """``CompletionOutput.logprobs_diff`` (per token: {token id: Logprob(logprob, rank)} or a float)."""
    out = []
    for token_id, entry in zip(token_ids, entries or []):
        if isinstance(entry, Mapping):
            top = sorted(((int(t), float(lp.logprob)) for t, lp in entry.items()), key=lambda x: -x[1])
            chosen = entry.get(token_id)
            logprob = float(chosen.logprob) if chosen is not None else top[0][1]
            rank = int(getattr(chosen, "rank", 0) or 0) or 1 + sum(v > logprob for _, v in top)
            out.append(TokenLogprobs(token_id, logprob, rank, tuple((t, v) for t, v in top if t != token_id)))
        else:
            out.append(TokenLogprobs(token_id, float(entry), 0, ()))
    return out


def prompt_logprobs(entries: Any, prompt: list[int]) -> list[TokenLogprobs]:
    """``CompletionOutput.prompt_logprobs`` -> ours for prompt tokens 1.. (the first has none; a
    leading None entry, when the library sends one, is dropped)."""
    values = [e for e in entries or [] if e is not None]
    if not values:
        return []
    return token_logprobs(values, prompt[len(prompt) - len(values):])


# ---- DisaggregatedParams on the wire ---------------------------------------------------------------
def encode_disagg(params: Any) -> bytes:
    """Every field the installed version defines (bytes base64, tensors and tuples as lists), as JSON."""
    fields = {f.name: _jsonable(getattr(params, f.name)) for f in dataclasses.fields(params)}
    return json.dumps({"tokenfleet_disagg": 1, "fields": fields}).encode()


def decode_disagg(api: Any, payload: bytes, request_type: str = "generation_only") -> Any:
    """The hand-off back into the installed DisaggregatedParams, with ``request_type`` set.
    ValueError for a payload that is not ours."""
    try:
        body = json.loads(payload)
        fields = body["fields"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"not a TensorRT-LLM hand-off: {e}") from e
    known = {f.name for f in dataclasses.fields(api.DisaggregatedParams)}
    values = {k: _unjson(v) for k, v in fields.items() if k in known and v is not None}
    values["request_type"] = request_type
    return api.DisaggregatedParams(**values)


def _jsonable(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray)):
        return {"__b64__": base64.b64encode(bytes(value)).decode()}
    if hasattr(value, "tolist"):  # tensors, arrays
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "value") and not isinstance(value, (int, float, str)):  # enums
        return value.value
    return value


def _unjson(value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {"__b64__"}:
        return base64.b64decode(value["__b64__"])
    return value


# ---- stats and KV events -----------------------------------------------------------------------------
def gauges(stat: Mapping[str, Any]) -> dict[str, Any]:
    """One iteration-stats dict -> our EngineStats gauges (keys that a release lacks are skipped)."""
    kv = stat.get("kvCacheStats") or {}
    batching = stat.get("inflightBatchingStats") or {}
    out: dict[str, Any] = {
        "num_running": int(stat.get("numActiveRequests", 0)),
        "num_waiting": int(stat.get("numQueuedRequests", 0)) + int(batching.get("numPausedRequests", 0)),
    }
    if "usedNumBlocks" in kv:
        out["num_blocks_used"] = int(kv["usedNumBlocks"])
    if "freeNumBlocks" in kv:
        out["num_blocks_free"] = int(kv["freeNumBlocks"])
    if "iterLatencyMS" in stat:
        out["last_step_seconds"] = float(stat["iterLatencyMS"]) / 1000
    return out


class BlockHashMirror:
    """The engine's prefix cache as *our* block hashes, from its KV events: a stored block's hash
    is ours chained on its parent's (TRT's hashes differ from ours, and the router hashes prompts
    our way with this worker's salt and block size)."""

    def __init__(self, hash_salt: str, block_size: int):
        self.block_size = block_size
        self._root = root_hash(hash_salt)
        self._ours: dict[int, bytes] = {}  # engine block hash -> our hash
        self.version = 0

    @property
    def hashes(self) -> frozenset[bytes]:
        return frozenset(self._ours.values())

    def apply(self, event: Mapping[str, Any]) -> None:
        data = event.get("data", event)
        kind = data.get("type")
        if kind == "stored":
            parent = data.get("parent_hash")
            chain = self._root if parent is None else self._ours.get(int(parent))
            for block in data.get("blocks", []):
                tokens = [t["token_id"] if isinstance(t, Mapping) else int(t) for t in block.get("tokens", [])]
                if chain is None or len(tokens) != self.block_size:
                    chain = None  # a parent we never saw, or a partial block: not routable
                    continue
                chain = hash_block(chain, tokens)
                self._ours[int(block["block_hash"])] = chain
                self.version += 1
        elif kind == "removed":
            for h in data.get("block_hashes", []):
                if self._ours.pop(int(h), None) is not None:
                    self.version += 1
        elif kind == "cleared" or kind == "all_blocks_cleared":
            self._ours.clear()
            self.version += 1
