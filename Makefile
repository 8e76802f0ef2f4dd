.PHONY: install test lint bench demo

install:
	python -m pip install torch==2.13.0 && python -m pip install -e ".[test,bench]"

test:
	python -m pytest

lint:
	python -m ruff check src tests benchmarks && python -m ruff format --check src tests benchmarks

bench:
	python -m modstate bench

demo:
	python -m modstate demo
