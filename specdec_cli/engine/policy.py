"""Draft-length policies: how far to draft in the next step.

A policy sees each step's outcome (drafted, accepted, and the seconds spent drafting and verifying)
and answers `next_k()`. k = 0 means plain target decoding for that step. Its `rule` (a `DraftRule`, or
None to leave the drafter as it was built) says how far a drafter goes within k: the decoder hands it
to the drafter (`Drafter.obey`), so the policy is the one owner of "how far to draft"."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from specdec_cli.engine.draft import DraftRule


class DraftLengthPolicy(Protocol):
    rule: DraftRule | None

    def next_k(self) -> int: ...

    def update(self, drafted: int, accepted: int, draft_seconds: float | None, verify_seconds: float | None) -> None:
        """Seconds are None for a step whose timing is not representative (it prefilled a prompt)."""

    def reset(self) -> None: ...


@dataclass
class FixedK:
    k: int
    rule: DraftRule | None = None

    def next_k(self) -> int:
        return self.k

    def update(self, drafted: int, accepted: int, draft_seconds: float | None, verify_seconds: float | None) -> None:
        pass

    def reset(self) -> None:
        pass


@dataclass
class AdaptiveK:
    """Grow after a fully accepted step, shrink after a rejection, within [min_k, max_k]
    (the heuristic of HF's assisted generation, with its +2 / -1 steps)."""

    start: int = 4
    min_k: int = 1
    max_k: int = 12
    grow: int = 2
    shrink: int = 1
    rule: DraftRule | None = None

    def __post_init__(self) -> None:
        self.k = self.start

    def next_k(self) -> int:
        return self.k

    def update(self, drafted: int, accepted: int, draft_seconds: float | None, verify_seconds: float | None) -> None:
        if drafted == 0:
            return
        if accepted == drafted:
            self.k = min(self.max_k, self.k + self.grow)
        else:
            self.k = max(self.min_k, self.k - self.shrink)

    def reset(self) -> None:
        self.k = self.start


def expected_tokens(alpha: float, gamma: float) -> float:
    """Expected tokens per step when each draft token is accepted with probability alpha, until the
    first rejection, plus the target's own token: (1 - alpha^(gamma+1)) / (1 - alpha)."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


class CostModelK:
    """Choose k to maximise expected tokens per second from what this sequence has shown so far.

    - acceptance by draft position: a_i = P(draft token i accepted | tokens 1..i-1 accepted), from
      decayed counts with a prior. Acceptance is bursty — a draft that got the first tokens right
      tends to get the next ones right too — so a_i usually rises with i, and a single i.i.d. rate
      would choose drafts that are too short. Positions never tried take the deepest known rate.
      Expected tokens for k: 1 + sum_{i<=k} prod_{j<=i} a_j.
    - cost of one draft token, and verify cost as a line in k (intercept + slope), from measured
      seconds, decayed likewise.
    k = 0 (plain decoding) wins when drafting does not pay. Every `probe_every`-th step drafts two
    tokens past the best k (at least `probe_k`), so deeper positions stay measured and drafting
    resumes when the text becomes predictable again."""

    def __init__(self, max_k: int = 10, prior_alpha: float = 0.6, prior_weight: float = 2.0,
                 decay: float = 0.97, probe_every: int = 8, probe_k: int = 3, rule: DraftRule | None = None) -> None:
        self.rule = rule
        self.max_k, self.prior_alpha, self.prior_weight = max_k, prior_alpha, prior_weight
        self.decay, self.probe_every, self.probe_k = decay, probe_every, probe_k
        self.reset()

    def reset(self) -> None:
        self.reached = [0.0] * self.max_k   # decayed count of steps that drafted position i+1 with 1..i accepted
        self.kept = [0.0] * self.max_k      # ... and in which position i+1 was accepted too
        self.draft_cost = _Mean()    # seconds per drafted token
        self.verify = _Line()        # verify seconds as intercept + slope * k
        self.steps_since_probe = 0
        self.k = self.probe_k

    def acceptance_by_position(self) -> list[float]:
        # Each position's prior is the rate of the position before it: rarely tried positions
        # follow the deepest well-measured one instead of falling back to a fixed guess.
        rates, previous = [], self.prior_alpha
        for reached, kept in zip(self.reached, self.kept):
            previous = min((kept + previous * self.prior_weight) / (reached + self.prior_weight), 0.999)
            rates.append(previous)
        return rates

    def next_k(self) -> int:
        return self.k

    def update(self, drafted: int, accepted: int, draft_seconds: float | None, verify_seconds: float | None) -> None:
        if drafted:
            for position in range(self.max_k):
                self.reached[position] *= self.decay
                self.kept[position] *= self.decay
            for position in range(min(accepted + 1, drafted, self.max_k)):
                self.reached[position] += 1.0
                self.kept[position] += 1.0 if position < accepted else 0.0
            if draft_seconds is not None:
                self.draft_cost.add(draft_seconds / drafted, self.decay)
        if verify_seconds is not None:
            self.verify.add(drafted, verify_seconds, self.decay)
        self.k = self._choose()

    def _choose(self) -> int:
        if not self.draft_cost.known or not self.verify.known:
            return self.probe_k
        best = max(range(self.max_k + 1), key=self.tokens_per_second)
        self.steps_since_probe += 1
        if self.steps_since_probe >= self.probe_every:
            # Explore: positions past the chosen k are otherwise never measured again.
            self.steps_since_probe = 0
            return min(self.max_k, max(best + 2, self.probe_k))
        return best

    def expected_tokens(self, k: int) -> float:
        total, survive = 1.0, 1.0
        for rate in self.acceptance_by_position()[:k]:
            survive *= rate
            total += survive
        return total

    def tokens_per_second(self, k: int) -> float:
        seconds = k * self.draft_cost.value + self.verify.at(k)
        return self.expected_tokens(k) / max(seconds, 1e-9)


class DraftOrNot(CostModelK):
    """The cost model's yes or no: draft up to `max_k` when some k > 0 pays — the policy's `rule` (the
    draft model's odds cut) then stops the draft where the draft's own per-token odds say — else decode
    with the target alone (probing as CostModelK does). Per-token odds know more than per-position
    averages, so this leaves "how far" to them and keeps only "whether"."""

    def __init__(self, max_k: int = 20, **kwargs) -> None:
        super().__init__(max_k=max_k, **kwargs)

    def _choose(self) -> int:
        return self.max_k if super()._choose() else 0


class _Mean:
    """An exponentially decayed mean."""

    def __init__(self) -> None:
        self.total = self.weight = 0.0

    @property
    def known(self) -> bool:
        return self.weight > 0

    @property
    def value(self) -> float:
        return self.total / self.weight

    def add(self, value: float, decay: float) -> None:
        self.total = decay * self.total + value
        self.weight = decay * self.weight + 1.0


class _Line:
    """y = intercept + slope * x by decayed least squares; slope 0 until two x values were seen,
    and never negative (verifying more tokens never costs less)."""

    def __init__(self) -> None:
        self.n = self.sx = self.sy = self.sxx = self.sxy = 0.0

    @property
    def known(self) -> bool:
        return self.n > 0

    def add(self, x: float, y: float, decay: float) -> None:
        self.n = decay * self.n + 1.0
        self.sx = decay * self.sx + x
        self.sy = decay * self.sy + y
        self.sxx = decay * self.sxx + x * x
        self.sxy = decay * self.sxy + x * y

    def at(self, x: float) -> float:
        mean_x, mean_y = self.sx / self.n, self.sy / self.n
        spread = self.sxx / self.n - mean_x * mean_x
        slope = max(0.0, (self.sxy / self.n - mean_x * mean_y) / spread) if spread > 1e-9 else 0.0
        return mean_y + slope * (x - mean_x)
