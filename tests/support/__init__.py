"""What the tests use as a library, never a test itself: shared helpers (`helpers`), the
servers and proxies the tests start (`s3_server`, `s3proxy`, `emulators`, `cluster`,
`webserver`), the Dagster sensor driver (`sensor_ticks`), the concurrency monitor
(`progress`) and the stateful harness's machine (`harness_machine`). Test modules import from
here, never from one another (tests/test_architecture.py checks it)."""
