"""Run the whole scenario suite several times while a CPU burner keeps every core busy.

The suite's verdicts must not depend on the machine's load: every scenario must hold in every round.
The burner is this script's own (one spinning process per core, each bounded by a time limit), started
before the first round and stopped by PID after the last, whatever happens in between.

    python benchmarks/suite_under_load.py --rounds 3            # the bundled suite, both cores busy
    python benchmarks/suite_under_load.py scenarios/09_*.yaml --rounds 5 --burners 1

Prints one line per round (exit code, wall time, the run's folder) and exits 1 if any round did not
hold. Each round keeps its own output folder under ``--out``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import subprocess
import sys
import time
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", default=["scenarios"], help="scenario files or folders")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--burners", type=int, default=os.cpu_count() or 2, help="spinning processes")
    parser.add_argument("--limit-s", type=float, default=3600.0, help="the burners stop by themselves then")
    parser.add_argument("--out", type=Path, default=Path("chaos-runs/under-load"))
    args = parser.parse_args(argv)

    command = [sys.executable, "-m", "harness.cli", "chaos", "run", *args.paths]
    burners = start_burners(args.burners, args.limit_s)
    print(f"{args.burners} burner(s) running: pids {[b.pid for b in burners]}", flush=True)
    results: list[tuple[int, float]] = []
    try:
        for round_number in range(1, args.rounds + 1):
            out = args.out / f"round-{round_number}"
            start = time.perf_counter()
            finished = subprocess.run([*command, "--out", str(out)], capture_output=True, text=True)
            wall_s = time.perf_counter() - start
            results.append((finished.returncode, wall_s))
            summary = [line for line in finished.stdout.splitlines() if "scenarios in" in line]
            print(f"round {round_number}: exit {finished.returncode} in {wall_s:.0f} s; {' '.join(summary)}")
            if finished.returncode != 0:
                print(finished.stdout[-4000:], finished.stderr[-4000:], sep="\n")
    finally:
        stop_burners(burners)
    alive = [b.pid for b in burners if b.is_alive()]
    print(f"burners stopped (alive afterwards: {alive or 'none'})")
    held = sum(code == 0 for code, _ in results)
    times = ", ".join(f"{wall_s:.0f} s" for _, wall_s in results)
    print(f"{held} of {len(results)} rounds held under load; round times {times}")
    return 0 if held == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
