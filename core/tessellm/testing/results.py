"""Results of a conformance run: one CheckResult per check, and their table / JSON forms.

Invariant: a report passes only when at least one check passed and every other one was
skipped at the user's request (SKIP); a check that raised is a failure whose detail names the
exception (never a pass, never dropped).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Literal

Outcome = Literal["PASS", "FAIL", "SKIP"]


@dataclass(slots=True, frozen=True)
class CheckResult:
    check: str          # e.g. "allocator.accounting", "kernel:attention_decode/decode_native_paged"
    result: Outcome
    detail: str = ""

    @property
    def passed(self) -> bool:
        return self.result == "PASS"

    @property
    def failed(self) -> bool:
        return self.result == "FAIL"


@dataclass(slots=True)
class ConformanceReport:
    device: str
    results: list[CheckResult] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return any(r.passed for r in self.results) and not self.failed()

    def failed(self) -> list[CheckResult]:
        return [r for r in self.results if r.failed]

    def skipped(self) -> list[CheckResult]:
        return [r for r in self.results if r.result == "SKIP"]

    def result(self, check: str) -> CheckResult:
        """The result of the check called `check` (KeyError naming the known ones if none)."""
        for r in self.results:
            if r.check == check:
                return r
        raise KeyError(f"no check {check!r}; checks: {', '.join(r.check for r in self.results)}")

    def summary(self) -> str:
        n_fail, n_skip = len(self.failed()), len(self.skipped())
        verdict = "PASSED" if self.passed else "FAILED"
        skipped = f", {n_skip} skipped" if n_skip else ""
        return (f"device {self.device!r} conformance {verdict}: "
                f"{len(self.results) - n_fail - n_skip} passed, {n_fail} failed{skipped}")

    def to_json(self) -> str:
        return json.dumps({"device": self.device, "passed": self.passed,
                           "results": [asdict(r) for r in self.results]}, indent=2)

    def table(self) -> str:
        """Three aligned columns (check, result, detail); multi-line details are indented."""
        width = max([len("check")] + [len(r.check) for r in self.results])
        lines = [f"{'check':<{width}}  result  detail", f"{'-' * width}  ------  ------"]
        for r in self.results:
            detail = r.detail.replace("\n", "\n" + " " * (width + 10))
            lines.append(f"{r.check:<{width}}  {r.result:<6}  {detail}")
        lines.append(self.summary())
        return "\n".join(lines)
