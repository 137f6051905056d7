#!/usr/bin/env bash
# Builds the documentation site (mkdocs.yml, docs/) with warnings as errors: a broken link or
# anchor, a page missing from the site, a missing CSV or plot a page quotes, or a docstring the
# API reference cannot read fails it. The Python API pages are read from the sources, the C++
# pages from include/fusedloss/, the benchmark tables from bench/results/ (docs/hooks/).
# Python: as launch/quickstart.sh (launch/python_env.sh); the documentation tools come from the
# package's [docs] extra unless FUSEDLOSS_OFFLINE=1. Site: build/docs-site/.
# FUSEDLOSS_REPORTS=<dir>: the result for launch/test_summary.py goes there (docs.json).
set -uo pipefail
cd "$(dirname "$0")/.."
source launch/python_env.sh
if [ "${FUSEDLOSS_OFFLINE:-0}" != 1 ]; then
  "$PY" -m pip install -q "mkdocs>=1.6" "mkdocs-material>=9.5" "mkdocstrings-python>=1.10" || exit 1
fi
mkdir -p build
start=$SECONDS
NO_MKDOCS_2_WARNING=1 "$PY" -m mkdocs build --strict --clean -f mkdocs.yml -d build/docs-site \
  > build/docs.log 2>&1
rc=$?
seconds=$((SECONDS - start))
pages=$(find build/docs-site -name index.html -not -path "*/assets/*" 2>/dev/null | wc -l)
if [ $rc -eq 0 ]; then
  echo "docs: built $pages pages into build/docs-site in ${seconds} s (mkdocs build --strict)"
else
  grep -E "WARNING|ERROR|Error|Aborted" build/docs.log | head -30
  echo "docs: FAILED (mkdocs build --strict, exit $rc; build/docs.log)"
fi
if [ -n "${FUSEDLOSS_REPORTS:-}" ]; then
  problems=$(grep -E "WARNING|ERROR" build/docs.log | head -20 | "$PY" -c 'import json, sys; print(json.dumps([l.strip() for l in sys.stdin]))')
  echo "{\"status\": \"$([ $rc -eq 0 ] && echo passed || echo failed)\", \"pages\": $pages, \"seconds\": $seconds, \"problems\": $problems}" \
    > "$FUSEDLOSS_REPORTS/docs.json"
fi
exit $rc
