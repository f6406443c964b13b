# ddtree-proxy: the DDTree server (proxy mode in front of vLLM, or engine mode).
#   docker build -t ddtree-proxy .                             # proxy mode, no torch
#   docker build --build-arg EXTRAS=engine -t ddtree-proxy .   # + engine mode, model drafters
#   docker run --rm -p 127.0.0.1:8080:8080 ddtree-proxy serve --target-url http://vllm:8000 ...
#   docker run --rm -p 127.0.0.1:8080:8080 -v "$PWD/models:/app/models:ro" ddtree-proxy serve
#       (engine mode, EXTRAS=engine image: the shipped family, mounted)
# The default image serves proxy mode with the ngram drafter and a local tokenizer
# (EXTRAS=tokenizer: Transformers' tokenizers, no torch). EXTRAS=engine adds the CPU
# build of torch, for engine mode and the autoregressive drafter.
# No model is in the image: mount the models. Engine mode's defaults are
# models/pycoder/{target,dflash} under the repository root, /app here, so mount the
# checkout's models/ at /app/models read-only, or pass --target / --drafter paths inside
# another mount (docker-compose.yml mounts a model family at /models).
# The server binds DDTREE_PORT (8080); set that variable rather than --port, and the
# health check probes the same port.

# Python 3.11.16 on Debian bookworm, pinned by tag and by the digest of its
# multi-platform index as docker-library/repo-info records it
# (repos/python/remote/3.11.16-slim-bookworm.md); update both together.
FROM python:3.11.16-slim-bookworm@sha256:c425d915a89a6dcd3183b1797ad9bd8878caff5a417f6371c8df93c8ea8b727f

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

# The declared dependencies (the base and each of EXTRAS, read from pyproject.toml)
# before the source, so that editing proxy/ reuses this layer. An unknown extra fails.
COPY pyproject.toml ./
RUN python -c 'import sys, tomllib; \
        project = tomllib.load(open("pyproject.toml", "rb"))["project"]; \
        extras = [name for name in sys.argv[1].split(",") if name]; \
        wanted = project["dependencies"] + [req for name in extras for req in project["optional-dependencies"][name]]; \
        print("\n".join(dict.fromkeys(wanted)))' "${EXTRAS}" > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

COPY README.md ./
COPY proxy ./proxy
# Editable, so the package's repository root is /app and engine mode finds the mounted
# /app/models; no dependency resolution here, the layer above has them.
RUN pip install --no-deps -e .

# Inside a container the server must listen on all interfaces; publish the port on
# the host's loopback unless you mean to expose it (see docker-compose.yml).
ENV DDTREE_HOST=0.0.0.0 \
    DDTREE_PORT=8080
EXPOSE 8080

RUN useradd --create-home --uid 10001 ddtree
USER ddtree

HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ['DDTREE_PORT'] + '/health', timeout=4)"]

ENTRYPOINT ["ddtree-proxy"]
CMD ["serve"]
