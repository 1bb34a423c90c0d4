# syntax=docker/dockerfile:1
# nodeguard's container image, for the Kubernetes DaemonSet in packaging/kubernetes/
# (and for the gate's init container: `nodeguard admit`).
#
#   docker build -t ghcr.io/example/nodeguard:0.1.0 .
#   podman build -t ghcr.io/example/nodeguard:0.1.0 .
#
# Two stages: the builder makes wheels of nodeguard and every dependency; the
# final image installs only those wheels, with no compiler, no build tools and
# no pip cache. The bind mount below needs BuildKit (the default builder since
# Docker 23) or podman/buildah.
#
# BASE_IMAGE: a Python 3.11+ image whose `pip` installs into the system
# interpreter (the public python images do). Where no registry is reachable,
# build one locally and pass it: tests/containers/runtime.py makes one with
# mmdebstrap (Debian's python3-pip, EXTERNALLY-MANAGED removed) and builds
# this file on it with `podman build --build-arg BASE_IMAGE=...`.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS builder
WORKDIR /src
# Every dependency ships manylinux wheels for amd64 and arm64, so no compiler is
# installed here either; a platform without them would need build-essential in
# this stage only.
# The dependencies first, from pyproject.toml alone: this layer is reused until
# they change, whatever changes in the code.
COPY pyproject.toml ./
RUN python3 -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))' \
        > requirements.txt \
    && pip wheel --no-cache-dir --wheel-dir /wheels -r requirements.txt
# Then nodeguard itself: only what its wheel is built from (.dockerignore keeps
# everything else out of the build context, including the test VM images, the
# test containers' storage and the virtualenv).
COPY README.md ./
COPY nodeguard ./nodeguard
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM ${BASE_IMAGE}
LABEL org.opencontainers.image.title="nodeguard" \
      org.opencontainers.image.description="On-node daemon that keeps nodes healthy for their important workloads" \
      org.opencontainers.image.licenses="Apache-2.0"
# Output reaches the container log line by line; nothing writes .pyc at run
# time (the root file system may be read-only).
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
# The dependencies' wheels are bind-mounted from the builder for this one step,
# so they never become a layer of the final image. nodeguard's own small wheel
# is copied: a builder (buildah) that does not look into a bind mount's content
# when it reuses a cached layer still sees a new nodeguard as a change.
COPY --from=builder /wheels/nodeguard-*.whl /tmp/nodeguard/
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-index --find-links=/wheels /tmp/nodeguard/nodeguard-*.whl \
    && rm -rf /tmp/nodeguard \
    && nodeguard --help > /dev/null
# No USER: the daemon must run as root. It writes cpu.max in the host's cgroup
# tree (root's files), signals processes of other users when it evicts, and
# drops to each client's uid for exec readiness probes. The DaemonSet runs it
# privileged for the same reasons (packaging/kubernetes/daemonset.yaml).
# (The gate's init container runs this image as an unprivileged user instead.)
# HTTP: /metrics, /healthz, /readyz, /status (global.http.listen; the
# Kubernetes config sets 0.0.0.0:9466).
EXPOSE 9466
# SIGTERM restores every throttle before exit.
STOPSIGNAL SIGTERM
ENTRYPOINT ["nodeguard", "run"]
CMD ["--config", "/etc/nodeguard/config.json"]
