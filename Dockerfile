# One image, several entry points: `weightship operator`, `weightship agent`, the CLI.
# Runs as a non-root user and writes nothing outside /tmp, so the Helm chart can set
# readOnlyRootFilesystem: true with an emptyDir at /tmp. Built by `make image`
# (hack/image.sh), which sets the build arguments below.

# The base: any image with python3 >= 3.11 (pyproject's requires-python; the wheel's install
# below enforces it) and its venv module. Fully qualified so that podman and buildah need no
# short-name configuration. Where it cannot be pulled, `make image` makes one from Debian
# packages instead (hack/image.sh).
ARG BASE_IMAGE=docker.io/library/python:3.11-slim

# Everything installed comes from a lock (requirements/, `make lock`), pinned with hashes:
# the runtime's dependencies into /opt/weightship, the build backend into a venv of its own
# that builds the operator's wheel without build isolation (nothing fetched unpinned).
FROM ${BASE_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/weightship && python3 -m venv /opt/build
WORKDIR /src
COPY requirements/runtime.txt requirements/build.txt ./requirements/
# Where a proxy re-signs TLS, pip needs the build host's CA bundle: `make image` passes it as
# the secret pip-ca (mounted for this step only, never in a layer) when the host's pip has one.
RUN --mount=type=secret,id=pip-ca,required=false \
    if [ -s /run/secrets/pip-ca ]; then export PIP_CERT=/run/secrets/pip-ca; fi \
 && /opt/weightship/bin/pip install --require-hashes --no-deps -r requirements/runtime.txt \
 && /opt/build/bin/pip install --require-hashes --no-deps -r requirements/build.txt
COPY pyproject.toml README.md LICENSE ./
COPY operator ./operator
RUN /opt/build/bin/pip wheel --no-deps --no-build-isolation -w /tmp/dist . \
 && /opt/weightship/bin/pip install --no-deps /tmp/dist/weightship-*.whl \
 && /opt/weightship/bin/pip check \
 && /opt/weightship/bin/python -m compileall -q /opt/weightship

FROM ${BASE_IMAGE} AS runtime
ARG BASE_IMAGE
ARG VERSION=unknown
ARG REVISION=unknown
LABEL org.opencontainers.image.title="weightship" \
      org.opencontainers.image.description="Kubernetes operator and node agent that ship model weights to GPU inference fleets" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="https://github.com/weightship/weightship" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.base.name="${BASE_IMAGE}"
ENV PATH=/opt/weightship/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp
COPY --from=build /opt/weightship /opt/weightship
USER 65532:65532
# The operator: liveness (/healthz) and /metrics; the agent: the peer chunk server and
# /metrics (the chart's operator.livenessPort, operator.metricsPort, agent.peerPort,
# agent.metricsPort; tests/unit/test_image.py keeps them equal).
EXPOSE 8080 9100 8479 9101
ENTRYPOINT ["weightship"]
CMD ["operator"]
