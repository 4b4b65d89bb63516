"""Merge progress and index catch-up watched while other processes write and maintain a table:
neither may ever go down, in the latest state over time or from one table version to the next."""

from __future__ import annotations

import lance

from memwal_core.state import table


class ProgressMonitor:
    """Merge progress and catch-up, sampled over time and read at every table version."""

    def __init__(self, loc):
        self.loc = loc
        self.last_sample: table.MemWalState | None = None
        self.samples = 0
        self.next_version = 1
        self.by_version: dict[int, tuple[dict, dict]] = {}
        self.missed: list[int] = []  # versions cleaned up before they could be read
        self.no_memwal: list[int] = []
        self.problems: list[str] = []

    @staticmethod
    def _flat(state: table.MemWalState) -> tuple[dict, dict]:
        catch = {(i, r): g for i, regions in state.catchup.items() for r, g in regions.items()}
        return dict(state.merged), catch

    def _compare(self, what: str, old: tuple[dict, dict], new: tuple[dict, dict]) -> None:
        for name, a, b in (("merged", old[0], new[0]), ("catch-up", old[1], new[1])):
            for key, g in a.items():
                if b.get(key, 0) < g:
                    self.problems.append(f"{what}: {name} {key} went from {g} to {b.get(key, 0)}")

    def sample(self) -> None:
        try:
            latest = lance.dataset(self.loc.lance_uri).version
            state = table.read_memwal_state(self.loc, latest)
        except table.TableError:
            return  # cleaned up between the two reads: the next sample sees a newer one
        if self.last_sample is not None and state.table_version >= self.last_sample.table_version:
            self._compare(f"latest state v{self.last_sample.table_version} -> v{state.table_version}",
                          self._flat(self.last_sample), self._flat(state))
        self.last_sample = state
        self.samples += 1
        self.read_versions(latest)

    def read_versions(self, upto: int) -> None:
        for v in range(self.next_version, upto + 1):
            try:
                self.by_version[v] = self._flat(table.read_memwal_state(self.loc, v))
            except table.MemWalNotInitialized:
                self.no_memwal.append(v)
            except table.TableError as e:
                if "not found" not in str(e):
                    raise
                self.missed.append(v)
        self.next_version = max(self.next_version, upto + 1)

    def final_check(self) -> None:
        for info in lance.dataset(self.loc.lance_uri).versions():  # the retained ones, again
            v = int(info["version"])
            try:
                again = self._flat(table.read_memwal_state(self.loc, v))
            except table.MemWalNotInitialized:
                continue
            if v in self.by_version and again != self.by_version[v]:
                self.problems.append(f"version {v} changed after it was committed")
            self.by_version[v] = again
        prev = None
        for v in sorted(self.by_version):
            if prev is not None:
                self._compare(f"version {prev} -> {v}", self.by_version[prev], self.by_version[v])
            prev = v
