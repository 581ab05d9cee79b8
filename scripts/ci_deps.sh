#!/usr/bin/env bash
# Idempotently install the tools the deploy/observability tests need on a fresh Debian CI machine (root).
#   prometheus + promtool : Debian package `prometheus`
#   yamllint, kubernetes-validate, grafana-foundation-sdk : project .venv (requirements-deploy.txt)
#   checkov : its own venv .venv/checkov (it pins packaging<24, which would downgrade the project venv)
#   buf : npm @bufbuild/buf into .venv/buf
#   kubectl : used if present; tests that need it skip with a reason when it is absent outside CI.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv
CHECKOV_VERSION=3.3.30

if ! command -v promtool >/dev/null || ! command -v prometheus >/dev/null; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
    # The package starts a system Prometheus on :9090 where systemd/init runs; tests use their own.
    service prometheus stop >/dev/null 2>&1 || true
  else
    echo "ci_deps: prometheus/promtool missing and cannot apt-get install (not root or no apt)" >&2
  fi
fi

if ! "$VENV/bin/python" -c "import yamllint, kubernetes_validate, grafana_foundation_sdk" 2>/dev/null; then
  "$VENV/bin/pip" install -q -r requirements-deploy.txt 2> >(grep -v "^WARNING: Location" >&2)
fi

if [ ! -x "$VENV/checkov/bin/checkov" ]; then
  python3 -m venv "$VENV/checkov"
  "$VENV/checkov/bin/pip" install -q "checkov==$CHECKOV_VERSION" 2> >(grep -v "^WARNING: Location" >&2)
fi

# buf (npm @bufbuild/buf) lints protos/ with the STANDARD rules.
BUF_VERSION=1.75.0
if [ ! -x "$VENV/buf/node_modules/.bin/buf" ] && command -v npm >/dev/null; then
  npm install --silent --no-audit --no-fund --prefix "$VENV/buf" "@bufbuild/buf@$BUF_VERSION" >/dev/null
fi

command -v kubectl >/dev/null || echo "ci_deps: kubectl not found; kustomize render tests will skip outside CI" >&2
exit 0
