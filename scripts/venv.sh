# Sourced by scripts/demo and scripts/test: make .venv and install the project with the given extras.
# usage: install_project "[test]"   (or "" for the plain install)
install_project() {
    local extras=${1:-}
    local python=${PYTHON:-python3}
    if [ ! -x .venv/bin/python ]; then
        if ! "$python" -c 'import ensurepip, venv' 2>/dev/null; then
            # Debian ships venv separately; install it when we may.
            if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
                echo "installing python3-venv (Debian)" >&2
                DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
                DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >&2
            else
                echo "error: $python has no venv module; install it (Debian: apt-get install python3-venv)" >&2
                return 1
            fi
        fi
        "$python" -m venv .venv
    fi
    # pip's own chatter goes to a log; its errors still stop the script.
    local log=.venv/pip-install.log
    if ! { .venv/bin/python -m pip install --upgrade pip && .venv/bin/python -m pip install -e ".${extras}"; } \
        >"$log" 2>&1; then
        grep -v '^WARNING: Location' "$log" | tail -30 >&2
        echo "error: pip install failed (full log: $log)" >&2
        return 1
    fi
}
