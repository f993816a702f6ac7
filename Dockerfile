# The pdserve image that deploy/kuberay.yaml runs: pdserve installed on top of Ray's image
# (the Ray version of the manifest's rayVersion, so the driver and the cluster agree).
#
#   docker build -t pdserve:0.1.0 .                                   # CPU torch (as `make setup`)
#   docker build -t pdserve:0.1.0-cuda \
#       --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .   # GPU workers
#
# deploy/kuberay.yaml places its workers on GPUs (engine.device = "cuda"), so it runs the
# `-cuda` build. torch is installed first, pinned and from the chosen index, so that resolving
# pdserve's own dependencies never swaps it for another build (the Makefile does the same).
# gcc: the CPU kernels (model_runtime/kernels/*.c) are compiled on first use.
ARG RAY_IMAGE=rayproject/ray:2.60.0-py311
FROM ${RAY_IMAGE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu

USER root
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
USER ray

RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"

WORKDIR /opt/pdserve
COPY --chown=ray pyproject.toml README.md ./
COPY --chown=ray model_runtime ./model_runtime
COPY --chown=ray kvtransfer ./kvtransfer
COPY --chown=ray router ./router
COPY --chown=ray prefill_worker ./prefill_worker
COPY --chown=ray decode_worker ./decode_worker
COPY --chown=ray proto ./proto
COPY --chown=ray deploy ./deploy
COPY --chown=ray worker ./worker
COPY --chown=ray tooling ./tooling
COPY --chown=ray security ./security
RUN pip install --no-cache-dir . && pdserve --help >/dev/null
