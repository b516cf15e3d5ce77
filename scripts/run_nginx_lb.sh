#!/usr/bin/env bash
# Runs two independent `engine serve` instances behind nginx (docs/nginx/engine-lb.conf), sends
# requests through the balancer, and shows how many each instance served (from its /metrics).
# Usage: bash scripts/run_nginx_lb.sh [engine serve flags...]   e.g. --max-model-len 1024
set -euo pipefail
cd "$(dirname "$0")/.."
command -v nginx >/dev/null || { echo "nginx is not installed (apt-get install nginx)"; exit 1; }
work=$(mktemp -d /tmp/engine-lb.XXXXXX)
pids=()
cleanup() {
    nginx -c "$PWD/docs/nginx/engine-lb.conf" -p "$work/" -s stop 2>/dev/null || true
    for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT
for port in 8001 8002; do
    engine serve --port "$port" "$@" >"$work/serve-$port.log" 2>&1 &
    pids+=($!)
done
for port in 8001 8002; do
    for _ in $(seq 240); do
        curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
        sleep 0.5
    done
    curl -sf "http://127.0.0.1:$port/health" >/dev/null || { cat "$work/serve-$port.log"; exit 1; }
done
nginx -c "$PWD/docs/nginx/engine-lb.conf" -p "$work/"
for i in $(seq 8); do
    curl -sf http://127.0.0.1:8080/v1/completions -H 'Content-Type: application/json' \
        -d '{"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}' \
        | python3 -c 'import json,sys; print(repr(json.load(sys.stdin)["choices"][0]["text"]))' &
done
wait -n 2>/dev/null; sleep 2
echo "streaming through nginx:"
curl -sfN http://127.0.0.1:8080/v1/completions -H 'Content-Type: application/json' \
    -d '{"prompt": "Once upon a time", "max_tokens": 5, "temperature": 0, "stream": true}' | head -3 || true
for port in 8001 8002; do
    served=$(curl -sf "http://127.0.0.1:$port/metrics" | grep '^vllm:request_success_total' \
             | awk '{s += $2} END {print s + 0}')
    echo "instance on port $port served $served requests"
done
