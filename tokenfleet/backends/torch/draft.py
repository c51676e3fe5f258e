"""A draft model for speculative decoding: a smaller model with the target's tokenizer, in the same worker, that
proposes each verification's tokens.

Its KV cache has its own tensors but the target's block tables: a draft position lives in the same block and
slot as the target's, so the scheduler's allocation covers both and nothing else needs managing. The draft's KV
is computed lazily, only for requests that speculate: each verification entry first runs the draft over the
positions it has not seen yet (the whole prompt the first time, one or two tokens afterwards), which yields the
first proposal, then one token at a time for the rest. After verification its KV is valid up to the last
accepted proposal. A preempted request (its blocks were freed) starts over.

Proposals are the draft's argmax for greedy requests, and drawn from its filtered distribution (the request's
temperature, top_k, top_p, min_p) for sampled ones, which the verifier then needs (``Sampler.verify``'s
``draft_probs``) for exact rejection sampling.
"""

from __future__ import annotations

import copy
import dataclasses
import secrets
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from tokenfleet.backends.torch.sampler import filtered_probs_batch, inverse_cdf
from tokenfleet.engine.request import Request
from tokenfleet.engine.scheduler import ScheduledRequest
from tokenfleet.engine.spec_decode import SpecConfig
from tokenfleet.models.llama import KVCache, LlamaModel, LlamaWeights


class _Tokens:
    """A request seen with ``extra`` tokens after its own (what one draft pass feeds the draft model)."""

    __slots__ = ("tokens", "sampling_params", "num_prompt_tokens", "prompt_logprobs")

    def __init__(self, request: Request, extra: Sequence[int]):
        self.tokens = request.all_token_ids + list(extra)
        # no exact top logits, no prompt logprobs: the runner's batch builder reads only these
        self.sampling_params = dataclasses.replace(request.sampling_params, temperature=1.0, logprobs=None,
                                                   prompt_logprobs=None, guided=None)
        self.num_prompt_tokens = request.num_prompt_tokens
        self.prompt_logprobs: list = []

    def token_ids_range(self, start: int, end: int) -> list[int]:
        return self.tokens[start:end]


class DraftModel:
    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int,
                 build_batch: Callable[..., tuple[torch.Tensor, Any, Any]]):
        if len(model.config.kv_groups) != 1:
            raise ValueError("a draft model with sliding-window layers is not supported")
        self.model = model
        self.kv = KVCache(model.config, num_blocks, block_size, model.dtype, model.device)
        self.build_batch = build_batch  # the target runner's (same block size and tables)
        self._valid: dict[str, tuple[int, int]] = {}  # request -> (its preemptions then, positions with draft KV)
        self._generator = torch.Generator().manual_seed(secrets.randbits(63))

    def release(self, request_id: str) -> None:
        self._valid.pop(request_id, None)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        self.kv.copy_blocks(pairs)

    def propose(self, entries: Sequence[ScheduledRequest], requests: Mapping[str, Request]
                ) -> dict[str, tuple[list[int], torch.Tensor | None]]:
        """For each verification entry (``draft``: placeholders, as many as it may verify): its proposals and, for
        sampled requests, the draft distribution each was drawn from ([k, vocab])."""
        out: dict[str, tuple[list[int], list[torch.Tensor]]] = {s.request_id: ([], []) for s in entries}
        depth = max(len(s.draft) for s in entries)
        for j in range(depth):
            live = [s for s in entries if j < len(s.draft)]
            steps = []
            for s in live:
                request, drafted = requests[s.request_id], out[s.request_id][0]
                end = s.start + 1 + j  # positions before it have (or get, in this pass) draft KV
                first = self._first(s.request_id, request) if j == 0 else end - 1
                steps.append((s, first, end, drafted))
            logits = self._forward(steps, requests)
            tokens, probs = self._choose(logits, [requests[s.request_id] for s, *_ in steps])
            for (s, _, _, drafted), token, prob in zip(steps, tokens, probs):
                drafted.append(token)
                if prob is not None:
                    out[s.request_id][1].append(prob)
        for s in entries:
            request = requests[s.request_id]
            self._valid[s.request_id] = (request.num_preemptions, s.start + len(s.draft))  # through the last fed
        return {rid: (tokens, torch.stack(qs) if qs else None) for rid, (tokens, qs) in out.items()}

    def accepted(self, entry: ScheduledRequest, request: Request, num_accepted: int) -> None:
        """After verification: draft KV is valid through the last accepted proposal."""
        valid = entry.start + 1 + min(num_accepted, len(entry.draft) - 1)
        self._valid[entry.request_id] = (request.num_preemptions, valid)

    def _first(self, request_id: str, request: Request) -> int:
        preemptions, valid = self._valid.get(request_id, (request.num_preemptions, 0))
        return valid if preemptions == request.num_preemptions else 0

    def _forward(self, steps: list[tuple[ScheduledRequest, int, int, list[int]]], requests: Mapping[str, Request]
                 ) -> torch.Tensor:
        """One draft forward over each step's positions first .. end - 1; logits of each one's last position."""
        entries, views = [], {}
        order = sorted(range(len(steps)), key=lambda i: steps[i][2] - steps[i][1] != 1)  # single tokens first
        for i in order:
            s, first, end, drafted = steps[i]
            entries.append(dataclasses.replace(s, start=first, num_new_tokens=end - first, samples=True, forks=(),
                                               draft=()))
            views[s.request_id] = _Tokens(requests[s.request_id], drafted)
        token_ids, batch, _ = self.build_batch(entries, views)
        logits = self.model.forward(token_ids, batch, self.kv)
        back = torch.empty(len(order), dtype=torch.long)
        back[torch.tensor(order)] = torch.arange(len(order))
        return logits[back.to(logits.device)]

    def _choose(self, logits: torch.Tensor, requests: Sequence[Request]) -> tuple[list[int], list[torch.Tensor | None]]:
        tokens = logits.argmax(dim=-1).tolist()
        probs: list[torch.Tensor | None] = [None] * len(requests)
        sampled = [i for i, r in enumerate(requests) if not r.sampling_params.is_greedy]
        if sampled:
            index = torch.tensor(sampled, device=logits.device)
            p = filtered_probs_batch(logits.index_select(0, index), [requests[i].sampling_params for i in sampled])
            draws = inverse_cdf(p, torch.rand(len(sampled), generator=self._generator).to(p.device, p.dtype)).tolist()
            for row, i in enumerate(sampled):
                tokens[i] = draws[row]
                probs[i] = p[row]
        return tokens, probs


def load_draft_model(config: SpecConfig, target: LlamaModel) -> LlamaModel:
    """The draft model ``config.draft_model`` names (an HF folder; "self": the target's own weights), truncated to
    its first ``config.draft_layers`` layers when set. Its vocabulary must be the target's."""
    from tokenfleet.models.loader import load_model

    if config.draft_model == "self":
        model = target
    else:
        loaded = load_model(config.draft_model, target.dtype, target.device)
        if not isinstance(loaded, LlamaModel):
            raise ValueError("the draft model must be a Llama-architecture model")
        model = loaded
    if model.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"the draft model's vocabulary ({model.config.vocab_size}) is not the target's "
                         f"({target.config.vocab_size})")
    if len(model.config.kv_groups) != 1:
        raise ValueError("a draft model with sliding-window layers is not supported")
    if config.draft_layers:
        if not 1 <= config.draft_layers <= model.config.num_layers:
            raise ValueError(f"draft_layers must be in [1, {model.config.num_layers}], got {config.draft_layers}")
        trimmed = copy.copy(model)  # shares every tensor; only the layer list and the config differ
        trimmed.config = dataclasses.replace(model.config, num_layers=config.draft_layers)
        w = model.weights
        trimmed.weights = LlamaWeights(w.embed, w.layers[: config.draft_layers], w.norm, w.lm_head, w.lm_head_rows)
        model = trimmed
    return model
