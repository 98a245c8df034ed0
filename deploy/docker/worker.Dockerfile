# syntax=docker/dockerfile:1.7
# GPU worker image: `adaptermesh worker` (OpenAI-compatible API, multi-LoRA batching with the
# Triton SGMM kernels) on a CUDA runtime base.
# Build from the repository root:
#   docker build -f deploy/docker/worker.Dockerfile -t adaptermesh/worker:0.1.0 .

# Ubuntu 24.04's python3 is 3.12 (the package needs 3.11+). torch wheels bundle their own CUDA
# libraries; the base brings the matching user-space runtime and driver compatibility setup.
ARG CUDA_IMAGE=nvidia/cuda:12.6.3-runtime-ubuntu24.04

FROM ${CUDA_IMAGE} AS build
# gcc + python3-dev: the package's C extension is compiled in this stage only.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-pip python3-dev gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
# The worker extra's environment exactly as requirements/worker-cuda.lock pins it (hashes
# checked): torch 2.11.0, the CUDA build the GPU tests and benchmarks ran with, its CUDA
# libraries and triton, transformers, tokenizers, safetensors, pydantic. Then the package
# itself, built with the locked setuptools and nothing resolved.
COPY requirements/worker-cuda.lock ./requirements/
RUN python3 -m venv /opt/adaptermesh \
 && /opt/adaptermesh/bin/pip install --no-cache-dir --require-hashes --no-deps -r requirements/worker-cuda.lock
COPY pyproject.toml README.md ./
COPY src ./src
RUN /opt/adaptermesh/bin/pip install --no-cache-dir --no-deps --no-build-isolation ".[worker]"

FROM ${CUDA_IMAGE}
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 ca-certificates \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/adaptermesh /opt/adaptermesh
ENV PATH=/opt/adaptermesh/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1
RUN adaptermesh worker --help >/dev/null
RUN groupadd --gid 10001 adaptermesh \
 && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin adaptermesh
USER 10001:10001
EXPOSE 8000
ENTRYPOINT ["adaptermesh"]
CMD ["worker", "--help"]
