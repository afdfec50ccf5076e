#!/bin/sh
# The README's Redis rules: an append-only file fsynced every second, no eviction, a password. The
# configuration goes in on stdin so the password never shows on a command line. maxmemory stays under the
# container's 4Gi limit (redis.yaml) with room for an AOF rewrite's copied pages and the clients' buffers: a
# flood of jobs is refused with 503s (the API stops short of it) instead of the kubelet killing Redis.
set -eu
self="$(hostname).openjev-redis"
master="$(sh /scripts/find-master.sh)"
replicaof=""
if [ "$master" != "$self" ]; then
    replicaof="replicaof $master 6379"
fi
exec redis-server - <<CONF
dir /data
appendonly yes
appendfsync everysec
save ""
maxmemory 3gb
maxmemory-policy noeviction
protected-mode yes
requirepass $REDIS_PASSWORD
masterauth $REDIS_PASSWORD
replica-announce-ip $self
$replicaof
CONF
