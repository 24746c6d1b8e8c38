"""Run the whole scenario suite several times while a CPU burner keeps every core busy.

The suite's verdicts must not depend on the machine's load: every scenario must hold in every round.
The burner is this script's own (one spinning process per core, each bounded by a time limit), started
before the first round and stopped by PID after the last, whatever happens in between.

    python benchmarks/suite_under_load.py --rounds 3            # every file in scenarios/, both cores busy
    python benchmarks/suite_under_load.py -k ray --rounds 2     # the Ray scenarios only
    python benchmarks/suite_under_load.py scenarios/09_*.yaml --rounds 5 --burners 1

Every round runs every scenario the paths hold (the Ray ones included: they need root, for their
network namespace), or those ``-k`` / ``--tags`` select, as ``gym-resilience chaos run`` does. Prints
one line per round (how many scenarios held of how many ran, the exit code, the wall time, the round's
folder, and the scenarios that did not hold), then one summary line to quote, and exits 1 if any round
did not hold, or ran fewer scenarios than the paths hold. Each round keeps its own output folder (its
journal, JUnit XML and timelines) under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


def burn(until: float) -> None:
    """Spin until ``until`` (a ``time.time()``): a bounded load that stops by itself if orphaned."""
    x = 0
    while time.time() < until:
        x += 1


def start_burners(count: int, limit_s: float) -> list[multiprocessing.Process]:
    until = time.time() + limit_s
    burners = [multiprocessing.Process(target=burn, args=(until,), daemon=True) for _ in range(count)]
    for burner in burners:
        burner.start()
    return burners


def stop_burners(burners: list[multiprocessing.Process]) -> None:
    for burner in burners:
        if burner.pid is not None and burner.is_alive():
            os.kill(burner.pid, 9)
    for burner in burners:
        burner.join(timeout=10)


@dataclass(frozen=True)
class Round:
    number: int
    exit_code: int
    wall_s: float
    statuses: dict[str, str]  # scenario file -> status, from the round's journal

    @property
    def held(self) -> int:
        return sum(status == "held" for status in self.statuses.values())

    @property
    def ran(self) -> int:
        return len(self.statuses)

    def not_held(self) -> list[str]:
        return [f"{Path(file).name} {status}" for file, status in self.statuses.items() if status != "held"]

    def all_held(self, expected: int | None) -> bool:
        """Every scenario held, and as many ran as the paths hold (``expected``; None: any number)."""
        ran_all = expected is None or self.ran == expected
        return self.exit_code == 0 and self.ran > 0 and self.held == self.ran and ran_all


def scenario_files(paths: list[str]) -> list[Path]:
    """The scenario files ``chaos run`` finds in ``paths``: files as given, folders' *.yaml and *.yml."""
    files: list[Path] = []
    for path in map(Path, paths):
        if path.is_dir():
            files += sorted(p for p in path.iterdir() if p.suffix in (".yaml", ".yml") and p.is_file())
        else:
            files.append(path)
    return files


def read_statuses(journal: Path) -> dict[str, str]:
    """Each scenario's status in a round's journal; empty when the round wrote none."""
    try:
        data = json.loads(journal.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {str(item.get("file")): str(item.get("status")) for item in data.get("scenarios", [])}


def summary(rounds: list[Round], expected: int | None, burners: int) -> str:
    """One line to quote: scenarios per round, held over ran in all, every round's time."""
    held, ran = sum(r.held for r in rounds), sum(r.ran for r in rounds)
    sizes = sorted({r.ran for r in rounds})
    per_round = " / ".join(str(size) for size in sizes) if sizes else "0"
    cores = os.cpu_count() or 0
    times = ", ".join(f"{r.wall_s:.0f}" for r in rounds)
    every = bool(rounds) and all(r.all_held(expected) for r in rounds)
    verdict = "every scenario held in every round" if every else "NOT every scenario held in every round"
    return (
        f"under load ({burners} CPU burner(s) on {cores} cores): {per_round} scenarios x {len(rounds)} "
        f"rounds, {held}/{ran} held, {verdict}; round times {times} s"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", default=["scenarios"], help="scenario files or folders")
    parser.add_argument("-k", dest="expression", help="only the scenarios matching EXPR (as chaos run -k)")
    parser.add_argument("--tags", help="only the scenarios with one of these tags (as chaos run --tags)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--burners", type=int, default=os.cpu_count() or 2, help="spinning processes")
    parser.add_argument("--limit-s", type=float, default=3600.0, help="the burners stop by themselves then")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--out", type=Path, default=Path("chaos-runs/under-load"))
    args = parser.parse_args(argv)

    command = [sys.executable, "-m", "harness.cli", "chaos", "run", *args.paths, "--device", args.device]
    if args.expression:
        command += ["-k", args.expression]
    if args.tags:
        command += ["--tags", args.tags]
    # Without a filter every file must run: a round that ran fewer did not hold, whatever its exit code.
    selected = args.expression is None and args.tags is None
    expected = len(scenario_files(args.paths)) if selected else None
    burners = start_burners(args.burners, args.limit_s)
    print(f"{args.burners} burner(s) running: pids {[b.pid for b in burners]}", flush=True)
    rounds: list[Round] = []
    try:
        for number in range(1, args.rounds + 1):
            out = args.out / f"round-{number}"
            journal = out / "journal.json"
            start = time.perf_counter()
            argv_round = [*command, "--out", str(out), "--journal", str(journal)]
            finished = subprocess.run(argv_round, capture_output=True, text=True, check=False)
            result = Round(number, finished.returncode, time.perf_counter() - start, read_statuses(journal))
            rounds.append(result)
            failed = result.not_held()
            of = f" of {expected} files" if expected is not None else ""
            print(
                f"round {number}: {result.held}/{result.ran} held ({result.ran} ran{of}); exit "
                f"{result.exit_code} in {result.wall_s:.0f} s; {out}"
                + (f"; not held: {', '.join(failed)}" if failed else ""),
                flush=True,
            )
            if finished.returncode != 0:
                print(finished.stdout[-4000:], finished.stderr[-4000:], sep="\n")
    finally:
        stop_burners(burners)
    alive = [b.pid for b in burners if b.is_alive()]
    print(f"burners stopped (alive afterwards: {alive or 'none'})")
    print(summary(rounds, expected, args.burners))
    return 0 if rounds and all(r.all_held(expected) for r in rounds) else 1


if __name__ == "__main__":
    sys.exit(main())
