"""Dagster resources: the table (URI + storage options, secrets via EnvVar) and Spark."""

from __future__ import annotations

from typing import Any, Optional

from dagster import ConfigurableResource, EnvVar
from dagster_pyspark import LazyPySparkResource

from memwal_core.spark import connect as spark_connect
from memwal_core.spark.session import get_spark
from memwal_core.state.store import TableLocation, open_store

from .config import SECRET_OPTIONS, TableConfig


class TableResource(ConfigurableResource):
    """Where one MemWAL table is (a `MemWalTable` component's uri, storage options, secrets).
    Secret storage options are separate fields so that they can be `EnvVar`s: Dagster resolves
    them at run time and never shows their values."""

    uri: str
    storage_options: dict[str, str] = {}
    aws_access_key_id: Optional[str] = None
    aws_secret_access_key: Optional[str] = None
    aws_session_token: Optional[str] = None
    azure_storage_account_key: Optional[str] = None
    azure_storage_sas_key: Optional[str] = None
    azure_client_secret: Optional[str] = None
    google_service_account_key: Optional[str] = None

    def location(self) -> TableLocation:
        options = dict(self.storage_options)
        for key in SECRET_OPTIONS:
            value = getattr(self, key)
            if value:
                options[key] = value
        return open_store(self.uri, options)


class MemWalSpark(LazyPySparkResource):
    """dagster-pyspark's lazy session (runs that never merge never start Spark).

    `spark.remote = sc://127.0.0.1:PORT` with `memwal.connect.autostart = true` starts one
    long-lived local Spark Connect server on first use, so later runs skip the JVM start. Each
    run gets its own Connect session with the table's per-session settings (`memwal.*`, runtime
    SQL conf); a fixed setting the running server does not have is refused
    (`spark_connect.apply_session_conf`).
    """

    def _init_session(self) -> None:
        if self._spark_session is not None:
            return
        conf = {str(k): str(v) for k, v in self.spark_config.items()}
        remote = conf.pop("spark.remote", None)
        autostart = conf.pop("memwal.connect.autostart", "false").lower() == "true"
        asked = conf.pop("spark.master", None)
        master = asked or "local[*]"
        if remote:
            from pyspark.sql import SparkSession

            if autostart:
                spark_connect.ensure_server(remote, master=master, conf=spark_connect.server_conf(conf))
            # A session of its own (not getOrCreate): its settings must not leak to another table.
            session = SparkSession.builder.remote(remote).appName("memwal").create()
            if autostart:  # a local server memwal manages: it must run this memwal's code
                spark_connect.check_identity(session, remote)
            spark_connect.apply_session_conf(session, remote, asked, conf)
            self._spark_session = session
        else:
            self._spark_session = get_spark(master, conf)


def table_resource(cfg: TableConfig) -> TableResource:
    secrets: dict[str, Any] = {k: EnvVar(v) for k, v in cfg.secrets.items()}
    return TableResource(uri=cfg.uri, storage_options=cfg.storage_options, **secrets)


def spark_resource(cfg: TableConfig) -> MemWalSpark:
    conf: dict[str, Any] = {"spark.master": cfg.spark.master, **cfg.spark.conf}
    if cfg.spark.connect:  # runs are clients of one long-lived server that runs spark_master
        conf = {"spark.remote": cfg.spark.connect, "memwal.connect.autostart": "true", **conf}
    elif cfg.spark.master.startswith("sc://"):
        conf = {"spark.remote": cfg.spark.master, "memwal.connect.autostart": "true", **cfg.spark.conf}
    return MemWalSpark(spark_config=conf)
