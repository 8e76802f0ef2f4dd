#!/usr/bin/env bash
# The wheel in dist/, installed in a fresh virtual environment (no system site-packages) the way
# a user installs it: torch pinned first, then the wheel and its dependencies. It must import,
# answer --version, run the demo with nothing on stderr (no "Failed to initialize NumPy"), and
# `bench` must say in one line that it needs a source checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
wheel=$(ls dist/modstate-*.whl)
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
started=$SECONDS
python -m venv "$scratch/venv"
py="$scratch/venv/bin/python"
quiet_pip() {  # this machine's pip configuration names index folders that may be absent
    "$py" -m pip install -q "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
    return "${PIPESTATUS[0]}"
}
quiet_pip torch==2.13.0
quiet_pip "$wheel"
echo "fresh venv: torch and the wheel installed in $((SECONDS - started)) s"
cd "$scratch"  # away from the checkout: only the installed package is importable
"$py" -c "import modstate, sys; assert 'site-packages' in modstate.__file__, modstate.__file__"
"$py" -m modstate --version
"$scratch/venv/bin/modstate" --version
"$py" -m modstate demo --steps 60 --no-progress >demo.out 2>demo.err
if [ -s demo.err ]; then
    echo "fresh venv: the demo wrote to stderr:" >&2
    cat demo.err >&2
    exit 1
fi
head -1 demo.out
set +e
"$py" -m modstate bench >bench.out 2>bench.err
code=$?
set -e
if [ "$code" != 2 ] || ! grep -q "needs a source checkout" bench.err || [ "$(wc -l <bench.err)" != 1 ]; then
    echo "fresh venv: bench from a wheel should say in one line that it needs a checkout" >&2
    cat bench.out bench.err >&2
    exit 1
fi
echo "fresh venv: demo ran without warnings; bench says it needs a source checkout"
