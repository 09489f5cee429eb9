# syntax=docker/dockerfile:1
# The one application image of docker-compose.yml: workers, the admin API, Flower and
# migrations differ only in their command. Build: docker compose build (or docker build -t
# workmanager:local .). For C# and .NET DLL workers: docker build --target with-dotnet -t
# workmanager:dotnet .

# Stage 1 builds every wheel from the source; the image installs those and keeps neither the
# source nor the wheels nor a compiler.
FROM python:3.11-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY . /src
RUN pip wheel --wheel-dir /wheels "/src[postgres,flower,native,dotnet,otel,api]"

FROM python:3.11-slim AS base

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# bubblewrap and libseccomp: the Python sandbox's kernel layers (docs/guides/python-workers.md
# "The sandbox"); the compose file gives the container what bubblewrap needs and requires
# every layer.
RUN apt-get update && apt-get install -y --no-install-recommends bubblewrap libseccomp2 \
    && rm -rf /var/lib/apt/lists/*

# A fixed uid, so volumes and Kubernetes securityContext can name it.
RUN groupadd --system --gid 10001 workmanager \
    && useradd --system --uid 10001 --gid workmanager --create-home \
       --home-dir /home/workmanager workmanager

RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-index --find-links /wheels \
        "workmanager[postgres,flower,native,dotnet,otel,api]"

USER workmanager
WORKDIR /home/workmanager

CMD ["celery", "-A", "wm.celeryapp", "worker", "--loglevel=INFO"]

# A supported .NET 8 SDK from Microsoft's image: its runtime runs the workers and its Roslyn
# compiles C# (docs/guides/dotnet-workers.md); found in /usr/share/dotnet.
FROM base AS with-dotnet
USER root
COPY --from=mcr.microsoft.com/dotnet/sdk:8.0 /usr/share/dotnet /usr/share/dotnet
RUN apt-get update && apt-get install -y --no-install-recommends libicu72 \
    && rm -rf /var/lib/apt/lists/*
USER workmanager

FROM base
