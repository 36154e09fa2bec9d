# mailrelay: `make run` starts everything; `make test` runs the test suite.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# Tests run against the real services (see README "Tests").
TEST_DATABASE_URL ?= postgres://postgres@127.0.0.1:5432/mailrelay
TEST_BROKER_URL ?= redis://127.0.0.1:6379/14

.PHONY: venv run test lint format migrate clean

venv: $(STAMP)

# Every dependency at the version we test with (constraints.txt): a new release
# upstream cannot change what `make run` installs.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

run: venv
	$(BIN)/python manage.py runall

migrate: venv
	$(BIN)/python manage.py migrate

test: venv
	DATABASE_URL=$${DATABASE_URL:-$(TEST_DATABASE_URL)} \
	CELERY_BROKER_URL=$${CELERY_BROKER_URL:-$(TEST_BROKER_URL)} \
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: venv
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) var .pytest_cache
