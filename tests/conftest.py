"""Shared fixtures: real pylance tables, one local SparkSession, a real moto S3 server."""

from __future__ import annotations

import uuid

import pytest
from support.s3_server import MotoServer

from memwal_core.state.store import open_store


@pytest.fixture
def table_loc(tmp_path):
    """A fresh local table location (nothing written yet)."""
    return open_store(str(tmp_path / "table"))


@pytest.fixture(scope="session")
def moto_server():
    server = MotoServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def s3_bucket(moto_server):
    """A fresh bucket on the moto server; returns (bucket name, storage options)."""
    from memwal_core.state.store import make_s3_client

    name = f"b{uuid.uuid4().hex[:12]}"
    make_s3_client(moto_server.options()).create_bucket(Bucket=name)
    return name, moto_server.options()


@pytest.fixture
def s3_table_loc(s3_bucket):
    bucket, options = s3_bucket
    return open_store(f"s3://{bucket}/table", options)


@pytest.fixture(params=["local", "s3"])
def loc(request, tmp_path):
    """A fresh table location, once on local disk and once on the moto S3 server."""
    if request.param == "local":
        return open_store(str(tmp_path / "t"))
    bucket, options = request.getfixturevalue("s3_bucket")
    return open_store(f"s3://{bucket}/t", options)


@pytest.fixture(scope="session")
def spark():
    """One local SparkSession for the whole test session (a JVM start costs ~10 s)."""
    from memwal_core.spark.session import get_spark

    session = get_spark("local[2]", {"spark.sql.shuffle.partitions": "4"})
    yield session
    session.stop()


def _harness_summary() -> list[str]:
    """This process's harness lines (support.harness_machine.Stats.summary), if it ran the harness."""
    import sys

    hm = sys.modules.get("support.harness_machine")
    return list(getattr(getattr(hm, "Stats", None), "summary", []))


_from_workers: list[str] = []  # under pytest-xdist: the lines the workers sent back


def pytest_sessionfinish(session) -> None:
    """An xdist worker hands its harness lines to the controller, which prints the summary."""
    out = getattr(session.config, "workeroutput", None)
    if out is not None:
        out["memwal_harness_summary"] = _harness_summary()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    _from_workers.extend(getattr(node, "workeroutput", {}).get("memwal_harness_summary", []))


def pytest_terminal_summary(terminalreporter) -> None:
    """The stateful harness's counts (rules run, and how many steps did something: merges that
    committed, GCs that deleted a generation, ...) at the end of every run, `-q` and `-n N` included."""
    for line in _harness_summary() + _from_workers:
        terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def azurite():
    """Azurite's blob service on 127.0.0.1 (installed into .tools/azurite by npm when missing)."""
    from support.emulators import Azurite, install_azurite

    why = install_azurite()
    if why:
        pytest.skip(f"Azurite cannot be installed: {why}")
    server = Azurite().start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def gcs_emulator():
    """A GCS emulator on 127.0.0.1 (gcp-storage-emulator, a dev dependency, with the XML API of
    tests/support/gcs_server.py); skips only when it is not installed."""
    from support.emulators import GcsEmulator

    why = GcsEmulator.missing()
    if why:
        pytest.skip(why)
    server = GcsEmulator().start()
    yield server
    server.stop()
