# Two commands do everything on a fresh machine (Debian 12, Python 3.11):
#   make train   install, then train PPO on ManiSkill3 PushCube-v1 (state obs)
#   make test    install, then run the test suite
# Both are idempotent: a second run skips installation (it is redone when pyproject.toml changes).
#
# TORCH selects the torch build installed first. The default (torch==2.13.0) takes the local
# CPU wheel on CPU machines prepared like ours; on a GPU machine plain PyPI serves a CUDA
# build of the same version. See README "Installing on a GPU machine".

PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
ARGS ?=
PYTEST_ARGS ?=
BIN := $(VENV)/bin
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -ec
# pip prints a warning per package for the machine's file:// indexes that do not exist
QUIET_PIP := sed -u '/^WARNING: Location/d'

STAMP := $(VENV)/.embodied-installed
# MetaWorld's env processes run their own interpreter: metaworld pins mujoco 3.3.0, LIBERO needs 2.3.7
MW_VENV ?= .venv-metaworld
MW_REQUIREMENTS := assets/metaworld/requirements.txt
MW_STAMP := $(MW_VENV)/.embodied-installed

.PHONY: setup train test test-unit test-all lint clean-venv

# MetaWorld's interpreter first: setup-render (in the project's) checks that it renders too
setup: $(MW_STAMP) $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check --upgrade pip 2>&1 | $(QUIET_PIP)
	@# torch first and pinned: an unpinned resolve would pull a multi-GB CUDA build onto a CPU box
	$(BIN)/python -m pip install -q "$(TORCH)" 2>&1 | $(QUIET_PIP)
	$(BIN)/python -m pip install -q -e ".[dev]" 2>&1 | $(QUIET_PIP)
	@# headless Vulkan (Mesa lavapipe) for SAPIEN; skipped where a driver already works
	$(BIN)/embodied setup-render
	touch $(STAMP)

$(MW_STAMP): $(MW_REQUIREMENTS)
	test -x $(MW_VENV)/bin/python || $(PYTHON) -m venv $(MW_VENV)
	$(MW_VENV)/bin/python -m pip install -q --disable-pip-version-check -r $(MW_REQUIREMENTS) 2>&1 | $(QUIET_PIP)
	touch $(MW_STAMP)

train: setup
	$(BIN)/embodied train $(ARGS)

test: setup
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-unit: setup  # the fast loop: pure-logic tests only (tiers: tests/conftest.py)
	$(BIN)/python -m pytest -m "unit and not slow" $(PYTEST_ARGS)

test-all: setup  # every tier, slow tests included (pyproject's addopts leave them out)
	$(BIN)/python -m pytest -m "slow or not slow" $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check .

clean-venv:
	rm -rf $(VENV) $(MW_VENV)
