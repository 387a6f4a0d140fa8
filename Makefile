# The two README commands: `make demo` and `make test`. Each makes .venv when
# missing and installs what it needs. TORCH selects the torch requirement, e.g.
#   make test TORCH=torch==2.13.0
# and TORCH_INDEX the index torch alone comes from, e.g. PyTorch's CPU builds:
#   make test TORCH_INDEX=https://download.pytorch.org/whl/cpu
PYTHON ?= python3
VENV ?= .venv
TORCH ?=
TORCH_INDEX ?=
PYTEST_ARGS ?=
PY := $(VENV)/bin/python
WITH_EXTRAS := .[test,mujoco,sb3]

.PHONY: test demo verify bench bench-quick install sysdeps lint clean mutation

# --clear: a .venv left without a working python (a cut venv step, a removed base
# interpreter) is made again.
$(PY):
	$(PYTHON) -m venv --clear $(VENV)
	$(PY) -m pip install -q --upgrade pip

# torch (alone from TORCH_INDEX, when given), then the package as $(1) names it.
define install_package
	$(if $(TORCH_INDEX),$(PY) -m pip install -q --index-url "$(TORCH_INDEX)" "$(or $(TORCH),torch)")
	$(PY) -m pip install -q $(if $(TORCH),"$(TORCH)") -e "$(1)"
endef

install: $(PY)
	$(call install_package,$(WITH_EXTRAS))

# System packages for the SPIN checks and SVG diagrams, installed when missing.
sysdeps:
	@missing=""; \
	command -v spin >/dev/null || missing="$$missing spin"; \
	command -v gcc >/dev/null || missing="$$missing gcc"; \
	command -v dot >/dev/null || missing="$$missing graphviz"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing$$missing"; \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing) >/dev/null \
	      || echo "could not install$$missing with apt-get (SPIN tests skip without them)"; \
	  else \
	    echo "missing$$missing: run 'sudo apt-get install$$missing' (SPIN tests skip without them)"; \
	  fi; \
	fi

test: install sysdeps
	$(PY) -m pytest $(PYTEST_ARGS)

demo: $(PY)  # the package alone: the demo needs none of the extras
	$(call install_package,.)
	$(VENV)/bin/replay-fsm demo

# The checks of the deep tier, which CI's time does not fit, with the model checks and
# the bounded mutation checks CI runs: every SPIN claim and witness at ring depths 2
# and 3, every broken model at depth 2, the refinement check against the real core,
# every case of the request channel's model,
# the hand-written and sampled mutants, the benchmarks' quick runs, then every other
# test of the deep tier (long bounds waited out, repeated cases); then the mutation
# figures: those of the local mutmut run when mutants/ holds one, else the recorded ones.
VERIFY_TESTS = tests/test_spin.py tests/test_spin_broken.py tests/test_refinement.py \
  tests/test_mutation_sample.py tests/test_mutations.py tests/test_benchmarks.py \
  tests/test_channel_model.py
verify: install sysdeps
	REPLAY_FSM_SLOW=1 REPLAY_FSM_DEEP=1 $(PY) -m pytest $(VERIFY_TESTS)
	REPLAY_FSM_SLOW=1 REPLAY_FSM_DEEP=1 $(PY) -m pytest -m deep tests \
	  $(addprefix --ignore=,$(VERIFY_TESTS))
	@if [ -d mutants ]; then $(PY) -m tests.mutation_report || true; \
	else sed -n '/^## Figures/,/^## Equivalent/p' specs/MUTATION.md; fi

bench: install
	$(PY) -m pip install -q torchrl || echo "torchrl unavailable: its rows will say so"
	$(PY) benchmarks/run_all.py

bench-quick: install
	$(PY) benchmarks/run_all.py --quick

# Mutation testing (specs/MUTATION.md): mutmut over the modules [tool.mutmut] names in
# pyproject.toml, the fast tier as the tests; hours on 2 cores. It resumes where it
# stopped (results live in mutants/; `make clean` drops them), then prints the figures
# per module and checks that every survivor is listed in specs/MUTATION.md.
mutation: install sysdeps
	$(PY) -m pip install -q "mutmut>=3.8,<4"
	env -u CI -u REPLAY_FSM_SLOW -u REPLAY_FSM_DEEP HYPOTHESIS_PROFILE=mutation $(VENV)/bin/mutmut run
	$(PY) -m tests.mutation_report

lint: install
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -m ruff check replay_fsm tests benchmarks
	$(PY) -m mypy replay_fsm

clean:
	rm -rf $(VENV) .hypothesis .pytest_cache .mypy_cache .ruff_cache demo-out mutants \
	  replay_fsm.egg-info build benchmarks/results/*-quick.*
