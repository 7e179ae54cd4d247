#!/usr/bin/env bash
# A Docker engine of the project's own, for `make test-compose`: `engine.sh start` starts Debian's dockerd on its own
# socket, data and exec folders (never the system's), with no bridge and no iptables rules, so that containers can use
# the host's network only and every packet stays on 127.0.0.1; `engine.sh stop` stops it and what it started.
# Prints nothing but errors; the socket is $SPECSERVE_DOCKER_DIR/docker.sock (DOCKER_HOST=unix://...).
set -euo pipefail
DIR=${SPECSERVE_DOCKER_DIR:-/var/tmp/specserve-docker}
SOCKET="$DIR/docker.sock"
PIDFILE="$DIR/dockerd.pid"

running() { [ -f "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2> /dev/null; }

case "${1:-}" in
start)
    if running; then exit 0; fi
    command -v dockerd > /dev/null || { echo "engine.sh: dockerd is missing (Debian's docker.io)" >&2; exit 1; }
    mkdir -p "$DIR/data" "$DIR/exec"
    # Its own containerd too (dockerd starts one under --exec-root when none is given).
    nohup dockerd --host "unix://$SOCKET" --data-root "$DIR/data" --exec-root "$DIR/exec" --pidfile "$PIDFILE" \
        --bridge=none --iptables=false --ip6tables=false --ip-masq=false --userland-proxy=false \
        > "$DIR/dockerd.log" 2>&1 &
    for _ in $(seq 120); do
        if DOCKER_HOST="unix://$SOCKET" docker info > /dev/null 2>&1; then exit 0; fi
        sleep 0.5
    done
    echo "engine.sh: dockerd did not answer within 60 s; its log:" >&2
    tail -n 30 "$DIR/dockerd.log" >&2
    exit 1
    ;;
stop)
    if running; then
        pid=$(cat "$PIDFILE")
        kill -TERM "$pid"
        for _ in $(seq 60); do kill -0 "$pid" 2> /dev/null || break; sleep 0.5; done
        if kill -0 "$pid" 2> /dev/null; then
            echo "engine.sh: dockerd ($pid) did not stop within 30 s; killed" >&2
            kill -KILL "$pid"
        fi
    fi
    # What it leaves mounted (its network namespace file, a bind mount of its data folder), deepest first.
    awk -v dir="$DIR/" 'index($2, dir) == 1 { print $2 }' /proc/mounts | sort -r | while read -r mount; do
        umount "$mount" 2> /dev/null || umount -l "$mount"
    done
    ;;
*)
    echo "usage: engine.sh start|stop" >&2
    exit 2
    ;;
esac
