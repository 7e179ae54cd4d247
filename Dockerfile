# One image for every specserve service; the compose file picks the command.
FROM python:3.11-slim

# A C++ compiler: the model's CPU kernels (modeling/csrc) are compiled for the host's CPU
# on first start and cached with the model under /models.
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*

# TORCH_SPEC: on GPU hosts the default PyPI wheel of torch 2.13.0 carries CUDA; for a
# CPU-only image build with --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX=
RUN pip install --no-cache-dir ${TORCH_INDEX:+--index-url ${TORCH_INDEX}} "${TORCH_SPEC}"

WORKDIR /app
COPY pyproject.toml README.md ./
COPY proto ./proto
COPY common ./common
COPY modeling ./modeling
COPY gpu_worker ./gpu_worker
COPY draft_service ./draft_service
COPY distill ./distill
COPY drafts ./drafts
COPY scheduler ./scheduler
COPY gateway ./gateway
COPY specserve ./specserve
RUN pip install --no-cache-dir .

ENV SPECSERVE_CACHE_DIR=/models \
    SPECSERVE_LOG_JSON=1
ENTRYPOINT ["specserve"]
