"""How long the desktop app takes from process start to its first painted window.

    .venv/bin/python benchmarks/gui_startup.py [--runs 5] [--tree DIR]

Each run starts `python -m rigpilot.app.launcher` (what the `rigpilot` command runs)
offscreen, with RIGPILOT_EXIT_AFTER_FIRST_PAINT=1: the main window prints
`first-paint <time>` once its first frame is painted and quits (see
app/main_window.py). The figure is that time minus the moment just before the
process was started. Python's bytecode caches are written (to a throw-away
folder) by the warm-up run and used by the rest, as in an installed app. An
engine service on a simulated 4×RTX 4090 runs throughout, in throw-away XDG
folders (so the app's settings and window state are fresh and the user's are
untouched), as it usually is when the app starts. The warm-up run is shown but
not counted; then the median of `--runs` runs; target <= 0.5 s.

`--tree DIR` starts the app from another checkout too (an older commit,
`git worktree add DIR COMMIT`), alternating with this one run by run so that
both see the same load, and prints the two side by side with their ratio.

The CPU time each run used (user + system, until it exited, and until its
first frame where the app prints it) is printed too: on a busy machine the
wall time grows with the other load, the CPU time much less.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_common import REPO, scratch_engine

TARGET_S = 0.5
RUN_TIMEOUT_S = 60


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def start_once(pycache: Path, tree: Path = REPO) -> tuple[float, float, float | None]:
    """Seconds from starting the app's process to its first painted frame, the CPU seconds it used until
    it exited, and those until the first frame (None from an older checkout that does not print them)."""
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen", RIGPILOT_EXIT_AFTER_FIRST_PAINT="1", PYTHONPATH=str(tree))
    # As installed, modules load from cached bytecode: let the app write its caches (under `pycache`,
    # so the checkout stays clean) even where PYTHONDONTWRITEBYTECODE is set, as in some CI set-ups.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = str(pycache)
    cpu0 = _children_cpu()
    t0 = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "rigpilot.app.launcher"], cwd=tree, env=env, capture_output=True, text=True,
        timeout=RUN_TIMEOUT_S,
    )  # fmt: skip
    for line in proc.stdout.splitlines():
        if line.startswith("first-paint "):
            fields = line.split()
            return float(fields[1]) - t0, _children_cpu() - cpu0, float(fields[2]) if len(fields) > 2 else None
    raise RuntimeError(f"the app printed no first-paint line (exit {proc.returncode}):\n{proc.stdout}{proc.stderr}")


def _report(label: str, warm_up: float, runs: list[tuple[float, float, float | None]]) -> float:
    times, cpu = [t for t, _, _ in runs], [c for _, c, _ in runs]
    to_paint = [c for _, _, c in runs if c is not None]
    median = statistics.median(times)
    print(f"  {label}")
    print(f"    warm-up run (not counted): {warm_up:.3f} s")
    print(f"    runs:   {', '.join(f'{t:.3f}' for t in times)} s")
    print(f"    median: {median:.3f} s   min {min(times):.3f} s   max {max(times):.3f} s")
    print(f"    CPU time per run (to exit): median {statistics.median(cpu):.3f} s   min {min(cpu):.3f} s")
    if to_paint:
        print(f"    CPU time to the first frame: median {statistics.median(to_paint):.3f} s   min {min(to_paint):.3f} s")
    return median


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="timed runs (default 5)")
    parser.add_argument("--tree", type=Path, help="also start the app from this checkout (an older commit), to compare")
    args = parser.parse_args()
    trees = [REPO] + ([args.tree.resolve()] if args.tree else [])
    load0 = os.getloadavg()[0]
    with scratch_engine() as (_, root):
        caches = [root / f"pycache{i}" for i in range(len(trees))]
        warm_up = [start_once(cache, tree)[0] for cache, tree in zip(caches, trees, strict=True)]
        runs: list[list[tuple[float, float, float | None]]] = [[] for _ in trees]
        for _ in range(args.runs):
            for i, tree in enumerate(trees):
                runs[i].append(start_once(caches[i], tree))
    load = os.getloadavg()[0]
    print(
        f"GUI start-up, process start to first painted window ({args.runs} runs, offscreen, engine running; "
        f"{os.cpu_count()} CPUs, load average {load0:.1f} before, {load:.1f} after):"
    )
    medians = [_report(str(tree), w, r) for tree, w, r in zip(trees, warm_up, runs, strict=True)]
    if args.tree:
        ratios = [a[0] / b[0] for a, b in zip(runs[0], runs[1], strict=True)]
        print(f"  this checkout / {args.tree}: median {medians[0] / medians[1]:.2f}×   per pair "
              f"{', '.join(f'{r:.2f}' for r in ratios)}")  # fmt: skip
    verdict = "meets" if medians[0] <= TARGET_S else "MISSES"
    print(f"  target <= {TARGET_S} s: {verdict} it")
    return 0 if medians[0] <= TARGET_S else 1


if __name__ == "__main__":
    sys.exit(main())
