# mailrelay: `make run` starts everything; `make test` runs the test suite.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# What is installed: the relay's own dependencies (run), or those and the
# tests', linter's and benchmarks' (dev, pyproject's `dev` extra).
RUN_STAMP := $(VENV)/.installed-run
DEV_STAMP := $(VENV)/.installed-dev

# Tests run against the real services (see README "Tests").
TEST_DATABASE_URL ?= postgres://postgres@127.0.0.1:5432/mailrelay
TEST_BROKER_URL ?= redis://127.0.0.1:6379/14

.PHONY: venv dev-venv run demosink test lint format migrate clean

venv: $(RUN_STAMP)
dev-venv: $(DEV_STAMP)

# Every dependency at the version we test with (constraints.txt): a new release
# upstream cannot change what `make run` installs.
$(RUN_STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e .
	touch $(RUN_STAMP)

$(DEV_STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(RUN_STAMP) $(DEV_STAMP)

run: venv
	$(BIN)/python manage.py runall

# A local SMTP receiver that prints what it gets (README "Try it").
demosink: venv
	$(BIN)/python manage.py demosink

migrate: venv
	$(BIN)/python manage.py migrate

test: dev-venv
	DATABASE_URL=$${DATABASE_URL:-$(TEST_DATABASE_URL)} \
	CELERY_BROKER_URL=$${CELERY_BROKER_URL:-$(TEST_BROKER_URL)} \
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: dev-venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: dev-venv
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) var .pytest_cache
