#!/usr/bin/env bash
# Runs "$@" with a private Docker daemon answering on DOCKER_HOST, so that the tests start their
# Redis servers with testcontainers (harness/redis_servers.py) instead of the local binary.
#
# No image registry is reachable from CI: the Redis image is imported from Debian's Redis binary
# and the libraries it links. The daemon changes no firewall rule and no sysctl
# (--iptables/--ip-forward/--ip-masq off), publishes ports on loopback only, and has its own
# bridge, socket and directories. Everything it made is removed on every way out of this script:
# containers, the daemon and its containerd, mounts, the bridge, the directories.
set -euo pipefail

now() { date +%s.%N; }
seconds() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'; }
started=$(now)

if ! command -v dockerd >/dev/null 2>&1; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker.io >/dev/null
fi
installed=$(now)

work=$(mktemp -d "${TMPDIR:-/tmp}/openjev-docker.XXXXXX")
bridge="ojv$$"                        # interface names stop at 15 characters
export DOCKER_HOST="unix://$work/docker.sock"
dockerd_pid=""

cleanup() {
    cleanup_started=$(now)
    if [ -n "$dockerd_pid" ]; then
        docker ps -aq | xargs -r docker rm -f >/dev/null 2>&1 || true
        docker network ls -q --filter type=custom | xargs -r docker network rm >/dev/null 2>&1 || true
        kill -TERM "$dockerd_pid" 2>/dev/null || true
        for _ in $(seq 150); do kill -0 "$dockerd_pid" 2>/dev/null || break; sleep 0.2; done
        kill -KILL "$dockerd_pid" 2>/dev/null || true
        wait "$dockerd_pid" 2>/dev/null || true
    fi
    # dockerd stops the containerd it started, except when it had to be killed.
    if [ -f "$work/exec/containerd/containerd.pid" ]; then
        kill -KILL "$(cat "$work/exec/containerd/containerd.pid")" 2>/dev/null || true
    fi
    grep -o " $work/[^ ]*" /proc/mounts | sort -r | xargs -r umount -l 2>/dev/null || true
    ip link del "$bridge" 2>/dev/null || true
    rm -rf "$work"
    echo "with-docker: cleanup $(seconds "$cleanup_started" "$(now)") s"
}
trap cleanup EXIT
# A signal ends the script through its EXIT trap (bash skips the trap when a signal kills it).
trap 'exit 130' INT
trap 'exit 143' TERM

# The daemon's own bridge, so that no docker0 is created (or, on a machine that has one, deleted).
ip link add name "$bridge" type bridge
ip addr add "10.213.$(($$ % 250)).1/24" dev "$bridge"
ip link set "$bridge" up

dockerd --data-root "$work/data" --exec-root "$work/exec" --pidfile "$work/dockerd.pid" \
    --host "$DOCKER_HOST" --bridge "$bridge" --ip 127.0.0.1 \
    --iptables=false --ip-forward=false --ip-masq=false >"$work/dockerd.log" 2>&1 &
dockerd_pid=$!
for _ in $(seq 150); do docker info >/dev/null 2>&1 && break; sleep 0.2; done
if ! docker info >/dev/null 2>&1; then
    tail -n 40 "$work/dockerd.log" >&2
    echo "with-docker: dockerd did not answer within 30 s" >&2
    exit 1
fi
daemon_up=$(now)

# The Redis image: Debian's server binary (the redis-tools package carries it as redis-check-rdb;
# it runs as a server when started under the name redis-server), redis-cli for health checks, and
# what ldd says they link.
image="openjev-ci/redis:7"
(cd "$work" && { apt-get download -qq redis-tools libjemalloc2 liblzf1 2>/dev/null \
    || { apt-get update -qq && apt-get download -qq redis-tools libjemalloc2 liblzf1; }; })
for deb in "$work"/*.deb; do dpkg -x "$deb" "$work/debs"; done
rootfs="$work/rootfs"
mkdir -p "$rootfs/data" "$rootfs/tmp"
chmod 1777 "$rootfs/tmp"
install -D "$work/debs/usr/bin/redis-check-rdb" "$rootfs/usr/local/bin/redis-server"
install -D "$work/debs/usr/bin/redis-cli" "$rootfs/usr/local/bin/redis-cli"
for binary in redis-server redis-cli; do
    for lib in $(LD_LIBRARY_PATH="$work/debs/usr/lib/x86_64-linux-gnu" ldd "$rootfs/usr/local/bin/$binary" \
                 | grep -o '/[^ ]*'); do
        install -D "$(readlink -f "$lib")" "$rootfs${lib#"$work/debs"}"
    done
done
tar -C "$rootfs" -c . | docker import --change 'CMD ["redis-server", "--protected-mode", "no"]' \
    --change 'WORKDIR /data' --change 'EXPOSE 6379' - "$image" >/dev/null
if ! docker run --rm "$image" redis-server --version 2>"$work/run.err"; then
    cat "$work/run.err" >&2
    exit 1
fi
image_built=$(now)

export OPENJEV_TEST_REDIS_IMAGE="$image"
# CI means it: a test that needs Redis fails rather than falling back to the local binary.
export OPENJEV_REQUIRE_DOCKER=1
# Ryuk's image cannot be pulled (the tests remove their own containers, and cleanup the rest).
# This machine may itself be a container (/.dockerenv): without the override testcontainers would
# dial the bridge gateway instead of the loopback port the daemon publishes.
export TESTCONTAINERS_RYUK_DISABLED=true TESTCONTAINERS_HOST_OVERRIDE=127.0.0.1 \
    TESTCONTAINERS_CONNECTION_MODE=docker_host
echo "with-docker: install $(seconds "$started" "$installed") s," \
    "daemon $(seconds "$installed" "$daemon_up") s, redis image $(seconds "$daemon_up" "$image_built") s"

# In the background, so that a signal reaches the trap while the command runs.
"$@" &
command_pid=$!
trap 'kill -TERM "$command_pid" 2>/dev/null; wait "$command_pid"; exit 130' INT
trap 'kill -TERM "$command_pid" 2>/dev/null; wait "$command_pid"; exit 143' TERM
wait "$command_pid"
