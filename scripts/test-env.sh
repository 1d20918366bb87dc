#!/usr/bin/env bash
# What the test suite needs on the machine: Redis and PostgreSQL running (started if down), and the
# Debian tools some tests drive. Idempotent; `make test` and CI both run it.
set -euo pipefail

start_redis() {
  if command -v redis-cli >/dev/null && redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then return; fi
  if command -v redis-server >/dev/null; then
    mkdir -p /var/lib/redis /var/log/redis
    redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
      --dir /var/lib/redis --logfile /var/log/redis/ci.log || true
  fi
}

start_postgres() {
  if command -v pg_isready >/dev/null && pg_isready -h 127.0.0.1 -p 5432 >/dev/null 2>&1; then return; fi
  if [ -d /etc/postgresql ]; then
    pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n1)" main start || true
  fi
}

# Test tools from Debian: espeak-ng speaks the sentences the audio tests transcribe; promtool and a real
# Prometheus (package prometheus), nginx and envsubst drive the telemetry and ops tests; headless
# Chromium and its WebDriver (chromium, chromium-driver) run the console's browser tests; node and npm the
# openai-node suite.
install_test_tools() {
  local missing=()
  command -v espeak-ng >/dev/null || missing+=(espeak-ng)
  command -v promtool >/dev/null || missing+=(prometheus)
  command -v nginx >/dev/null || [ -x /usr/sbin/nginx ] || missing+=(nginx)
  command -v envsubst >/dev/null || missing+=(gettext-base)
  [ -x /usr/bin/chromium ] || missing+=(chromium)
  [ -x /usr/bin/chromedriver ] || missing+=(chromium-driver)
  # node and npm run the openai-node contract suite (tests/node).
  command -v node >/dev/null || missing+=(nodejs)
  command -v npm >/dev/null || missing+=(npm)
  if [ "${#missing[@]}" -gt 0 ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
}

start_redis
start_postgres
install_test_tools
