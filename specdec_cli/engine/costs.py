"""What the draft-length policies learn from (policy.py, batch_policy.py): decayed means, a decayed line, the
acceptance by draft position, and what a verify of n tokens costs."""

from __future__ import annotations


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


class _Positions:
    """Acceptance by draft position from decayed counts: position i's rate is P(accepted | 1..i-1 were),
    each position's prior the rate of the position before it (rarely tried positions follow the deepest
    well-measured one instead of falling back to a fixed guess)."""

    def __init__(self, positions: int, prior_alpha: float, prior_weight: float) -> None:
        self.prior_alpha, self.prior_weight = prior_alpha, prior_weight
        self.reached = [0.0] * positions  # decayed count of steps that drafted position i+1 with 1..i accepted
        self.kept = [0.0] * positions     # ... and in which position i+1 was accepted too
        self._expected: list[float] | None = None  # expected_tokens(k) for every k, until the counts change

    def add(self, drafted: int, accepted: int, decay: float) -> None:
        self._expected = None
        for position in range(len(self.reached)):
            self.reached[position] *= decay
            self.kept[position] *= decay
        for position in range(min(accepted + 1, drafted, len(self.reached))):
            self.reached[position] += 1.0
            self.kept[position] += 1.0 if position < accepted else 0.0

    def rates(self) -> list[float]:
        rates, previous = [], self.prior_alpha
        for reached, kept in zip(self.reached, self.kept):
            previous = min((kept + previous * self.prior_weight) / (reached + self.prior_weight), 0.999)
            rates.append(previous)
        return rates

    def pooled(self, first: int = 0) -> float:
        """Accepted / reached over positions `first`+1 onwards together (decayed counts, with the prior)."""
        kept, reached = sum(self.kept[first:]), sum(self.reached[first:])
        return (kept + self.prior_alpha * self.prior_weight) / (reached + self.prior_weight)

    def expected_tokens(self, k: int) -> float:
        """1 + sum_{i<=k} prod_{j<=i} a_j: the drafts expected to survive plus the target's own token. Kept for
        every k until the counts change: a step's choice asks it many times (each k, each lookup length, the cut),
        each a pass over every position's rate in Python."""
        if self._expected is None:
            total, survive, self._expected = 1.0, 1.0, [1.0]
            for rate in self.rates():
                survive *= rate
                total += survive
                self._expected.append(total)
        return self._expected[min(max(k, 0), len(self._expected) - 1)]


class VerifyCost:
    """Seconds of a target forward of n new tokens (a verify of n - 1 drafts).

    With a prior curve ({n: seconds}, what `specdec calibrate` measured on this machine for this model and
    format): the curve's shape — piecewise linear between the measured n, the last segment's slope past
    them — times the decayed mean ratio of the run's own timings to it (a busier machine, a longer
    context). The curve is taken never falling (each n at least what a smaller n measured): more tokens never
    cost less, and a dip is the machine's noise, which would make drafting look free. Without a curve: a
    line through the run's timings (intercept + slope·n, never sloping down)."""

    def __init__(self, curve: dict[int, float] | None = None) -> None:
        self.points = []
        for n, seconds in sorted((int(n), float(s)) for n, s in (curve or {}).items()):
            self.points.append((n, max(seconds, self.points[-1][1]) if self.points else seconds))
        self.line = _Line()
        self.scale = _Mean()

    @property
    def known(self) -> bool:
        return bool(self.points) or self.line.known

    def add(self, n: int, seconds: float, decay: float) -> None:
        self.line.add(n, seconds, decay)
        if self.points:
            self.scale.add(seconds / max(self.prior(n), 1e-9), decay)

    def at(self, n: int) -> float:
        if not self.points:
            return self.line.at(n)
        return self.prior(n) * (self.scale.value if self.scale.known else 1.0)

    def prior(self, n: float) -> float:
        points = self.points
        if n <= points[0][0] or len(points) == 1:
            return points[0][1]
        for (n0, s0), (n1, s1) in zip(points, points[1:]):
            if n <= n1:
                return s0 + (s1 - s0) * (n - n0) / (n1 - n0)
        (n0, s0), (n1, s1) = points[-2], points[-1]
        return s1 + max(0.0, (s1 - s0) / (n1 - n0)) * (n - n1)
