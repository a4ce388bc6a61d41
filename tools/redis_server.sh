#!/usr/bin/env bash
# A throwaway Redis (or Valkey) server for tests, CI and benchmarks: 127.0.0.1 only, no persistence, LRU eviction.
#
#   tools/redis_server.sh install              install Debian's redis-server if no server binary is found
#                                              (needs root and apt-get; a no-op when one is installed)
#   tools/redis_server.sh start [PORT] [MAXMEMORY]
#                                              start one in the background (default: a free port, 256mb);
#                                              prints "URL PIDFILE" (e.g. redis://127.0.0.1:40123/0 /tmp/x/pid)
#   tools/redis_server.sh stop PIDFILE         stop it and remove its directory
#   tools/redis_server.sh cluster [MASTERS] [REPLICAS] [MAXMEMORY]
#                                              start a Redis Cluster on free ports (default 3 primaries, 0
#                                              replicas, 256mb a node), joined by redis-cli --cluster create;
#                                              prints "URL STOPFILE" (URL: redis+cluster://127.0.0.1:p1,...)
#   tools/redis_server.sh stop-cluster STOPFILE  stop every node of it and remove their directories
#
# The binary is $REDIS_SERVER if set, else redis-server, else valkey-server on the PATH. The tests start their own
# servers (tests/redis_servers.py, same flags) on free ports and need only `install` to have run.
set -euo pipefail

find_cli() {
  command -v redis-cli 2>/dev/null || command -v valkey-cli 2>/dev/null || true
}

find_binary() {
  if [ -n "${REDIS_SERVER:-}" ]; then echo "$REDIS_SERVER"; return; fi
  command -v redis-server 2>/dev/null || command -v valkey-server 2>/dev/null || true
}

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

case "${1:-}" in
  install)
    if [ -n "$(find_binary)" ] && [ -n "$(find_cli)" ]; then exit 0; fi  # the cluster tests need the cli too
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
      echo "redis_server.sh: no redis-server found and cannot apt-get install it (not root or no apt)" >&2
      exit 1
    fi
    apt-get update -qq >/dev/null
    # the Debian package's postinst may try to start a system service; policy-rc.d (containers) or the lack of
    # systemd prevents that, and nothing here depends on it; redis-tools (redis-cli) comes with it
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server redis-tools >/dev/null
    redis-server --version
    ;;
  start)
    binary="$(find_binary)"
    if [ -z "$binary" ]; then echo "redis_server.sh: no redis-server or valkey-server (run: $0 install)" >&2; exit 1; fi
    port="${2:-$(free_port)}"
    maxmemory="${3:-256mb}"
    dir="$(mktemp -d -t spec-cache-redis-XXXXXX)"
    "$binary" --port "$port" --bind 127.0.0.1 --save '' --appendonly no --dir "$dir" --daemonize yes \
      --pidfile "$dir/pid" --logfile "$dir/log" --protected-mode yes --maxmemory "$maxmemory" \
      --maxmemory-policy allkeys-lru
    for _ in $(seq 1 100); do
      if [ -s "$dir/pid" ] && (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
        echo "redis://127.0.0.1:$port/0 $dir/pid"
        exit 0
      fi
      sleep 0.05
    done
    echo "redis_server.sh: server did not start on port $port (log: $dir/log)" >&2
    exit 1
    ;;
  stop)
    pidfile="${2:?usage: $0 stop PIDFILE}"
    if [ -s "$pidfile" ]; then kill "$(cat "$pidfile")" 2>/dev/null || true; fi
    case "$(dirname "$pidfile")" in
      */spec-cache-redis-*) rm -rf "$(dirname "$pidfile")" ;;
    esac
    ;;
  cluster)
    binary="$(find_binary)"
    cli="$(find_cli)"
    if [ -z "$binary" ] || [ -z "$cli" ]; then echo "redis_server.sh: no server or cli (run: $0 install)" >&2; exit 1; fi
    masters="${2:-3}"; replicas="${3:-0}"; maxmemory="${4:-256mb}"
    stopfile="$(mktemp -t spec-cache-cluster-XXXXXX)"
    addresses=()
    for _ in $(seq 1 $((masters * (1 + replicas)))); do
      port="$(free_port)"; bus="$(free_port)"
      dir="$(mktemp -d -t spec-cache-redis-XXXXXX)"
      "$binary" --port "$port" --bind 127.0.0.1 --save '' --appendonly no --dir "$dir" --daemonize yes \
        --pidfile "$dir/pid" --logfile "$dir/log" --protected-mode yes --maxmemory "$maxmemory" \
        --maxmemory-policy allkeys-lru --cluster-enabled yes --cluster-config-file nodes.conf \
        --cluster-port "$bus" --cluster-node-timeout 2000
      echo "$dir/pid" >> "$stopfile"
      for _ in $(seq 1 100); do
        if [ -s "$dir/pid" ] && (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then break; fi
        sleep 0.05
      done
      addresses+=("127.0.0.1:$port")
    done
    "$cli" --cluster create "${addresses[@]}" --cluster-replicas "$replicas" --cluster-yes >/dev/null
    for _ in $(seq 1 200); do
      if "$cli" -p "${addresses[0]#*:}" cluster info | grep -q cluster_state:ok; then
        echo "redis+cluster://$(IFS=,; echo "${addresses[*]}") $stopfile"
        exit 0
      fi
      sleep 0.1
    done
    echo "redis_server.sh: cluster did not reach cluster_state:ok (stop it: $0 stop-cluster $stopfile)" >&2
    exit 1
    ;;
  stop-cluster)
    stopfile="${2:?usage: $0 stop-cluster STOPFILE}"
    while read -r pidfile; do "$0" stop "$pidfile"; done < "$stopfile"
    case "$stopfile" in */spec-cache-cluster-*) rm -f "$stopfile" ;; esac
    ;;
  *)
    sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
    ;;
esac
