# One image for the five services, the MAAS simulator and the `gpuaas` CLI.
FROM python:3.11-slim

# libvirt-python compiles against libvirt-dev; qemu-utils gives qemu-img for images and simulated disks.
RUN apt-get update \
 && apt-get install -y --no-install-recommends libvirt-dev pkg-config qemu-utils gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY pyproject.toml ./
COPY libs libs
COPY services services
COPY tools/gpuaas_dev tools/gpuaas_dev
COPY contracts contracts
RUN pip install --no-cache-dir . \
 && useradd --system --create-home --uid 10001 gpuaas \
 && mkdir -p /srv/gpuaas \
 && chown gpuaas:gpuaas /srv/gpuaas

# A named volume mounted here inherits this ownership, so the fleet init step can write into it.
USER gpuaas
ENV PYTHONUNBUFFERED=1
CMD ["gpuaas", "--help"]
