# ddtree-proxy: the DDTree server (proxy mode in front of vLLM, or engine mode).
#   docker build -t ddtree-proxy .                        # proxy mode, no torch
#   docker build --build-arg EXTRAS=engine -t ddtree-proxy .   # + engine mode, model drafters
#   docker run --rm -p 127.0.0.1:8080:8080 ddtree-proxy serve --target-url http://vllm:8000 ...
# The default image serves proxy mode with the ngram drafter and a local tokenizer
# (EXTRAS=tokenizer: Transformers' tokenizers, no torch). EXTRAS=engine adds the CPU
# build of torch, for engine mode and the autoregressive drafter.
FROM python:3.11-slim

ARG EXTRAS=tokenizer
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1

WORKDIR /app

# torch (engine extra only) first, from PyTorch's CPU index: PyPI's default build
# would pull CUDA (GBs).
RUN case ",${EXTRAS}," in \
        *,engine,*) pip install --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0" ;; \
    esac

COPY pyproject.toml README.md ./
COPY proxy ./proxy
# Editable, so the package finds its repository root (/app) and the shipped models
# under /app/models for engine mode.
RUN pip install -e ".[${EXTRAS}]"
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
