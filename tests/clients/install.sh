#!/usr/bin/env bash
# Installs, from nothing and idempotently, what the other-language protocol clients need:
#   - the Debian packages libzmq3-dev and libmsgpack-dev (C client), only if missing;
#   - the npm packages of tests/clients/node (zeromq, @msgpack/msgpack), only if missing;
#   - the C client binary tests/clients/c/build/rfclient.
# Needs node/npm, a C compiler, make and pkg-config; apt-get runs as root (or via sudo).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"

need_apt=()
for pkg in libzmq3-dev libmsgpack-dev; do
    if ! dpkg -s "$pkg" >/dev/null 2>&1; then
        need_apt+=("$pkg")
    fi
done
for tool in pkg-config make gcc; do
    if ! command -v "$tool" >/dev/null 2>&1; then
        case "$tool" in
            gcc) need_apt+=(gcc libc6-dev) ;;
            *) need_apt+=("$tool") ;;
        esac
    fi
done
if ((${#need_apt[@]})); then
    sudo=""
    if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
    echo "install.sh: apt-get install ${need_apt[*]}"
    $sudo apt-get update -q
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "${need_apt[@]}"
fi

if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
    echo "install.sh: node and npm are required (Node.js >= 18)" >&2
    exit 1
fi
cd "$here/node"
if ! node -e 'require("zeromq"); require("@msgpack/msgpack")' >/dev/null 2>&1; then
    echo "install.sh: npm install in tests/clients/node"
    npm install --no-audit --no-fund --loglevel=error
    node -e 'require("zeromq"); require("@msgpack/msgpack")'
fi

make -s -C "$here/c"
