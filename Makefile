# The two commands: `make run` and `make test`. Each sets up a fresh machine by itself (Debian
# packages, a virtualenv with torch 2.13.0 from the local disk, the three packages editable) and
# re-running them only rebuilds what changed.

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
PIP := $(VPY) -m pip
BUILD := build
STAGE := $(abspath $(BUILD)/stage)
export PATH := $(abspath $(VENV))/bin:$(PATH)
export CMAKE_BUILD_PARALLEL_LEVEL ?= $(shell nproc)
# The CPU build of torch lies on the local disk; pip finds it here even without PIP_FIND_LINKS.
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)
DEBIAN_PACKAGES := etcd-server libgtest-dev pkg-config slurm-wlm munge

CORE_SOURCES := $(shell find cpp/include cpp/src python/elastic_core/bindings -type f) \
	cpp/CMakeLists.txt cpp/VERSION python/elastic_core/CMakeLists.txt \
	python/elastic_core/pyproject.toml
PURE_SOURCES := python/elastic_launch/pyproject.toml python/elastic_sampler/pyproject.toml \
	python/elastic_launch/hatch_build.py $(wildcard python/elastic_launch/src/elastic_launch/rendezvous/etcdpb/*.proto)

.PHONY: run test test-loaded bench gpu-check lint cpp ctest pytest consumer demo-consumer setup clean

# The example job under elasticrun: 2 workers, gloo on CPU; one worker is killed at step 150 to
# show the restart and the resume from the checkpoint.
run: $(VENV)/.stamp-packages
	rm -rf $(BUILD)/run-checkpoints
	$(VENV)/bin/elasticrun --standalone --nproc-per-node 2 --max-restarts 3 \
	  examples/train_ddp.py --checkpoint-dir $(BUILD)/run-checkpoints --crash-at-step 150

# The C supervisor (cpp/examples/consumer) restarting a training loop that crashes, then hangs.
demo-consumer: $(VENV)/.stamp-packages $(BUILD)/consumer/elastic-consumer
	$(BUILD)/consumer/elastic-consumer --hang-timeout 1500 --max-restarts 3 --grace 1000 -- \
	  $(VPY) examples/core_demo.py

test: lint ctest pytest

setup: $(VENV)/.stamp-packages $(VENV)/.stamp-debian

# ---- set-up -----------------------------------------------------------------------------------

$(VENV)/.stamp-debian: Makefile
	@missing=$$(for p in $(DEBIAN_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages: $$missing"; \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing; \
	fi
	@mkdir -p $(VENV) && touch $@

$(VENV)/.stamp-venv: requirements-dev.txt
	test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(FIND_LINKS) torch==2.13.0
	$(PIP) install -q $(FIND_LINKS) -r requirements-dev.txt
	touch $@

$(VENV)/.stamp-packages: $(VENV)/.stamp-venv $(CORE_SOURCES) $(PURE_SOURCES)
	$(PIP) install -q $(FIND_LINKS) --no-build-isolation \
	  -e python/elastic_core -e python/elastic_launch -e python/elastic_sampler
	touch $@

# ---- C++ ----------------------------------------------------------------------------------------

$(BUILD)/cpp/build.ninja: CMakeLists.txt cpp/CMakeLists.txt cpp/tests/CMakeLists.txt cpp/bench/CMakeLists.txt | $(VENV)/.stamp-venv $(VENV)/.stamp-debian
	cmake -S . -B $(BUILD)/cpp -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo

cpp: $(BUILD)/cpp/build.ninja
	cmake --build $(BUILD)/cpp

ctest: cpp
	ctest --test-dir $(BUILD)/cpp --output-on-failure --timeout 120 -j 2

# Install the C++ package to a staging prefix, then build the consumer against it twice: with
# find_package(ElasticCore) and with pkg-config.
consumer: $(BUILD)/consumer/elastic-consumer
$(BUILD)/consumer/elastic-consumer: cpp cpp/examples/consumer/consumer.c cpp/examples/consumer/CMakeLists.txt
	rm -rf $(STAGE) && cmake --install $(BUILD)/cpp --prefix $(STAGE) >/dev/null
	cmake -S cpp/examples/consumer -B $(BUILD)/consumer -G Ninja -DCMAKE_PREFIX_PATH=$(STAGE)
	cmake --build $(BUILD)/consumer
	PKG_CONFIG_PATH=$(STAGE)/lib/pkgconfig cc -std=c99 -Wall -Wextra -Werror -o $(BUILD)/consumer/elastic-consumer-pkgconfig \
	  cpp/examples/consumer/consumer.c $$(PKG_CONFIG_PATH=$(STAGE)/lib/pkgconfig pkg-config --cflags --libs elastic-core) \
	  -Wl,-rpath,$(STAGE)/lib
	$(BUILD)/consumer/elastic-consumer-pkgconfig --version

# ---- Python ---------------------------------------------------------------------------------

pytest: $(VENV)/.stamp-packages $(VENV)/.stamp-debian $(BUILD)/consumer/elastic-consumer
	ELASTIC_CONSUMER_BIN=$(abspath $(BUILD)/consumer/elastic-consumer) \
	  $(VPY) -m pytest -n 3 --dist loadfile --durations=15

# The slow tests beside two CPU-bound processes: no verdict may depend on the machine's speed.
test-loaded: $(VENV)/.stamp-packages $(VENV)/.stamp-debian $(BUILD)/consumer/elastic-consumer
	ELASTIC_CONSUMER_BIN=$(abspath $(BUILD)/consumer/elastic-consumer) \
	  $(VPY) tests/under_load.py --burners 2 -m slow -n 2 --dist loadfile --durations=15

lint: $(VENV)/.stamp-packages
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

bench: $(VENV)/.stamp-packages cpp
	$(PIP) install -q $(FIND_LINKS) lightning accelerate  # the frameworks rows; torch stays 2.13.0
	$(PIP) install -q $(FIND_LINKS) --target $(BUILD)/hf transformers  # beside torch 2.13.0
	$(VPY) benchmarks/run.py --cpp-build $(BUILD)/cpp

# The real-job benchmark on this machine's GPUs over NCCL (needs 2 GPUs and a CUDA torch).
gpu-check: $(VENV)/.stamp-packages
	$(VPY) benchmarks/gpu_check.py

clean:
	rm -rf $(BUILD) python/*/build
