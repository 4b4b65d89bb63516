"""Things built on top of the jobs: the demo table and workload, the JVM archive build."""
