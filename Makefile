# The README's two commands: `make run` and `make test`. Both create .venv and (re)install the
# project when it is missing or pyproject.toml changed since the last install.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test ui bench soak mutate s3-demo spark-env proto clean emulators browser screenshots

$(STAMP): pyproject.toml
	@command -v $(PY) >/dev/null 2>&1 || { echo "memwal needs $(PY) on PATH (set PY=...)"; exit 1; }
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	@# The distribution is `memwal-lance`. A venv that still holds this project under the name
	@# `memwal` (same packages, same `memwal` command) gets it removed first, or uninstalling it later
	@# would take the command with it; a `memwal` that is another project is left alone. (-I: the
	@# venv's packages only, not a stale memwal.egg-info in this directory.)
	@$(BIN)/python -I -c "import importlib.metadata as m, sys; d = next(iter(m.distributions(name='memwal')), None); \
		sys.exit(0 if d is not None and (d.metadata['Summary'] or '').startswith('Maintenance plane for Lance') else 1)" \
		&& { $(BIN)/python -I -m pip uninstall -q -y memwal; rm -rf memwal.egg-info; } || true
	$(BIN)/python -m pip install -q -e '.[dev]'
	@# Spark's driver JVM starts ~3 s sooner with a class archive (memwal_core/spark/archive.py).
	-$(BIN)/memwal spark-archive
	@touch $(STAMP)

run: $(STAMP)
	$(BIN)/memwal demo

# `dg check defs`: every defs.yaml against the MemWalTable schema, then the code location loads
# (tests/test_component.py and tests/test_pipeline.py also run it and `dagster definitions validate`).
# The suite runs in TEST_WORKERS processes (pytest-xdist), each test file whole in one of them: a
# module's shared fixtures are built once and its tests run in file order. TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
test: $(STAMP) emulators browser
	$(BIN)/dg check defs
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# Azurite (Azure Blob emulator, an npm package) for tests/test_object_stores.py, into .tools/azurite
# of this checkout, never globally. Without npm the az:// tests skip and say why.
emulators:
	@test -x .tools/azurite/node_modules/.bin/azurite-blob || { command -v npm >/dev/null 2>&1 \
		&& npm install --no-audit --no-fund --prefix .tools/azurite azurite@3.35.0 \
		|| echo "npm missing or failed: the az:// tests will skip"; }

# Debian's chromium for tests/test_ui_screenshots.py (Playwright drives it; `playwright install`
# would download a browser build from outside the package registries). Installed with apt-get when
# run as root; otherwise that test skips and says how to install it.
browser:
	@command -v chromium >/dev/null 2>&1 || { test "$$(id -u)" = 0 && command -v apt-get >/dev/null 2>&1 \
		&& { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null \
		|| { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null; }; } \
		|| echo "chromium not installed (needs root and apt-get): the UI screenshot test will skip"; }

# docs/ui-asset-graph.png and docs/ui-region-partitions.png, taken by the suite's browser test.
screenshots: $(STAMP) browser
	MEMWAL_UPDATE_SCREENSHOTS=1 $(BIN)/python -m pytest -q tests/test_ui_screenshots.py

ui: $(STAMP)
	@# One planned event per range run instead of one per partition (docs/benchmarks.md §9).
	DAGSTER_HOME=$(CURDIR)/dagster_home DAGSTER_EMIT_PARTITION_SUBSET_IN_PLANNED_EVENTS=true $(BIN)/dagster dev -w workspace.yaml

bench: $(STAMP)
	$(BIN)/python bench/run_all.py

soak: $(STAMP)
	MEMWAL_SOAK=1 $(BIN)/python -m pytest -q -m slow

# Plants each bug of tests/mutants/*.patch in a scratch copy, one at a time, and runs the bounded
# harness alone against it: one line per mutant (killed / survived, steps to kill), then `N of M killed`.
mutate: $(STAMP)
	$(BIN)/python tests/mutants/run.py

s3-demo: $(STAMP)
	cd tests && ../$(BIN)/python -m support.s3_demo

# memwal-env.tar.gz: this venv for a cluster's `spark.archives` (docs/spark.md, "Running on a cluster").
spark-env: $(STAMP)
	$(BIN)/memwal spark-env memwal-env.tar.gz --force

# Regenerates memwal_core/proto/memwal_pb2.py (committed) from memwal.proto.
# grpcio-tools goes into a throwaway venv so it never becomes a runtime dependency.
proto:
	@test -x .protoc-venv/bin/python || { $(PY) -m venv .protoc-venv && .protoc-venv/bin/pip install -q grpcio-tools 'protobuf<7'; }
	.protoc-venv/bin/python -m grpc_tools.protoc -Imemwal_core/proto --python_out=memwal_core/proto memwal_core/proto/memwal.proto

clean:
	rm -rf $(VENV) .protoc-venv .pytest_cache .tools
