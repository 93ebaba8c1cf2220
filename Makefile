# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU wheel; a bare `torch` requirement would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	# torch named again: without it, pip's resolver may swap in a newer CUDA build
	$(PY) -m pip install -q -e '.[dev]' torch==2.13.0
	touch $(STAMP)

demo: $(STAMP)
	mkdir -p bench-out
	$(PY) -m lcckpt bench --quick --json bench-out/demo.json --plot bench-out/demo.png

# Test files spread over up to 4 processes (one per core), each file whole in one of them,
# so that a module's fixture (two ranks, a training run) runs once.
test: $(STAMP)
	$(PY) -m pytest -q -n auto --maxprocesses 4 --dist loadfile

bench: $(STAMP)
	mkdir -p bench-out
	$(PY) -m lcckpt bench --tables --json bench-out/codec.json --plot bench-out/codec.png

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
