.PHONY: install test lint format docs docs-check typecheck build bench demo

install:
	python -m pip install torch==2.13.0 && python -m pip install -e ".[test,bench,zoo,docs]"

test:
	python -m pytest

lint:
	python -m ruff check src tests benchmarks docs/_tools .ci/typecheck.py && python -m ruff format --check src tests benchmarks docs/_tools .ci/typecheck.py

format:
	python -m ruff format src tests benchmarks docs/_tools .ci/typecheck.py

# The API reference site, into site/ (needs the docs extra: pip install -e ".[docs]").
docs:
	NO_MKDOCS_2_WARNING=1 python -m mkdocs build

# The same with every warning an error (broken links and anchors included), then check that
# every public name has its entry.
docs-check:
	NO_MKDOCS_2_WARNING=1 python -m mkdocs build --strict && python docs/_tools/check_site.py site

# mypy over the package (0 errors), then mypy and pyright on the public API and on README's
# examples (needs the typecheck extra).
typecheck:
	python -m mypy && python .ci/typecheck.py

# sdist and wheel into dist/, checked by twine (needs the release extra).
build:
	rm -rf dist && python -m build && python -m twine check --strict dist/*

bench:
	python -m modstate bench

demo:
	python -m modstate demo
