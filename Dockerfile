# ddtree-proxy: the DDTree server (proxy mode in front of vLLM, or engine mode).
#   docker build -t ddtree-proxy .
#   docker run --rm -p 127.0.0.1:8080:8080 ddtree-proxy serve --target-url http://vllm:8000 ...
# The proxy runs the drafter and the tree builder on the CPU (ngram needs no model; an
# autoregressive drafter is small), so the image carries the CPU build of torch only.
FROM python:3.11-slim

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1

WORKDIR /app

# torch first, from PyTorch's CPU index: PyPI's default build would pull CUDA (GBs).
RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0"

COPY pyproject.toml README.md ./
COPY proxy ./proxy
# Editable, so the package finds its repository root (/app) and the shipped models
# under /app/models for engine mode.
RUN pip install -e .
COPY models ./models

# Inside a container the server must listen on all interfaces; publish the port on
# the host's loopback unless you mean to expose it (see docker-compose.yml).
ENV DDTREE_HOST=0.0.0.0 \
    DDTREE_PORT=8080
EXPOSE 8080

RUN useradd --create-home --uid 10001 ddtree
USER ddtree

HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/health', timeout=4)"]

ENTRYPOINT ["ddtree-proxy"]
CMD ["serve"]
