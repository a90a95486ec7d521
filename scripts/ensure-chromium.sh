#!/bin/sh
# Make sure a `chromium` binary exists for the browser tests (tests/test_browser.py): Debian's
# package, installed with apt-get when we are root. Playwright drives that binary; its own
# browser downloads (`playwright install`) are not used.
set -e
if command -v chromium >/dev/null 2>&1; then exit 0; fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing chromium (apt)..."
  if apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null \
      && command -v chromium >/dev/null 2>&1; then
    exit 0
  fi
  echo "ensure-chromium: 'apt-get install chromium' failed; the browser tests will be skipped (or fail under CI)" >&2
  exit 1
fi
echo "ensure-chromium: no chromium on PATH and cannot install it (needs root and apt-get)." >&2
echo "  Install your distribution's chromium package; the browser tests are skipped without it (or fail under CI)." >&2
exit 1
