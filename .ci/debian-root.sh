#!/usr/bin/env bash
# CI: README's two commands on a fresh, minimal Debian 12, so that no install step or platform
# difference can hide behind this machine's setup. Builds a root with debootstrap (bookworm,
# minbase, plus python3, make and git only), clones the repository into it, and there:
#   1. as a user who may not install packages, `make test` must stop at once with one line
#      saying what to install (ensurepip is python3.11-venv's on Debian);
#   2. as root, `make test` with the LOWEST redis-py of setup.cfg's range (REDIS_PY; the
#      `make test` of .ci/run has the newest), which installs python3.11-venv, redis-server,
#      chromium and Java with apt itself;
#   3. `make demo`, Ctrl-C once a job has completed, and everything must stop (.ci/demo.sh).
# Needs root (debootstrap, chroot, namespaces) and deb.debian.org (DEBIAN_MIRROR) and PyPI.
# Each step runs in mount and PID namespaces of its own (unshare): its /proc and /dev/shm,
# and any process it leaves, end with it; the demo also gets a network of its own (loopback
# only: its port 5000 is nobody else's). The root lives in var/ci-debian inside the checkout
# and is removed on exit: nothing is cached.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD/var/ci-debian
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
start=$(date +%s)
say() { echo "debian-root [$(( $(date +%s) - start ))s]: $*"; }

if [ "$(id -u)" != 0 ]; then echo "debian-root: needs root (debootstrap, chroot, unshare)" >&2; exit 1; fi
lowest=$(sed -n 's/^ *redis\[hiredis\]>=\([0-9.]*\).*/\1/p' setup.cfg)
if [ -z "$lowest" ]; then echo "debian-root: no 'redis[hiredis]>=X' line in setup.cfg" >&2; exit 1; fi

cleanup() {
  set +e  # a cleanup step that finds nothing to do must not stop the rest
  # The namespaces took their mounts with them; unmount anything left all the same before
  # removing the root (rm must never reach through a mount).
  grep -o " $root/[^ ]*" /proc/self/mounts | sort -r | while read -r m; do umount -l "$m" || true; done
  if grep -q " $root/" /proc/self/mounts; then
    echo "debian-root: mounts remain under $root; not removing it" >&2
  else
    rm -rf "$root"
  fi
  rm -f "$root.log"
}
trap cleanup EXIT
rm -rf "$root"
mkdir -p "$root"

if ! command -v debootstrap >/dev/null 2>&1; then
  say "installing debootstrap (apt)"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
fi
say "debootstrap bookworm (minbase + python3, make, git) from $mirror"
if ! debootstrap --variant=minbase --include=python3,make,git bookworm "$root" "$mirror" >"$root.log" 2>&1; then
  tail -20 "$root.log" >&2
  echo "debian-root: debootstrap could not build the root from $mirror (log above)" >&2
  exit 1
fi
rm -f "$root.log"
# The environment of every command in the root: nothing of this machine's but its network's
# settings, as a fresh machine on this network would have them: DNS, proxy variables, and
# the CA bundle that pip and npm must trust here (with a TLS-inspecting proxy's CA; a fresh
# machine's pip trusts the public CAs it carries itself, which this bundle holds too).
cp /etc/resolv.conf "$root/etc/resolv.conf"
chroot_env=(HOME=/root LANG=C.UTF-8 CI=true TERM=dumb DEBIAN_FRONTEND=noninteractive
            PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin)
host_ca=${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}
if [ -f "$host_ca" ]; then
  cp "$host_ca" "$root/etc/host-ca.crt"
  chroot_env+=(PIP_CERT=/etc/host-ca.crt NODE_EXTRA_CA_CERTS=/etc/host-ca.crt npm_config_cafile=/etc/host-ca.crt)
fi
for v in http_proxy https_proxy no_proxy HTTP_PROXY HTTPS_PROXY NO_PROXY; do
  if [ -n "${!v:-}" ]; then chroot_env+=("$v=${!v}"); fi
done
git -c safe.directory="$PWD" clone -q "$PWD" "$root/srv/taskrunner"
mkdir -p "$root/dev/shm"

# in_root [unshare options] -- USER:GROUP COMMAND: COMMAND by sh in /srv/taskrunner, in the
# root, as that user, in the environment above.
in_root() {
  local opts=()
  while [ "$1" != -- ]; do opts+=("$1"); shift; done
  unshare --mount --pid --fork --mount-proc="$root/proc" "${opts[@]}" sh -c '
    root=$0 user=$1 cmd=$2
    shift 2
    mount -t tmpfs -o mode=1777,nosuid,nodev shm "$root/dev/shm"
    mount -t devpts -o newinstance,ptmxmode=0666 devpts "$root/dev/pts"  # apt and chromium want ptys
    if [ -n "${NET_LO:-}" ]; then ip link set lo up; fi
    exec chroot --userspec="$user" "$root" /usr/bin/env -i "$@" sh -c "cd /srv/taskrunner && $cmd"
  ' "$root" "$2" "$3" "${chroot_env[@]}"
}

say "1. make test as a user who cannot install: one line saying what to install"
out=$(in_root -- nobody:nogroup 'make test 2>&1' || true)
echo "$out" | sed 's/^/    /'
if ! echo "$out" | grep -q "ensure-venv: .*install python3.11-venv" || [ -e "$root/srv/taskrunner/.venv" ]; then
  echo "debian-root: make test without ensurepip did not say to install python3.11-venv" >&2
  exit 1
fi

say "2. make test REDIS_PY=$lowest as root (installs what it needs with apt)"
# The tests that talk to Redis through redis-py in every way taskrunner does (URLs, TLS,
# Sentinel, Cluster, asyncio, scripts, pipelines, outages, the CLI and the dashboard), not the
# whole suite, which .ci/run's first `make test` has just run: CI must end within 25 minutes
# (the whole suite takes some 16 of them on 2 cores; the rest of it exercises Parquet, a JVM,
# browsers, packaging and process supervision the same with either redis-py).
second_run=""
for t in urls redis_py waits sentinel cluster redis_restart sleeps designs scripts protocol cli failures \
    foreign_consumer declarations steps api dashboard workflows flow flow_limits hostile; do
  second_run="$second_run tests/test_$t.py"
done
in_root -- root:root "PYTEST_ADDOPTS='$second_run' make test REDIS_PY=$lowest && .venv/bin/python -c 'import redis; print(\"redis-py\", redis.__version__)'"

say "3. make demo, Ctrl-C after a job completed"
NET_LO=1 in_root --net -- root:root "bash .ci/demo.sh"
say "done"
