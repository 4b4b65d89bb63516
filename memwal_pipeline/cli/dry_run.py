"""`memwal maintain --dry-run`: each chosen step planned with the real pass's settings, and the
plan for a person to read."""

from __future__ import annotations

from memwal_core.steps.outcome import STEPS, StepOutcome, StepStatus
from memwal_core.units import size

from .report import PassReport
from .target import secret_values


DRY_RUN_PATHS = 20  # GC paths a dry run prints (--json lists them all)


def dry_run(cfg, steps: list[str] | tuple[str, ...] = STEPS, secrets: dict[str, str] | None = None) -> PassReport:
    """What each chosen step would do, with every setting the real pass uses. Touches nothing.

    The same runner as the real pass with `execute=False`: each step is planned with the
    table's options and the flags over them. GC's dry run is its own job with execution off:
    the base-version cleanup is planned by Lance and GC planned as if those versions were gone,
    so its list is what the real GC deletes on the table as it is now (steps before it that
    commit can change that)."""
    from memwal_core.state.store import open_store
    from memwal_core.steps import StepOptions, run_step

    secrets = secret_values(cfg, {}) if secrets is None else secrets
    loc = open_store(cfg.uri, {**cfg.storage_options, **secrets})
    options = StepOptions.of(cfg)
    return PassReport(cfg.uri, True, [run_step(s, loc, options, execute=False) for s in STEPS if s in steps])


def format_plan(report: PassReport) -> str:
    """A dry run for a person: one section per chosen step, from its outcome."""
    chosen = [o.step for o in report.outcomes]
    lines = [f"table {report.table} (dry run: {', '.join(chosen)})"]
    for o in report.outcomes:
        if o.status is StepStatus.REFUSED:
            lines.append(f"{o.step}: refused: {o.error}")
        elif o.status is StepStatus.FAILED:
            lines.append(f"{o.step}: cannot be planned: {o.error}")
        elif o.step == "gc":
            lines += _format_gc(o, earlier=[s for s in chosen if s != "gc"])
        else:
            lines.append(f"{o.step}: {o.summary}")
            if o.step == "merge":
                lines += [f"  batch of {len(b.generations)} generations, {size(b.bytes)} -> progress {b.progress}"
                          for b in o.plan.batches]
            lines += [f"  {line}" for line in o.problems + o.notes]
    return "\n".join(lines)


_KIND_NAMES = {"generation": "generations", "wal": "WAL entries", "manifest": "region manifest versions",
               "orphan": "orphan directories", "base_version": "base-table versions"}


def _format_gc(o: StepOutcome, earlier: list[str]) -> list[str]:
    """GC's part of a dry run: totals per kind, the first paths, base versions, what is kept."""
    m, plan = o.metrics, o.plan
    would = {k: m[f"would_delete/{k}/items"] for k in _KIND_NAMES}
    lines = ["gc: would delete " + ", ".join(f"{would[k]} {name}" for k, name in _KIND_NAMES.items())
             + f": {m['objects'] + m['would_delete/base_version/objects']} objects, "
               f"{size(m['bytes'] + m['would_delete/base_version/bytes'])}"]
    base = plan.base_cleanup
    if base:
        files = ", ".join(f"{n} {k}" for k, n in base.files.items())
        lines.append(f"  base table: versions {_ranges(base.versions) or 'none'} ({files or 'no files'})")
    lines += [f"  {note}" for note in o.notes]
    items = plan.items
    for item in items[:DRY_RUN_PATHS]:
        lines.append(f"  {item.kind:<10} {item.path}  ({len(item.keys)} objects, {size(item.bytes)})")
    if len(items) > DRY_RUN_PATHS:
        lines.append(f"  ... and {len(items) - DRY_RUN_PATHS} more (--json lists every one)")
    lines.append(f"  base versions left after it: {len(plan.retained_versions)}")
    lines += [f"  keeps {h.describe()}" for h in plan.holds]
    lines += [f"  {line}" for line in o.problems]
    if earlier:
        lines.append(f"  (planned on the table as it is now: {', '.join(earlier)} run first and what they "
                     "commit can change what GC collects)")
    return lines


def _ranges(ns: list[int]) -> str:
    """`1-4, 6` for [1, 2, 3, 4, 6]."""
    out, run = [], []
    for n in sorted(ns):
        if run and n == run[-1] + 1:
            run.append(n)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [n]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ", ".join(out)
