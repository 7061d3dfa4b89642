#!/bin/sh
# Development secrets for compose.yaml: a bearer token and a self-signed TLS certificate for the
# names engines use (kvstore inside the compose network, localhost and 127.0.0.1 on the host).
# Existing files are kept. Usage: make-secrets.sh [DIR] (default: the secrets/ folder beside this).
set -eu
dir=${1:-$(dirname "$0")/secrets}
mkdir -p "$dir"
if [ ! -s "$dir/token" ]; then
    openssl rand -hex 32 > "$dir/token"
fi
if [ ! -s "$dir/tls.crt" ] || [ ! -s "$dir/tls.key" ]; then
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 365 \
        -subj "/CN=kvstore" -addext "subjectAltName=DNS:kvstore,DNS:localhost,IP:127.0.0.1" \
        -keyout "$dir/tls.key" -out "$dir/tls.crt" 2> /dev/null
fi
# Compose bind-mounts file secrets with their host owner and mode, and the sidecar runs as uid
# 10001: the files must be readable by others. Acceptable on a development machine only; in
# Kubernetes the Secret volume sets the mode and group instead.
chmod 0644 "$dir/token" "$dir/tls.crt" "$dir/tls.key"
echo "secrets in $dir: token, tls.crt (clients trust it as their CA), tls.key"
