#!/bin/sh
# A Sentinel rewrites its own configuration file, so it lives on a writable volume (mode 0600: it
# holds the password). Two of the three Sentinels must agree before a failover. A Sentinel that voted
# in an election that did not finish (a split vote, a leader that stalled) tries no failover of its own
# for twice failover-timeout: 10 s keeps that retry 20 s away rather than minutes (bench/sentinel_election.py).
set -eu
self="$(hostname).openjev-redis"
master="$(sh /scripts/find-master.sh)"
umask 077
cat > /sentinel/sentinel.conf <<CONF
port 26379
sentinel resolve-hostnames yes
sentinel announce-hostnames yes
sentinel announce-ip $self
requirepass $REDIS_PASSWORD
sentinel sentinel-pass $REDIS_PASSWORD
sentinel monitor openjev $master 6379 2
sentinel auth-pass openjev $REDIS_PASSWORD
sentinel down-after-milliseconds openjev 5000
sentinel failover-timeout openjev 10000
sentinel parallel-syncs openjev 1
CONF
exec redis-server /sentinel/sentinel.conf --sentinel
