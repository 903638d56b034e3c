# The README's two commands: `make demo` (install, then run the main job) and `make test`
# (install, then run the test suite). Both create .venv on first use via scripts/setup.sh.
VENV ?= .venv
PYTHON := $(VENV)/bin/python
STAMP := $(VENV)/.posttrain-installed
ARGS ?=
PYTEST_ARGS ?=

.PHONY: install demo test lint clean

install: $(STAMP)

$(STAMP): pyproject.toml scripts/setup.sh
	bash scripts/setup.sh $(VENV) dev
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/posttrain demo $(ARGS)

test: $(STAMP)
	$(PYTHON) -m pytest -q $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache .hypothesis
