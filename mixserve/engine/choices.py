"""n > 1: several choices of one request that share its prompt.

Choice 0 runs under the request's own id. Choices 1..n-1 (internal ids `<id>#<i>`) join only once
choice 0 has sampled its first token: by then every full block of the prompt is computed and held by
choice 0, so with prefix caching on (the default) they find those blocks in the cache and compute only
the prompt's last, partial block — the prompt is prefilled once, the choices fork after it, and nothing
writes into a shared block. With caching off they are correct too, each computing the prompt again.

Choice i samples with seed + i (as vLLM), so the choices differ and a rerun repeats them. Every update
leaves under the request's own id with its choice `index`; `request_done` turns true with the last choice.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from mixserve.engine.outputs import RequestOutput, RequestUpdate
from mixserve.engine.sampling_params import SamplingParams

SEPARATOR = "#"


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """The params of one choice: n = 1, and seed + index when seeded."""
    seed = None if params.seed is None else (params.seed + index) % 2**63
    return dataclasses.replace(params, n=1, seed=seed)


@dataclass
class _Fanout:
    """One request with n > 1: what its later choices need, and which choices are still open."""

    prompt: list[int]
    params: SamplingParams
    arrival: float | None
    joined: bool = False
    open: set[int] = field(default_factory=set)
    outputs: dict[int, RequestOutput] = field(default_factory=dict)


class Choices:
    """The engine's record of every request with n > 1 (an empty dict costs nothing otherwise)."""

    def __init__(self) -> None:
        self._fanouts: dict[str, _Fanout] = {}
        self._parent: dict[str, tuple[str, int]] = {}  # internal id -> (request id, choice index)

    def add(self, request_id: str, prompt: list[int], params: SamplingParams,
            arrival: float | None) -> SamplingParams:
        """Register a request; returns the params its choice 0 runs with."""
        if params.n > 1:
            self._fanouts[request_id] = _Fanout(list(prompt), params, arrival, open=set(range(params.n)))
        return choice_params(params, 0) if params.n > 1 else params

    def after_step(self, engine: Any, updates: list[RequestUpdate]) -> list[RequestUpdate]:
        """Map the step's updates to their requests, and let later choices join after choice 0's first
        token (`engine.add_request`)."""
        if not self._fanouts:
            return updates
        out = [self._relabel(u) for u in updates]
        stepped = {u.request_id for u in out}
        for request_id, fan in self._fanouts.items():
            if not fan.joined and request_id in stepped:
                fan.joined = True
                for i in range(1, fan.params.n):
                    child = f"{request_id}{SEPARATOR}{i}"
                    self._parent[child] = (request_id, i)
                    engine.add_request(child, fan.prompt, choice_params(fan.params, i), arrival=fan.arrival)
        for u in out:
            if u.request_done and u.request_id in self._fanouts:
                del self._fanouts[u.request_id]
        return out

    def is_later_choice(self, internal_id: str) -> bool:
        """A choice 1..n-1 of some request (it shares the prompt its choice 0 counts)."""
        return internal_id in self._parent

    def abort(self, request_id: str) -> list[str]:
        """Forget a request; returns the internal ids of its later choices (to abort in the engine)."""
        fan = self._fanouts.pop(request_id, None)
        if fan is None:
            return []
        children = [c for c, (parent, _) in self._parent.items() if parent == request_id]
        for child in children:
            del self._parent[child]
        return children

    def _relabel(self, update: RequestUpdate) -> RequestUpdate:
        request_id, index = self._parent.get(update.request_id, (update.request_id, 0))
        fan = self._fanouts.get(request_id)
        if fan is None:
            return update
        if update.finished:
            fan.open.discard(index)
            fan.outputs[index] = dataclasses.replace(update.output, request_id=request_id, index=index)
            self._parent.pop(update.request_id, None)
        done = not fan.open
        output = None
        if done:  # the request's output is choice 0's, carrying the others
            ordered = [fan.outputs[i] for i in range(fan.params.n)]
            output = dataclasses.replace(ordered[0], other_choices=tuple(ordered[1:]))
        return dataclasses.replace(update, request_id=request_id, index=index, request_done=done,
                                   output=output)
