"""One check's outcome: pass/fail, counts for the report, and what went wrong."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CheckResult:
    name: str
    passed: bool = True
    counts: dict[str, int | float] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    skipped: str = ""  # why the check did not run (never counted as passed)

    def fail(self, message: str) -> None:
        self.passed = False
        if len(self.failures) < 20:
            self.failures.append(message)

    def expect(self, condition: bool, message: str) -> None:
        if not condition:
            self.fail(message)

    def as_dict(self) -> dict:
        status = "skipped" if self.skipped else ("passed" if self.passed else "failed")
        return {
            "name": self.name,
            "status": status,
            "counts": self.counts,
            "failures": self.failures,
            "skipped": self.skipped,
        }
