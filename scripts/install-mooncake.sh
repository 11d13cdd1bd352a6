#!/bin/sh
# The remote tier's dependencies (`kvshare pool --remote`, its tests): the `mooncake` extra,
# and libibverbs1, the one system library Mooncake's wheel needs that a bare machine lacks
# (installed with apt-get when running as root; otherwise a message, and the remote-tier
# tests skip). Never fails the install: the tier is optional.
set -u
VENV=${VENV:-.venv}
PY="$VENV/bin/python"

has_ibverbs() {
    ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1'
}

if ! has_ibverbs; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "installing libibverbs1 (Mooncake's transfer engine needs it)"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q libibverbs1 >/dev/null \
            || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q libibverbs1 >/dev/null; } \
            || echo "could not install libibverbs1: the remote-tier tests will skip"
    else
        echo "libibverbs1 is missing and this is not root with apt-get: install it" \
            "(apt-get install libibverbs1) to run the remote tier; its tests skip until then"
    fi
fi
"$PY" -m pip install -q -e '.[mooncake]' \
    || echo "could not install kvshare[mooncake]: the remote-tier tests will skip"
"$PY" -c "import mooncake.store" 2>/dev/null \
    && echo "Mooncake: available (kvshare pool --remote)" \
    || echo "Mooncake: not importable here; the remote-tier tests will skip"
