"""A check run in named phases: each skipped when its estimate does not fit the budget left, the results
JSON rewritten atomically before and after each phase (a killed run leaves a valid JSON of the phases done so
far), and the child processes the phases run (killed with their process group on timeout). Used by
``tools/cluster/gpu_check.py``; no import of the rest of the package.

Statuses: ``ok`` (+ measurements), ``failed`` (+ reason, + what was measured), ``skipped`` (+ why),
``not_run`` (not reached yet); ``running`` names the phase in flight.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

TIMEOUT_FACTOR = 3.0
"""A phase is killed after TIMEOUT_FACTOR x its estimate (or when the budget is spent)."""
UNSELECTED = "not selected"
"""Why a phase left out of ``selected`` is skipped (a caller names its own option)."""


class PhaseFailed(Exception):
    """A phase's check did not hold: ``reason`` is recorded, with what was measured."""

    def __init__(self, reason: str, measurements: Optional[Dict] = None):
        super().__init__(reason)
        self.measurements = measurements or {}


class Child:
    """One child process: output streamed to our stdout (prefixed) and to a log file; killed (its
    whole process group) when it outlives ``timeout_s`` or when we get SIGTERM."""

    def __init__(self, name: str, cmd: List[str], log_path: str, env: Dict[str, str], timeout_s: float, cwd: str,
                 tag: str = "phases"):
        self.name, self.cmd, self.log_path, self.env, self.timeout_s = name, cmd, log_path, env, timeout_s
        self.cwd, self.tag = cwd, tag
        self.rc: Optional[int] = None
        self.timed_out = False
        self.tail: List[str] = []

    def run(self) -> int:
        print(f"{self.tag}: [{self.name}] {' '.join(self.cmd)}  (limit {self.timeout_s:.0f} s)", flush=True)
        with open(self.log_path, "w") as log:
            # its own process group (not session: a session would outlive the device command)
            proc = subprocess.Popen(self.cmd, cwd=self.cwd, env=self.env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, errors="replace", process_group=0)
            timer = threading.Timer(self.timeout_s, self._kill, (proc,))
            timer.start()
            previous = signal.signal(signal.SIGTERM, lambda *_: (self._kill(proc), sys.exit(143)))
            try:
                for line in proc.stdout:
                    log.write(line)
                    sys.stdout.write(f"[{self.name}] {line}")
                    sys.stdout.flush()
                    self.tail = (self.tail + [line.rstrip()])[-25:]
                proc.wait()
            finally:
                timer.cancel()
                signal.signal(signal.SIGTERM, previous)
        self.rc = 124 if self.timed_out else proc.returncode
        return self.rc

    def _kill(self, proc) -> None:
        """Time is up (or we were told to stop): the child and whatever it started."""
        self.timed_out = True
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def check(self) -> None:
        """Raises PhaseFailed unless the child exited 0."""
        if self.rc == 0:
            return
        why = f"timed out after {self.timeout_s:.0f} s" if self.timed_out else f"exited with status {self.rc}"
        raise PhaseFailed(f"{self.name} {why} (log: {self.log_path}); its last lines:\n    "
                          + "\n    ".join(self.tail[-12:]))


@dataclass
class PhaseSpec:
    name: str
    run: Callable[[float], Dict]
    """``run(timeout_s)`` -> measurements; raises PhaseFailed (or anything) when the phase fails."""
    estimate_s: float
    """Expected seconds: the phase is skipped when they do not fit the remaining budget."""
    measures: str
    """What the phase measures (named in ``not_measured`` when it does not run)."""
    group: str = ""
    """Phases of one group (the training runs) are estimated at least at the last one's seconds."""


def json_safe(obj):
    """``obj`` with non-finite floats as strings ("nan", "inf"): strict JSON has no NaN."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def write_json_atomic(path: str, obj) -> None:
    """``obj`` as JSON at ``path``, all or nothing: a temp file in the same folder, fsync, os.replace."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(json_safe(obj), f, indent=1, allow_nan=False, default=str)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def skip_reason(spec: PhaseSpec, selected: Sequence[str], results: Dict, estimate_s: float, left_s: float,
                unselected: str = UNSELECTED):
    """Why ``spec`` does not start (None: it starts)."""
    if spec.name not in selected:
        return unselected
    first = next(iter(results["phases"]))
    if spec.name != first and results["phases"][first]["status"] != "ok":
        return f"{first} did not pass"
    if estimate_s > left_s:
        return f"needs ~{estimate_s:.0f} s (estimate), {max(left_s, 0.0):.0f} s of the budget left"
    return None


def not_measured(results: Dict, notes: Callable[[Dict], List[str]]) -> List[str]:
    """Every quantity this check did not measure, and why: ``notes(results)`` (what the machine lacks)
    plus every phase that did not pass."""
    out = list(notes(results))
    pending = "not run yet" if not results.get("finished") else "not run (the check stopped before it)"
    for name, rec in results["phases"].items():
        reason = (str(rec.get("reason", "")).splitlines() or [""])[0]
        why = {"skipped": rec.get("why"), "failed": f"failed: {reason}", "not_run": pending}.get(rec["status"])
        if results.get("running") == name:
            why = "running (a killed check leaves it so)"
        if why:
            out.append(f"{name} ({rec['measures']}): {why}")
    return out


def new_results(specs: Sequence[PhaseSpec], selected: Sequence[str], budget_s: float, header: Dict,
                unselected: str = UNSELECTED) -> Dict:
    """Every phase ``not_run``, except those left out by ``selected``: ``skipped`` from the start (a killed
    check still tells them from the pending ones)."""
    phases = {s.name: {"status": "not_run", "measures": s.measures} for s in specs}
    for spec in specs:
        if spec.name not in selected:
            phases[spec.name].update(status="skipped", why=unselected)
    return dict(header, ok=False, finished=False, running=None, budget_s=budget_s, selected=list(selected),
                phases=phases, not_measured=[])


def run_phases(specs: Sequence[PhaseSpec], selected: Sequence[str], budget_s: float, json_path: str,
               header: Dict, notes: Callable[[Dict], List[str]] = lambda r: [],
               clock: Callable[[], float] = time.perf_counter, tag: str = "phases",
               unselected: str = UNSELECTED) -> Dict:
    """Runs ``specs`` in order (the first one gates the rest), rewriting ``json_path`` atomically before
    and after each phase; returns the results (``ok``: the first phase passed and every phase that ran is
    ok). ``tag`` prefixes the printed lines; ``unselected`` is why a phase not in ``selected`` is skipped."""
    start = clock()
    results = new_results(specs, selected, budget_s, header, unselected)
    seen: Dict[str, float] = {}

    def save():
        results["wall_s"] = clock() - start
        results["not_measured"] = not_measured(results, notes)
        write_json_atomic(json_path, results)

    save()
    for spec in specs:
        estimate = max(spec.estimate_s, seen.get(spec.group, 0.0)) if spec.group else spec.estimate_s
        left = budget_s - (clock() - start)
        why = skip_reason(spec, selected, results, estimate, left, unselected)
        rec = results["phases"][spec.name]
        rec["estimate_s"] = estimate
        if why:
            rec.update(status="skipped", why=why)
            print(f"{tag}: [{spec.name}] skipped: {why}", flush=True)
            save()
            continue
        results["running"], rec["timeout_s"] = spec.name, min(left, TIMEOUT_FACTOR * estimate)
        save()
        phase_start = clock()
        try:
            rec.update(run_one(spec, rec["timeout_s"], clock))
        except BaseException as exc:  # SIGTERM (the time limit), Ctrl-C: recorded and saved, then propagated
            rec.update(status="failed", reason=f"interrupted ({type(exc).__name__} {exc}): SIGTERM / time limit?",
                       seconds=clock() - phase_start)
            results["running"] = None
            save()
            raise
        results["running"] = None
        if spec.group and rec["status"] == "ok":
            seen[spec.group] = rec["seconds"]
        print(phase_line(spec.name, rec, tag), flush=True)
        save()
    results["finished"] = True
    first = results["phases"][specs[0].name]["status"] if specs else "ok"
    results["ok"] = first == "ok" and not any(r["status"] == "failed" for r in results["phases"].values())
    save()
    return results


def run_one(spec: PhaseSpec, timeout_s: float, clock) -> Dict:
    """One phase: ok + measurements, or failed + reason (+ what was measured)."""
    start = clock()
    try:
        return {"status": "ok", "measurements": spec.run(timeout_s), "seconds": clock() - start}
    except PhaseFailed as exc:
        return {"status": "failed", "reason": str(exc), "measurements": exc.measurements, "seconds": clock() - start}
    except Exception as exc:  # noqa: BLE001 - a bug in a phase must not hide the other phases
        return {"status": "failed", "reason": f"{type(exc).__name__}: {exc}", "seconds": clock() - start}


def fmt_value(value, spec: str = ".3e") -> str:
    return "-" if value is None else format(value, spec)


def phase_line(name: str, rec: Dict, tag: str = "phases") -> str:
    text = {"ok": "ok", "skipped": f"skipped: {rec.get('why')}", "not_run": "not run",
            "failed": f"FAILED: {rec.get('reason')}"}[rec["status"]]
    seconds = f" ({rec['seconds']:.1f} s)" if "seconds" in rec else ""
    return f"{tag}: [{name}] {text}{seconds}"
