"""Whether a batched step drafts at all, judged by this run's own clock: the proof that drafting pays.

The batch policy (batch_policy.py) prices each row's k on forward-cost curves: a model of the machine, measured
once by `specdec calibrate` or assumed. A model can be wrong where it matters most — a batch of 8 rows whose
draft forwards, packed verifies and Python between them cost more than the curves say drafted at ×0.66 of the
target alone on one CPU — so the gate checks the model's answer against the run's own wall time. For each
occupancy (the number of live rows, which is what a step's cost follows), it keeps tokens per second of steps
that drafted and of steps that did not, decayed so the figures follow the text and the growing context, and
lets a step draft only where drafting has measured at least as fast as the target alone.

Evidence comes from probes: a fresh occupancy drafts for `first_probe` steps and then takes `probe_steps` steps
without drafting; after that, every so many steps of the current choice, `probe_steps` steps of the other one,
measured afresh (what that choice measured before may be stale: the text or the context changed since) and judged
against the recent steps of the current choice. A probe that confirms the choice waits longer before the next one:
twice the last wait (from `probe_every`), and at least long enough that the probe's measured loss (its seconds
minus what its tokens cost at the current choice's rate) stays within `probe_share` of the time between probes —
so where drafting is many times slower, it is re-checked rarely — up to `longest_wait` steps. A probe that
overturns the choice starts the waits again. A drafting step right after steps without drafting also feeds the
draft model every token it skipped (its catch-up): that price of switching is paid, and counted in a probe's loss,
but such a step does not count as the rate of drafting. A choice flips only on a clear margin (`margin`, a share of
the current choice's rate) once both sides hold `min_steps` (decayed) steps.

The gate reads token counts and seconds only; which rows it may hold back is the decoder's business (a seeded
sampled row never follows it: its draws depend on its drafts, and the same seed must give the same record)."""

from __future__ import annotations

from dataclasses import dataclass

DRAFT, PLAIN = "draft", "plain"


@dataclass
class _Rate:
    """Decayed tokens and seconds of one choice's steps at one occupancy."""

    tokens: float = 0.0
    seconds: float = 0.0
    steps: float = 0.0

    def add(self, tokens: int, seconds: float, decay: float) -> None:
        self.tokens = self.tokens * decay + tokens
        self.seconds = self.seconds * decay + seconds
        self.steps = self.steps * decay + 1.0

    @property
    def per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class _Occupancy:
    """What the gate knows and decided for steps of one number of live rows."""

    choice: str = DRAFT
    wait: int = 0          # steps of `choice` before the next probe
    last_wait: int = 0     # the wait set after the last probe (doubles while the choice is confirmed)
    probing: int = 0       # steps of the other choice still to take in the current probe
    probe_tokens: int = 0  # what the current probe's steps committed, and their seconds (the switch included)
    probe_seconds: float = 0.0
    drafted_last: bool = False  # the last step at this occupancy drafted (the draft model has seen its rows)
    why: str | None = None  # while it does not draft: the measurement that stopped it

    def __post_init__(self) -> None:
        self.rates = {DRAFT: _Rate(), PLAIN: _Rate()}


class DraftingGate:
    """Lets a step draft where drafting has measured faster than not drafting, at this step's occupancy."""

    def __init__(self, probe_every: int = 6, probe_steps: int = 2, first_probe: int = 3, longest_wait: int = 2000,
                 probe_share: float = 0.02, margin: float = 0.03, min_steps: float = 1.0, decay: float = 0.85) -> None:
        self.probe_every, self.probe_steps, self.first_probe = probe_every, probe_steps, first_probe
        self.longest_wait, self.probe_share = longest_wait, probe_share
        self.margin, self.min_steps, self.decay = margin, min_steps, decay
        self._occupancies: dict[int, _Occupancy] = {}

    def drafts(self, rows: int) -> bool:
        """Whether a step of `rows` live rows may draft."""
        state = self._state(rows)
        if state.probing:
            return state.choice != DRAFT
        return state.choice == DRAFT

    def record(self, rows: int, drafted: bool, tokens: int, seconds: float) -> None:
        """One step's outcome: `rows` live rows, whether any drafted, the tokens all rows committed and its seconds."""
        state = self._state(rows)
        switching = drafted and not state.drafted_last
        state.drafted_last = drafted
        if not switching and seconds > 0:
            state.rates[DRAFT if drafted else PLAIN].add(tokens, seconds, self.decay)
        if state.probing:
            state.probe_tokens, state.probe_seconds = state.probe_tokens + tokens, state.probe_seconds + seconds
            state.probing -= 1
            if not state.probing:
                self._judge(rows, state)
            return
        state.wait -= 1
        if state.wait <= 0:  # the other choice's turn to be measured, afresh: what it measured before is stale
            state.probing = self.probe_steps + (state.choice == PLAIN)  # a drafting probe's first step switches
            state.probe_tokens, state.probe_seconds = 0, 0.0
            state.rates[PLAIN if state.choice == DRAFT else DRAFT] = _Rate()

    def reason(self, rows: int) -> str | None:
        """Why steps of `rows` rows do not draft (None while they do): the two rates the gate measured."""
        state = self._occupancies.get(rows)
        return None if state is None or state.choice == DRAFT else state.why

    def _state(self, rows: int) -> _Occupancy:
        """The occupancy's state; a new one starts from the choice of the nearest one judged (fewer rows than a
        batch that did not pay drafting are likelier not to pay either than to pay), else drafting."""
        if rows not in self._occupancies:
            nearest = min(self._occupancies, key=lambda known: (abs(known - rows), known), default=None)
            choice = self._occupancies[nearest].choice if nearest is not None else DRAFT
            why = self._occupancies[nearest].why if nearest is not None else None
            self._occupancies[rows] = _Occupancy(choice=choice, wait=self.first_probe, last_wait=self.probe_every // 2,
                                                 why=why)
        return self._occupancies[rows]

    def _judge(self, rows: int, state: _Occupancy) -> None:
        """After a probe: flip the choice (and probe again soon), or keep it and wait longer (`_confirmed_wait`)."""
        current, other = state.rates[state.choice], state.rates[PLAIN if state.choice == DRAFT else DRAFT]
        known = current.steps >= self.min_steps and other.steps >= self.min_steps
        if known and other.per_second > current.per_second * (1.0 + self.margin):
            state.choice = PLAIN if state.choice == DRAFT else DRAFT
            draft, plain = state.rates[DRAFT].per_second, state.rates[PLAIN].per_second
            state.why = (f"drafting did not pay at batch {rows}: {draft:.1f} vs {plain:.1f} tok/s measured"
                         if state.choice == PLAIN else None)
            state.last_wait = self.probe_every
        elif known:
            state.last_wait = self._confirmed_wait(state, current)
        else:
            state.last_wait = self.probe_every
        state.wait = state.last_wait

    def _confirmed_wait(self, state: _Occupancy, current: _Rate) -> int:
        """Twice the last wait, and at least enough steps of the current choice that the probe's loss (its seconds
        less what its tokens take at the current rate) is `probe_share` of them; at most `longest_wait`."""
        loss = state.probe_seconds - state.probe_tokens / max(current.per_second, 1e-9)
        step_seconds = current.seconds / max(current.steps, 1e-9)
        covering = loss / (self.probe_share * step_seconds) if step_seconds > 0 else 0.0
        return int(min(max(state.last_wait * 2, covering, self.probe_every), self.longest_wait))
