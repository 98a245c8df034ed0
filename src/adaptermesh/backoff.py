"""Exponential backoff, with jitter, for every retry loop: the agent's reconnects and the
control plane's failed rebalance steps."""

from __future__ import annotations

import random

__all__ = ["Backoff"]


class Backoff:
    """Delays grow ``initial * multiplier**n`` up to ``maximum``; each is drawn uniformly from
    ``[delay * (1 - jitter), delay]`` so that many agents restarting together do not reconnect
    in lockstep (a thundering herd on a control plane that just came back).
    """

    def __init__(
        self,
        initial: float = 0.2,
        maximum: float = 10.0,
        multiplier: float = 2.0,
        jitter: float = 0.5,
        rng: random.Random | None = None,
    ) -> None:
        if initial <= 0 or maximum < initial:
            raise ValueError("backoff: need 0 < initial <= maximum")
        if multiplier < 1 or not 0 <= jitter <= 1:
            raise ValueError("backoff: need multiplier >= 1 and 0 <= jitter <= 1")
        self.initial = initial
        self.maximum = maximum
        self.multiplier = multiplier
        self.jitter = jitter
        self._rng = rng or random.Random()
        self._attempt = 0

    @property
    def attempt(self) -> int:
        return self._attempt

    def next(self) -> float:
        ceiling = min(self.maximum, self.initial * self.multiplier**self._attempt)
        if ceiling < self.maximum:  # at the cap the exponent stops (no float overflow)
            self._attempt += 1
        return ceiling * (1.0 - self.jitter * self._rng.random())

    def reset(self) -> None:
        self._attempt = 0
