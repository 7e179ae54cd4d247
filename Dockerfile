# One image for every specserve service; the compose file picks the command.
#
# Build arguments:
#   BASE_IMAGE   a Debian-family image with Python 3.11 (default python:3.11-slim; with no registry,
#                docker/base-image.sh makes one from Debian's archive)
#   TORCH        cpu (default: the CPU wheel of torch) or cuda (PyPI's default wheel, which carries CUDA)
#   KERNEL_ARCH  what the CPU kernels are compiled for: native (default: the building machine's CPU; on
#                another kind of CPU the model runs on torch ops, and says so) or x86-64-v2/-v3/-v4 for an
#                image run on many machines
#   MODEL        the model baked into the image: the embedded default, or another named one (specserve
#                prepare-model --help); any other model is mounted at run time (docker-compose.yml)
#   PIP_OFFLINE  non-empty: pip reads no index, only the wheels in docker/wheels/ (a host without
#                PyPI; `make docker-wheels` fills the folder)
# The model and the kernels are made in the build stage; the runtime stage has neither compiler nor wheels.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS build
ARG TORCH=cpu
ARG KERNEL_ARCH=native
ARG MODEL=
ARG PIP_OFFLINE=
# A C++ compiler, and Python's headers where the base lacks them (Debian's own python3).
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && (python3 -c "import os, sysconfig; raise SystemExit(not os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))" \
        || apt-get install -y --no-install-recommends python3-dev) \
    && rm -rf /var/lib/apt/lists/*
ENV PATH=/opt/specserve/venv/bin:$PATH \
    PIP_FIND_LINKS=/wheels \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    SPECSERVE_CACHE_DIR=/opt/specserve/cache \
    SPECSERVE_KERNEL_ARCH=${KERNEL_ARCH}
COPY docker/wheels/ /wheels/
RUN python3 -m venv /opt/specserve/venv \
    && if [ -n "$PIP_OFFLINE" ]; then export PIP_NO_INDEX=1; fi \
    && case "$TORCH" in \
         cpu) index=https://download.pytorch.org/whl/cpu ;; \
         cuda) index= ;; \
         *) echo "TORCH must be cpu or cuda, got '$TORCH'" >&2; exit 2 ;; \
       esac \
    && pip install ${index:+--index-url $index} torch==2.13.0
COPY pyproject.toml README.md /opt/specserve/src/
COPY proto /opt/specserve/src/proto
COPY common /opt/specserve/src/common
COPY modeling /opt/specserve/src/modeling
COPY gpu_worker /opt/specserve/src/gpu_worker
COPY draft_service /opt/specserve/src/draft_service
COPY distill /opt/specserve/src/distill
COPY scheduler /opt/specserve/src/scheduler
COPY gateway /opt/specserve/src/gateway
COPY specserve /opt/specserve/src/specserve
RUN if [ -n "$PIP_OFFLINE" ]; then export PIP_NO_INDEX=1; fi \
    && pip install /opt/specserve/src \
    && specserve prepare-model $MODEL \
    && python -m modeling.kernels.native \
    && rm -rf /opt/specserve/src /opt/specserve/cache/kernels/*/*.o
COPY drafts /opt/specserve/drafts

FROM ${BASE_IMAGE}
ARG KERNEL_ARCH=native
# The kernels' OpenMP runtime (the compiler's libgomp); nothing else is installed.
RUN apt-get update \
    && apt-get install -y --no-install-recommends libgomp1 \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/specserve /opt/specserve
ENV PATH=/opt/specserve/venv/bin:$PATH \
    SPECSERVE_CACHE_DIR=/opt/specserve/cache \
    SPECSERVE_KERNEL_ARCH=${KERNEL_ARCH} \
    SPECSERVE_LOG_JSON=1
ENTRYPOINT ["specserve"]
