# voxserve developer entry points. `make serve` and `make test` are the README's two commands.
PYTHON ?= python3
VENV ?= .venv
# PyPI's torch for this platform (a CPU wheel here; CUDA builds on GPU hosts). Override to pick another.
TORCH_SPEC ?= torch==2.13.0
CONSTRAINTS := .ci/constraints.txt
BIN := $(VENV)/bin

.PHONY: serve test lint kernel-check proto clean image image-test

# The first run installs for a few minutes (PyTorch alone is hundreds of MB): each step says what it does, and
# pip shows what it downloads and installs.
$(BIN)/.installed: pyproject.toml $(CONSTRAINTS)
	@echo "==> [1/3] creating the virtual environment $(VENV)/ (first use, or pyproject.toml changed)"
	$(PYTHON) -m venv $(VENV)
	@echo "==> [2/3] installing PyTorch ($(TORCH_SPEC)): the largest download, a few minutes on first use"
	$(BIN)/pip install "$(TORCH_SPEC)"
	@echo "==> [3/3] installing voxserve with its server and test extras"
	$(BIN)/pip install -c $(CONSTRAINTS) -e '.[server,test]'
	@echo "==> installed into $(VENV)/"
	touch $@

## serve: start the server with the default weights (GPU if one is usable, else the CPU); ARGS=... adds flags
serve: $(BIN)/.installed
	$(BIN)/voxserve serve $(ARGS)

## test: lint, then the whole test suite (GPU tests skip without a GPU)
test: $(BIN)/.installed lint
	@echo "==> the test suite (a few minutes; GPU tests skip without a GPU, the reason shown at the end)"
	$(BIN)/pytest -q $(PYTEST_ARGS)

## lint: ruff, then mypy on the installed package's modules (laid out as voxserve.* under build/, as installed)
lint: $(BIN)/.installed
	$(BIN)/ruff check .
	rm -rf build/typecheck && mkdir -p build/typecheck/voxserve
	ln -s $(CURDIR)/voxserve/*.py $(CURDIR)/voxserve/testing build/typecheck/voxserve/
	for d in proto server kernels client; do ln -s $(CURDIR)/$$d build/typecheck/voxserve/$$d; done
	cd build/typecheck && $(abspath $(BIN))/mypy --config-file $(CURDIR)/pyproject.toml --cache-dir $(CURDIR)/build/mypy-cache -p voxserve

## proto: regenerate the protocol modules after editing proto/*.proto
proto: $(BIN)/.installed
	$(BIN)/python -m voxserve.proto.generate

## image: build the image ($(IMAGE)) with podman (--format docker keeps the HEALTHCHECK) or docker, whichever is
##        present. IMAGE_BASES=local builds on local stand-ins for the bases, made without a registry by
##        deploy/local-bases/make.sh (podman), with IMAGE_TORCH=cpu (default) or cuda
CONTAINER_ENGINE ?= $(shell command -v podman > /dev/null 2>&1 && echo podman || echo docker)
IMAGE ?= voxserve
IMAGE_BASES ?= registry
IMAGE_TORCH ?= cpu
IMAGE_BUILD_FLAGS ?=
image:
ifeq ($(IMAGE_BASES),local)
	deploy/local-bases/make.sh
endif
	$(CONTAINER_ENGINE) build $(if $(findstring podman,$(CONTAINER_ENGINE)),--format docker) \
	  $(if $(filter local,$(IMAGE_BASES)),$$(deploy/local-bases/make.sh --flags $(IMAGE_TORCH))) $(IMAGE_BUILD_FLAGS) -t $(IMAGE) .

## image-test: build the image, run it (health, inference against float64, /metrics, HEALTHCHECK, drain on stop)
##             and the compose pair (voxserve + Prometheus); skipped where podman/docker cannot run
image-test: $(BIN)/.installed
	$(BIN)/pytest -q tests/e2e/test_image.py tests/e2e/test_compose.py $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
