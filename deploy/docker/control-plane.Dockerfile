# syntax=docker/dockerfile:1.7
# Control-plane image: `adaptermesh control-plane` (gRPC API, SQLite state, rebalancer) and
# `adapterctl`.
# Build from the repository root:
#   docker build -f deploy/docker/control-plane.Dockerfile -t adaptermesh/control-plane:0.1.0 .

ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
# gcc: the package's C extension is compiled in this stage only (the image ships Python's headers).
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
# The control-plane extra's environment exactly as requirements/control-plane.lock pins it (hashes
# checked), then the package itself, built with the locked setuptools and nothing resolved.
COPY requirements/control-plane.lock ./requirements/
RUN python -m venv /opt/adaptermesh \
 && /opt/adaptermesh/bin/pip install --no-cache-dir --require-hashes --no-deps -r requirements/control-plane.lock
COPY pyproject.toml README.md ./
COPY src ./src
RUN /opt/adaptermesh/bin/pip install --no-cache-dir --no-deps --no-build-isolation ".[control-plane]"

FROM ${PYTHON_IMAGE}
COPY --from=build /opt/adaptermesh /opt/adaptermesh
ENV PATH=/opt/adaptermesh/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
RUN adaptermesh control-plane --help >/dev/null && adapterctl --help >/dev/null
# The uid the chart runs it as (runAsUser/fsGroup 10001); the state directory is a volume.
RUN groupadd --gid 10001 adaptermesh \
 && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin adaptermesh \
 && mkdir -p /var/lib/adaptermesh && chown 10001:10001 /var/lib/adaptermesh
USER 10001:10001
ENTRYPOINT ["adaptermesh"]
CMD ["control-plane", "--help"]
