# Two commands for a newcomer: `make run` (set up, then the main job on the embedded
# default) and `make test` (set up, then the test suite). Both are idempotent: set-up
# is skipped while pyproject.toml is unchanged.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell sha1sum pyproject.toml | cut -c1-12)
# Without CUDA, pin the CPU build of torch (a bare `torch` pulls a multi-GB CUDA build).
TORCH_PIN := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo "torch>=2.6,<3" || echo "torch==2.13.0")
PYTEST_ARGS ?=
# Test processes (pytest-xdist; whole files per worker, in collection order, so a file's
# module fixtures start once and the in-process Ray / wasmtime ordering in tests/conftest.py
# holds per worker). The suite is mostly one busy Python thread at a time: two workers use
# both cores of a 2-core CI runner. PYTEST_WORKERS=0 runs it in this process.
PYTEST_WORKERS ?= 2
# Tests marked slow (the whole GPU-check dry run) are left out; PYTEST_ARGS="-m slow" runs
# them (a later -m wins), PYTEST_MARKS= runs everything.
PYTEST_MARKS ?= not slow

.PHONY: setup run test lint bench clean gpu-check

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@$(BIN)/python -m pip install -q --disable-pip-version-check --upgrade pip
	@$(BIN)/python -m pip install -q --disable-pip-version-check "$(TORCH_PIN)"
	@$(BIN)/python -m pip install -q --disable-pip-version-check -e ".[dev]"
	@rm -f $(VENV)/.installed-*
	@touch $@

run: setup
	@S=$$($(BIN)/pie-media samples); \
	echo "== pie-media inspect: what the media layer sees (and the tiny Qwen3-VL's token budget)"; \
	$(BIN)/pie-media inspect --model tiny --max-frames 4 $$S/images/photo_640x480.jpg $$S/images/rgba.png \
		$$S/images/exif_rotated_6.jpg $$S/audio/tone_44k1_stereo.mp3 $$S/video/h264_320x240_30fps_3s.mp4 \
		$$S/video/animated_160x120_10fps_2s.gif $$S/hostile/image_truncated.jpg; \
	echo "(non-zero exit above is expected: audio on Qwen3-VL and a truncated JPEG are typed errors)"; \
	echo "== pie-media caption: tiny random-weight model, so the words are meaningless"; \
	$(BIN)/pie-media caption --max-tokens 12 $$S/images/photo_640x480.jpg $$S/images/rgba.png $$S/images/cmyk.jpg; true

test: setup
	@$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile $(if $(PYTEST_MARKS),-m "$(PYTEST_MARKS)") $(PYTEST_ARGS)

lint: setup
	@$(BIN)/ruff check .
	@$(BIN)/ruff format --check .

bench: setup
	@$(BIN)/python bench/media_decode.py

clean:
	rm -rf $(VENV) .cache

# On the GPU machine: install carried wheels, CUDA tests, GPU bench (bench/gpu/check.sh).
gpu-check:
	@bash bench/gpu/check.sh $(OUT)
