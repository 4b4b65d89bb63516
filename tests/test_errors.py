"""memwal's own errors share one base class, `MemwalError`, so a caller (the CLI, the Dagster
layer) tells "memwal refused this, here is why" from a bug with one `except`, whatever job
raised it. Each keeps its older base too, so existing `except ValueError/OSError` still work.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import memwal_core
from memwal_core.errors import MemwalError


def _core_modules() -> list[str]:
    return sorted(m.name for m in pkgutil.walk_packages(memwal_core.__path__, "memwal_core.")
                  if not m.name.endswith("_pb2"))


def _exception_classes() -> dict[str, type]:
    out = {}
    for name in _core_modules():
        mod = importlib.import_module(name)
        for attr, obj in vars(mod).items():
            if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == name:
                out[f"{name}.{attr}"] = obj
    return out


def test_the_walk_finds_the_known_errors():
    """The walk below must see the modules it is meant to check (else it proves nothing)."""
    found = _exception_classes()
    for name in ("memwal_core.state.region.RegionError", "memwal_core.state.objects.StoreError",
                 "memwal_core.jobs.merge.result.MergeError", "memwal_core.jobs.gc.items.GcError",
                 "memwal_core.spark.tasks.Refused", "memwal_core.state.memwal_index.SnapshotError"):
        assert name in found, sorted(found)


def test_every_core_exception_derives_from_memwal_error():
    loose = sorted(name for name, cls in _exception_classes().items() if not issubclass(cls, MemwalError))
    assert not loose, f"derive these from memwal_core.errors.MemwalError (keep their other bases): {loose}"


@pytest.mark.parametrize("name, other", [
    ("memwal_core.state.objects.StoreError", OSError),
    ("memwal_core.state.objects.NotFound", KeyError),
    ("memwal_core.spark.tasks.Refused", ValueError),
    ("memwal_core.state.layout.UnsafePath", ValueError),
    ("memwal_core.state.routing.UnsupportedTransform", ValueError),
    ("memwal_core.state.wal.WalEntryError", ValueError),
    ("memwal_core.spark.connect.ConnectConfMismatch", ValueError),
    ("memwal_core.errors.OptionError", ValueError),
])
def test_older_bases_are_kept(name, other):
    """`except OSError` around a store call (and the like) still catches memwal's error."""
    cls = _exception_classes()[name]
    assert issubclass(cls, MemwalError) and issubclass(cls, other)


def test_a_store_error_still_formats_as_before():
    from memwal_core.state.store import NotFound, StoreError

    assert str(StoreError("S3 get failed")) == "S3 get failed"
    assert isinstance(StoreError("x"), OSError)
    with pytest.raises(KeyError):
        raise NotFound("a/b")
