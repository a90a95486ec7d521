#!/usr/bin/env bash
# CI: README's `make demo` as a user runs it: start it, wait until a job has completed, press
# Ctrl-C (SIGINT to the whole process group, as a terminal does), and check that everything
# stopped cleanly within 60 s: the stack said so, and no process is left in this checkout.
# Run from the checkout, after `make setup` (.ci/debian-root.sh runs it in a fresh Debian).
set -u
log=var/demo.log
if [ -e var/appendonlydir ]; then echo "demo: var/ holds an earlier run's Redis data; run from a fresh checkout" >&2; exit 1; fi
mkdir -p var
set -m  # job control: make gets a process group of its own, and SIGINT not ignored as a plain & would
make demo >"$log" 2>&1 &
pid=$!
set +m
fail() {
  echo "demo: $*" >&2
  sed 's/^/    /' "$log" >&2
  kill -INT -- "-$pid" 2>/dev/null && sleep 30  # let `up` stop its redis-server (a session of its own)
  kill -KILL -- "-$pid" 2>/dev/null
  exit 1
}
completed() {
  .venv/bin/taskrunner queues --json 2>/dev/null \
    | .venv/bin/python -c 'import json, sys; sys.exit(not any(q["completed"] for q in json.load(sys.stdin)))'
}
pgrp() { sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f3; }  # after comm: state ppid pgrp
ours=$(pgrp $$)
leftovers() {  # processes in this checkout outside this script's process group (redis-server has a session of its own)
  for p in /proc/[0-9]*; do
    case "$(readlink "$p/cwd" 2>/dev/null)" in
      "$PWD"|"$PWD"/*) [ "$(pgrp "${p#/proc/}")" != "$ours" ] && tr '\0' ' ' <"$p/cmdline" && echo ;;
    esac
  done
}
i=0
until [ -S var/redis.sock ] && completed; do
  i=$((i + 1))
  if [ $i -gt 240 ]; then fail "no job completed within 120 s"; fi
  if ! kill -0 "$pid" 2>/dev/null; then fail "make demo exited before a job completed"; fi
  sleep 0.5
done
echo "demo: a job completed; Ctrl-C"
kill -INT -- "-$pid"
i=0
while kill -0 -- "-$pid" 2>/dev/null; do
  i=$((i + 1))
  if [ $i -gt 120 ]; then fail "still running 60 s after Ctrl-C"; fi
  sleep 0.5
done
left=$(leftovers)
if [ -n "$left" ]; then fail "left running after Ctrl-C: $left"; fi
grep -q "redis-server stopped" "$log" || fail "the stack did not say it stopped Redis"
if grep -q "Traceback" "$log"; then fail "a traceback in the output"; fi
sed 's/^/    /' "$log"
echo "demo: stopped cleanly"
