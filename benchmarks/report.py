"""Result records of a workload, text tables and the checks against the issue's targets."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

MiB = 2**20


@dataclass
class Table:
    title: str
    columns: list[str]
    rows: list[list[Any]]
    notes: list[str] = field(default_factory=list)

    def format(self) -> str:
        cells = [[_cell(v) for v in row] for row in self.rows]
        widths = [len(c) for c in self.columns]
        for row in cells:
            widths = [max(w, len(c)) for w, c in zip(widths, row)]

        def line(values: list[str]) -> str:
            first, *rest = values
            return "  ".join(
                [first.ljust(widths[0])] + [v.rjust(w) for v, w in zip(rest, widths[1:])]
            ).rstrip()

        out = [self.title, line(self.columns), line(["-" * w for w in widths])]
        out += [line(row) for row in cells]
        out += [f"  {n}" for n in self.notes]
        return "\n".join(out)


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


@dataclass
class Check:
    """One target of the issue, evaluated on measured numbers."""

    name: str
    kind: str
    """"bytes", "flops", "gradients" or "time". Quick mode asserts all but times
    (it never times anything)."""
    measured: str
    met: bool
    known_miss: str | None = None
    """Why this target does not hold by construction; quick mode then requires the
    miss to persist (so a change that fixes it is noticed and the note removed)."""

    def status(self) -> str:
        if self.known_miss is None:
            return "met" if self.met else "MISSED"
        return "UNEXPECTEDLY MET" if self.met else "missed (known)"

    def format(self) -> str:
        text = f"[{self.status()}] {self.name}: {self.measured}"
        if self.known_miss is not None:
            text += f"\n      why: {self.known_miss}"
        return text

    def ok(self) -> bool:
        """True when the outcome is the expected one."""
        return self.met == (self.known_miss is None)


@dataclass
class WorkloadResult:
    name: str
    title: str
    config: dict[str, Any]
    tables: list[Table] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    skipped: str | None = None
    seconds: float = 0.0
    load_average: tuple[float, float] = (0.0, 0.0)
    """1-minute load average of the machine before and after the workload."""

    def format(self) -> str:
        before, after = self.load_average
        head = (
            f"== {self.name}: {self.title} ({self.seconds:.1f} s, load average "
            f"{before:.1f} -> {after:.1f})"
        )
        if self.skipped:
            return f"{head}\nSKIPPED: {self.skipped}"
        parts = [head, "config: " + ", ".join(f"{k}={v}" for k, v in self.config.items())]
        parts += [t.format() for t in self.tables]
        if self.checks:
            parts.append("targets:\n" + "\n".join("  " + c.format() for c in self.checks))
        return "\n\n".join(parts)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def within(a: float, b: float, rel: float) -> bool:
    return abs(a - b) <= rel * abs(b)
