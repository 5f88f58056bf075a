# syntax=docker/dockerfile:1
# One image, several entry points: `weightship operator`, `weightship agent`, the CLI.
# Runs as a non-root user and writes nothing outside /tmp, so the Helm chart can set
# readOnlyRootFilesystem: true with an emptyDir at /tmp.

# Everything installed comes from a lock (requirements/, `make lock`), pinned with hashes:
# the runtime's dependencies into /opt/weightship, the build backend into a venv of its own
# that builds the operator's wheel without build isolation (nothing fetched unpinned).
FROM python:3.11-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/weightship && python -m venv /opt/build
WORKDIR /src
COPY requirements/runtime.txt requirements/build.txt ./requirements/
RUN /opt/weightship/bin/pip install --require-hashes --no-deps -r requirements/runtime.txt \
 && /opt/build/bin/pip install --require-hashes --no-deps -r requirements/build.txt
COPY pyproject.toml README.md LICENSE ./
COPY operator ./operator
RUN /opt/build/bin/pip wheel --no-deps --no-build-isolation -w /tmp/dist . \
 && /opt/weightship/bin/pip install --no-deps /tmp/dist/weightship-*.whl \
 && /opt/weightship/bin/pip check \
 && /opt/weightship/bin/python -m compileall -q /opt/weightship

FROM python:3.11-slim AS runtime
LABEL org.opencontainers.image.title="weightship" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="https://github.com/weightship/weightship"
ENV PATH=/opt/weightship/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp
COPY --from=build /opt/weightship /opt/weightship
USER 65532:65532
EXPOSE 8080
ENTRYPOINT ["weightship"]
CMD ["operator"]
