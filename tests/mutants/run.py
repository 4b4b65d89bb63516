"""`make mutate`: does the stateful harness catch single-point bugs on its own?

Each `tests/mutants/*.patch` plants one bug (its first line says which). For each, one at a
time: copy the project (memwal_core, memwal_pipeline, tests, pyproject.toml) to a scratch
directory, apply the patch, and run the bounded harness alone (tests/test_harness.py
`test_harness_bounded`, fixed seeds, no shrinking) against the copy. The mutant is killed when
the harness fails; it survives when the harness passes. One line per mutant (killed/survived,
steps to kill, seconds), then `N of M killed`; the exit status is 1 when any survived.

usage: python tests/mutants/run.py [NAME_SUBSTRING ...]   (default: every patch)
environment: MEMWAL_MUTATE_STEPS (default 1000: the `make test` profile), MEMWAL_HARNESS_SEED,
MEMWAL_MUTATE_TIMEOUT (seconds per mutant, default 3 h; the harness runs without pytest's timeout).

Adding a mutant: change one line of the library in your worktree, then
`git diff -- path/to/file.py > tests/mutants/NN_what_it_breaks.patch`, put a first line
`# component: what the bug does` above the diff, restore the file, and run
`python tests/mutants/run.py NN_` until the harness kills it (if it survives, the harness has
a blind spot: add the rule or the oracle that would see it).
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
COPY = ["memwal_core", "memwal_pipeline", "tests", "pyproject.toml"]
RUN_TIMEOUT = float(os.environ.get("MEMWAL_MUTATE_TIMEOUT", 3 * 3600))  # one mutant's harness run, seconds


def scratch_copy(dest: str) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
    for name in COPY:
        src = os.path.join(ROOT, name)
        if os.path.isdir(src):
            shutil.copytree(src, os.path.join(dest, name), ignore=ignore)
        else:
            shutil.copy2(src, os.path.join(dest, name))


def run_one(patch: str, steps: int) -> tuple[str, int | None, float, str]:
    with tempfile.TemporaryDirectory(prefix="memwal-mutant-") as d:
        scratch_copy(d)
        p = subprocess.run(["patch", "-p1", "-s", "-d", d, "-i", patch], capture_output=True, text=True)
        if p.returncode:
            return "patch failed", None, 0.0, p.stdout + p.stderr
        # No pytest timeout on the harness (a slow, shared machine must not turn into kills);
        # the run as a whole is bounded here instead.
        env = {**os.environ, "PYTHONPATH": d, "MEMWAL_HARNESS_NO_SHRINK": "1", "MEMWAL_HARNESS_STEPS": str(steps),
               "MEMWAL_HARNESS_TIMEOUT": "0"}
        t0 = time.monotonic()
        try:
            p = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-x", "-s",
                                "tests/test_harness.py", "-k", "bounded"],
                               cwd=d, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT)
        except subprocess.TimeoutExpired as e:
            return "timeout", None, time.monotonic() - t0, str(e.stdout or "")[-3000:]
        took = time.monotonic() - t0
        out = p.stdout + p.stderr
        if p.returncode == 0:
            return "SURVIVED", None, took, out
        m = re.search(r"HARNESS FAILED after (\d+) steps", out)
        if m is None or "Timeout (>" in out:
            return "error", None, took, out
        return "killed", int(m.group(1)), took, out


def main(argv: list[str]) -> int:
    steps = int(os.environ.get("MEMWAL_MUTATE_STEPS", 1000))
    patches = sorted(glob.glob(os.path.join(HERE, "*.patch")))
    if argv:
        patches = [p for p in patches if any(a in os.path.basename(p) for a in argv)]
    killed = 0
    t0 = time.monotonic()
    for patch in patches:
        name = os.path.basename(patch)[: -len(".patch")]
        with open(patch) as f:
            what = f.readline().lstrip("# ").strip()
        status, at, took, out = run_one(patch, steps)
        killed += status == "killed"
        where = f"after {at} steps" if at is not None else ""
        print(f"{status:12} {name:45} {where:18} {took:5.0f} s  {what}", flush=True)
        if status not in ("killed", "SURVIVED"):
            print(out[-3000:], flush=True)
        elif status == "killed":
            reason = re.findall(r"^E\s+(\w*Error: .{0,160})", out, re.M) or re.findall(r"(\w+Error: .{0,160})", out)
            if reason:
                print(f"{'':12} {reason[0]}", flush=True)
    print(f"{killed} of {len(patches)} killed in {time.monotonic() - t0:.0f} s", flush=True)
    return 0 if killed == len(patches) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
