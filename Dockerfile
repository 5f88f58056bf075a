# syntax=docker/dockerfile:1
# One image, several entry points: `weightship operator`, `weightship agent`, the CLI.
# Runs as a non-root user and writes nothing outside /tmp, so the Helm chart can set
# readOnlyRootFilesystem: true with an emptyDir at /tmp.

FROM python:3.11-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/weightship
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY operator ./operator
RUN /opt/weightship/bin/pip install . \
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
