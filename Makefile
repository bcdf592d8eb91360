.PHONY: install train test lint

install:
	pip install torch==2.13.0 -e '.[dev]'

train:
	treegrpo train tiny-multihop

test:
	python -m pytest -q

lint:
	ruff check . && ruff format --check . && mypy treegrpo_ray
