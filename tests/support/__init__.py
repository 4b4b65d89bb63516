"""What the tests use as a library, never a test itself. Tables and files: `helpers` (a file
tree to compare, a generation planted by hand), `lance_manifest` (feature flags a newer Lance
would set), `tables` (the Dagster tests' demo table and its config), `walls` (what the wall and
commit-verification tests share). Servers and proxies the
tests start: `s3_server` (moto), `s3proxy` (fault injection in front of it), `emulators`
(Azurite, GCS), `cluster` (Spark standalone), `webserver` (dagster-webserver). Drivers and
monitors: `sensor_ticks` (the sensor as the daemon applies it), `procs` (the scripts of
tests/procs/), `progress_monitor` (merge progress never goes down), `harness_machine` (the
stateful harness). Test modules import from here, never from one another
(tests/test_architecture.py checks it)."""
