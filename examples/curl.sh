#!/usr/bin/env bash
# The gateway with curl: models, a chat completion, and a streamed completion (SSE).
# Usage: examples/curl.sh [http://127.0.0.1:8000]   (set TANDEM_API_KEY if the gateway has --api-key)
set -euo pipefail
URL=${1:-http://127.0.0.1:8000}
AUTH=(-H "Authorization: Bearer ${TANDEM_API_KEY:-unused}")

curl -s "$URL/v1/models" "${AUTH[@]}"; echo
curl -s "$URL/v1/chat/completions" "${AUTH[@]}" -H 'Content-Type: application/json' \
  -d '{"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 32, "temperature": 0}'
echo
curl -sN "$URL/v1/completions" "${AUTH[@]}" -H 'Content-Type: application/json' \
  -d '{"prompt": "Once upon a time", "max_tokens": 16, "stream": true, "stream_options": {"include_usage": true}}'
