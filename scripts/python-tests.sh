#!/usr/bin/env bash
# The Python suite: builds the `devbridge` module into the project venv
# (.venv, made by scripts/setup.sh) and runs tests/python with pytest.
#
# Offline: build isolation is off, so the build uses the venv's own
# scikit-build-core and nanobind, and the module's dependencies are already
# there. The build directory persists (build/python-venv), so a rebuild only
# recompiles what changed.
#
# DEVBRIDGE_TEST_BACKEND=cuda also runs the CUDA cases (a GPU machine); then
# an unavailable CUDA backend fails the run instead of being skipped.
# --build-only builds and installs the module and stops (for `make bench`).
# Other arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

python=.venv/bin/python
if [ ! -x "$python" ]; then
  echo "python-tests: no .venv here; run 'make setup' (scripts/setup.sh) first" >&2
  exit 1
fi

mkdir -p build
echo "python-tests: building the devbridge module into .venv"
if ! "$python" -m pip install --no-build-isolation --no-deps --disable-pip-version-check -q \
    -C build-dir=build/python-venv -C cmake.define.DEVBRIDGE_WITH_CUDA=ON . >build/python-install.log 2>&1; then
  cat build/python-install.log >&2
  echo "python-tests: building the module failed (log above, also in build/python-install.log)" >&2
  exit 1
fi

if [ "${1:-}" = "--build-only" ]; then
  echo "python-tests: devbridge installed in .venv"
  exit 0
fi

backend="${DEVBRIDGE_TEST_BACKEND:-host}"
echo "python-tests: running tests/python (DEVBRIDGE_TEST_BACKEND=$backend)"
status=0
# The installed module is what is tested (python/ is not on sys.path).
DEVBRIDGE_TEST_BACKEND="$backend" "$python" -m pytest tests/python -q -p no:cacheprovider "$@" || status=$?
if [ "$status" -eq 5 ]; then
  echo "python-tests: pytest collected no tests; that is a failure" >&2
  exit 1
fi
exit "$status"
