"""Spark for memwal: sessions (local, cluster, Connect), the merge's tasks, the Connect server,
what a cluster's executors need (env) and the driver JVM's class-data-sharing archive."""
