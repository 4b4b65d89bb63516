"""Connect to a Spark Connect server as a memwal run does, and check it runs this memwal's code.

Usage: connect_identity.py sc://127.0.0.1:PORT. Exit 0 when the server is this memwal's; 3 with
the refusal on stderr when another memwal started it."""

import sys

from pyspark.sql import SparkSession

from memwal_core.spark import connect

session = SparkSession.builder.remote(sys.argv[1]).appName("memwal").create()
try:
    connect.check_identity(session, sys.argv[1])
except connect.ForeignConnectServer as e:
    print(e, file=sys.stderr)
    sys.exit(3)
finally:
    session.stop()
print(connect.identity())
