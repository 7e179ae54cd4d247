"""What speculation keeps of each running request, apart from the request itself: the draft service's view of it,
its drafts' record, and the target features a draft head reads."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from scheduler.speculation.acceptance import RequestAcceptance
from scheduler.speculation.features import FeatureStore
from scheduler.speculation.views import DraftView


@dataclass
class SpecState:
    draft: DraftView = field(default_factory=DraftView)  # what the draft service holds of it
    acceptance: RequestAcceptance = field(default_factory=RequestAcceptance)  # its drafts' record
    features: FeatureStore = field(default_factory=FeatureStore)  # while a draft reads target features


class SpecStates:
    """SpecState by request id: made when a request first meets speculation, dropped when it finishes."""

    def __init__(self) -> None:
        self._states: dict[str, SpecState] = {}

    def of(self, request_id: str) -> SpecState:
        state = self._states.get(request_id)
        if state is None:
            state = self._states[request_id] = SpecState()
        return state

    def drop(self, request_id: str) -> SpecState | None:
        return self._states.pop(request_id, None)

    def __iter__(self) -> Iterator[SpecState]:
        return iter(self._states.values())

    def __len__(self) -> int:
        return len(self._states)
