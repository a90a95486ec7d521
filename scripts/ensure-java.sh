#!/bin/sh
# Java 17+ for PySpark: the OS package when we may install it (root + apt).
set -e
if command -v java >/dev/null 2>&1; then exit 0; fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing Java (apt)..."
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openjdk-17-jre-headless >/dev/null
  command -v java >/dev/null 2>&1 && exit 0
fi
echo "no java found: install a Java 17+ runtime (Debian: apt-get install openjdk-17-jre-headless) for taskrunner analyze" >&2
exit 1
