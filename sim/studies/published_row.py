"""One published measurement beside its prediction (shared by the published-run studies)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: |error| targets per kind (issue 26): training and layer rows 10%, all-to-all rows 15%
TARGET = {"training": 0.10, "layer": 0.10, "a2a": 0.15}


@dataclass
class Row:
    id: str
    kind: str
    title: str
    metric: str
    measured: float
    predicted: float | None
    error: float | None  # predicted / measured - 1
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def within(self) -> bool | None:
        return None if self.error is None else abs(self.error) <= TARGET[self.kind]


__all__ = ["TARGET", "Row"]
