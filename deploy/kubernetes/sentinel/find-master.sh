#!/bin/sh
# Prints the master's host: the one any Sentinel names, else pod 0 (a first start, or every Sentinel
# gone), so a restarted pod rejoins as a replica of the current master instead of splitting the queue.
for i in 0 1 2; do
    host=$(REDISCLI_AUTH="$REDIS_PASSWORD" timeout 3 redis-cli -h "openjev-redis-$i.openjev-redis" -p 26379 \
        sentinel get-master-addr-by-name openjev 2>/dev/null | head -n 1)
    case "$host" in
        ""|*ERR*|*NOAUTH*) ;;
        *) echo "$host"; exit 0 ;;
    esac
done
echo openjev-redis-0.openjev-redis
