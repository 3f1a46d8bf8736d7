# Developer entry points. `make run` demos the stack end to end; `make test` is what CI runs.
SHELL := bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

VENV    := .venv
PY      := $(VENV)/bin/python
GPUAAS  := $(VENV)/bin/gpuaas
RUN_DIR ?= .run/dev
DEMO_TIMEOUT ?= 180

.PHONY: help setup run demo up down status test check bench contract docs lab

help:
	@echo "make setup     install Debian packages, the AsyncAPI parser and the venv (idempotent)"
	@echo "make run       start the dev stack, allocate and release a slice and a baremetal host, stop"
	@echo "make test      static checks (import contracts, ruff, mypy on domains and typed service layers) and the whole pytest suite (CI)"
	@echo "make check     the static checks alone"
	@echo "make bench     pipeline benchmark (JSON on stdout)"
	@echo "make contract  render contracts/asyncapi.yaml from the contract models"
	@echo "make docs      regenerate the README's configuration and CLI tables from the code"
	@echo "make up|down|status  the detached dev stack in $(RUN_DIR)"
	@echo "make lab       a real slice host on this machine: one slice VM to SSH and back (QEMU/TCG, root)"

setup:
	@scripts/setup.sh

# The stack is stopped on every exit path, including a failed demo and Ctrl-C.
run: setup
	@trap '$(GPUAAS) dev down --run-dir $(RUN_DIR) || true' EXIT; trap 'exit 130' INT TERM; \
	$(GPUAAS) dev up --detach --run-dir $(RUN_DIR); \
	$(MAKE) --no-print-directory demo

demo:
	@id_of() { $(PY) -c 'import json,sys; print(json.load(sys.stdin)["allocation_id"])'; }; \
	echo "== gpu_slice, 2 GPUs"; \
	out=$$($(GPUAAS) allocate --shape gpu_slice --gpus 2 --wait --json --timeout $(DEMO_TIMEOUT) --run-dir $(RUN_DIR)) || { echo "$$out"; exit 1; }; \
	echo "$$out"; slice=$$(id_of <<<"$$out"); \
	$(GPUAAS) release "$$slice" --wait --json --timeout $(DEMO_TIMEOUT) --run-dir $(RUN_DIR); \
	echo "== baremetal, 8 GPUs through MAAS"; \
	out=$$($(GPUAAS) allocate --shape baremetal --wait --json --timeout $(DEMO_TIMEOUT) --run-dir $(RUN_DIR)) || { echo "$$out"; exit 1; }; \
	echo "$$out"; bm=$$(id_of <<<"$$out"); \
	$(GPUAAS) release "$$bm" --wait --json --timeout $(DEMO_TIMEOUT) --run-dir $(RUN_DIR); \
	echo "== demo passed"

# The lab: namespace, libvirtd, dnsmasq, one loop-device slot, the production agent; one real VM and back.
lab: setup
	@$(GPUAAS) lab run --run-dir .run/lab

up: setup
	@$(GPUAAS) dev up --detach --run-dir $(RUN_DIR)

down:
	@$(GPUAAS) dev down --run-dir $(RUN_DIR)

status:
	@$(GPUAAS) dev status --run-dir $(RUN_DIR)

DOMAINS := $(wildcard services/*/gpuaas_*/domain)
# Service layers typed against their ports (service_layer/ports.py), checked with the shared library in view.
TYPED_SERVICE_LAYERS := services/allocator/gpuaas_allocator/service_layer \
	services/image-pipeline/gpuaas_image_pipeline/service_layer \
	services/maas-gateway/gpuaas_maas_gateway/service_layer \
	services/ops-view/gpuaas_ops_view/service_layer
# The scheduler's service-layer files typed against its ports so far (issue 39), one a line.
SCHEDULER_TYPED := \
	services/scheduler/gpuaas_scheduler/service_layer/ports.py \
	services/scheduler/gpuaas_scheduler/service_layer/evidence.py \
	services/scheduler/gpuaas_scheduler/service_layer/drift.py \
	services/scheduler/gpuaas_scheduler/service_layer/slot_wipe.py \
	services/scheduler/gpuaas_scheduler/service_layer/steering.py \
	services/scheduler/gpuaas_scheduler/service_layer/host_modes.py \
	services/scheduler/gpuaas_scheduler/service_layer/vfio_binding.py \
	services/scheduler/gpuaas_scheduler/service_layer/slot_announcements.py \
	services/scheduler/gpuaas_scheduler/service_layer/hosts.py \
	services/scheduler/gpuaas_scheduler/service_layer/host_walk.py \
	services/scheduler/gpuaas_scheduler/service_layer/admin/__init__.py \
	services/scheduler/gpuaas_scheduler/service_layer/admin/common.py \
	services/scheduler/gpuaas_scheduler/service_layer/admin/drift.py \
	services/scheduler/gpuaas_scheduler/service_layer/admin/force_release.py \
	services/scheduler/gpuaas_scheduler/service_layer/admin/models.py \
	services/scheduler/gpuaas_scheduler/service_layer/admin/modes.py \
	services/scheduler/gpuaas_scheduler/service_layer/admin/nodes.py \
	services/scheduler/gpuaas_scheduler/service_layer/admin/quotas.py \
	services/scheduler/gpuaas_scheduler/service_layer/admin/steer.py \
	services/scheduler/gpuaas_scheduler/service_layer/admin/wipe.py
CODE    := libs services tools tests bench

test: setup check
	$(PY) -m pytest -q --durations=20

# Static checks (also run by `make test`): import contracts, ruff lint and format, mypy --strict on domains and
# on the typed service layers. The editable install hides libs/ from mypy, so a service layer's run names it
# (MYPYPATH): without it every gpuaas_common name, HandlerContext too, would be Any and check nothing.
check: setup
	$(VENV)/bin/lint-imports
	$(VENV)/bin/ruff check $(CODE)
	$(VENV)/bin/ruff format --check $(CODE)
	$(VENV)/bin/mypy --strict --follow-imports=silent --ignore-missing-imports $(DOMAINS)
	MYPYPATH=libs $(VENV)/bin/mypy --strict --follow-imports=silent --ignore-missing-imports $(TYPED_SERVICE_LAYERS)
	MYPYPATH=libs $(VENV)/bin/mypy --strict --follow-imports=silent --ignore-missing-imports $(SCHEDULER_TYPED)

bench: setup
	$(PY) bench/pipeline.py --json

contract: setup
	$(GPUAAS) contract render

docs: setup
	$(PY) -m gpuaas_dev.docs
