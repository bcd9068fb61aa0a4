# CI only (deploy/ci/compose_check.sh): the part of the official python image that
# gateway/Dockerfile and worker/Dockerfile rely on (python3 with its venv module, CA
# certificates), on the local Debian base that debootstrap made. Debian bookworm's
# Python is 3.11, the version of the torch wheel on this machine's disk.
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}

RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/*

CMD ["python3"]
