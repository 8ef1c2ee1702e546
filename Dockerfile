# One image for every dualpath service (scheduler, storage gateway, PE receiver, DE loader with
# emulated engines, the replay client): `dualpath serve <service> -c CONFIG --node ID`.
# BASE_IMAGE: any Debian/Ubuntu-like image with python3 >= 3.11 and python3-venv
# (CI passes the one ../shared/ci/docker-env.sh builds).
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

RUN python3 -m venv /opt/venv
WORKDIR /app

# Dependencies first (cached until pyproject.toml changes): install the project with empty
# packages, then drop it; the real sources come next.
COPY pyproject.toml README.md ./
RUN mkdir -p common services storage_gateway tools bench sim \
    && for d in common services storage_gateway tools bench sim; do touch "$d/__init__.py"; done \
    && pip install -q . && pip uninstall -q -y dualpath \
    && rm -rf common services storage_gateway tools bench sim build *.egg-info

COPY common/ common/
COPY services/ services/
COPY storage_gateway/ storage_gateway/
COPY tools/ tools/
COPY bench/ bench/
COPY sim/ sim/
COPY configs/ configs/
COPY deploy/ deploy/
RUN pip install -q --no-deps . && rm -rf build *.egg-info \
    && python -c "import tools.cluster.serve, storage_gateway.service, tools.replay.run"

# Storage and state live under /data (a volume in docker-compose.yml).
RUN mkdir -p /data/storage /data/cluster
ENTRYPOINT ["dualpath"]
CMD ["--help"]
