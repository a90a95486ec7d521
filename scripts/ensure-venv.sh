#!/bin/sh
# Make sure `$PY -m venv` can work: it needs the ensurepip module, which Debian and Ubuntu
# leave out of their python3 and ship in python3.X-venv. Installed with apt when we are
# root, else one line saying what to install (and the venv is not attempted: it would
# leave a .venv without pip behind).
set -e
py="$1"
if "$py" -c "import ensurepip, venv" 2>/dev/null; then exit 0; fi
pkg=$("$py" -c 'import sys; print("python%d.%d-venv" % sys.version_info[:2])')
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing $pkg (apt), for $py -m venv..."
  if apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$pkg" >/dev/null \
      && "$py" -c "import ensurepip, venv" 2>/dev/null; then
    exit 0
  fi
  echo "ensure-venv: 'apt-get install $pkg' failed; $py -m venv needs it" >&2
  exit 1
fi
echo "ensure-venv: $py has no ensurepip, which '$py -m venv' needs: install $pkg (Debian/Ubuntu: sudo apt-get install $pkg), or run make PY=<another python3>" >&2
exit 1
