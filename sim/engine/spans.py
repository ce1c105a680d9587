"""A span of simulated time on one rank's stream: what Chrome traces and plots draw."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Span:
    rank: int
    stream: str  # compute | comm
    name: str
    start: float
    end: float
    args: dict = field(default_factory=dict)


__all__ = ["Span"]
