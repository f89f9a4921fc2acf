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
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 UV_NO_CACHE=1
WORKDIR /src
RUN python -m venv /opt/tandem
# The same pins as `make install` (locks/): uv from its lock, then the runtime lock (pyproject's
# dependencies at the versions CI tested). Its torch is the CPU build, 2.13.0+cpu, from PyTorch's CPU
# index; a GPU image takes torch 2.13.0 from TORCH_INDEX_URL instead, with the CUDA wheels that index
# resolves (not in the lock: the lock is made on CPU machines).
COPY locks/ locks/
RUN /opt/tandem/bin/pip install --require-hashes --no-deps -r locks/uv.lock
RUN if [ -n "$TORCH_INDEX_URL" ]; then \
        awk '/^torch==/ {skip = 1; next} /^[^ ]/ {skip = 0} !skip' locks/runtime.lock > /tmp/runtime.lock \
        && /opt/tandem/bin/uv pip install --python /opt/tandem/bin/python --no-deps -r /tmp/runtime.lock \
        && /opt/tandem/bin/uv pip install --python /opt/tandem/bin/python --index-url "$TORCH_INDEX_URL" "torch==2.13.0"; \
    else \
        /opt/tandem/bin/uv pip sync --python /opt/tandem/bin/python --require-hashes \
            --extra-index-url https://download.pytorch.org/whl/cpu locks/runtime.lock locks/no-deps.lock; \
    fi
COPY proto/ proto/
COPY pyproject.toml setup.py README.md ./
COPY tandem/ tandem/
COPY engine/ engine/
COPY services/ services/
COPY kvtransfer/ kvtransfer/
COPY kernels/ kernels/
COPY bench/ bench/
# The gRPC stubs are generated, never committed (what `make proto` does); the build needs setuptools and
# grpcio-tools from the lock (no build isolation: nothing unpinned is fetched). Installed, Tandem is one
# import name, `tandem` (setup.py maps the folders under it).
RUN /opt/tandem/bin/python -m grpc_tools.protoc -I proto --python_out=. --grpc_python_out=. --pyi_out=. \
        proto/tandem/v1/*.proto \
 && /opt/tandem/bin/uv pip install --python /opt/tandem/bin/python --no-deps "setuptools==$(sed -n 's/^setuptools==\([^ ]*\).*/\1/p' locks/tandem.lock)" \
 && /opt/tandem/bin/uv pip install --python /opt/tandem/bin/python --no-deps --no-build-isolation . \
 && if [ -n "$TORCH_INDEX_URL" ]; then \
        /opt/tandem/bin/uv pip install --python /opt/tandem/bin/python --no-deps --require-hashes -r locks/no-deps.lock; fi

FROM python:3.11-slim
# The manifests run as this user with a read-only root filesystem; /cache and /tmp are volumes.
RUN groupadd --gid 10001 tandem && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin tandem
COPY --from=build /opt/tandem /opt/tandem
ENV PATH=/opt/tandem/bin:$PATH PYTHONUNBUFFERED=1 TANDEM_CACHE_DIR=/cache HF_HUB_OFFLINE=1
USER 10001:10001
EXPOSE 8000 50051 50060 9090
ENTRYPOINT ["tandem"]
CMD ["--help"]
