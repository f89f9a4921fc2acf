"""Engine configuration: one frozen dataclass, validated once, copied with `dataclasses.replace`."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.engine.errors import InvalidRequest

DTYPES = ("auto", "float32", "bfloat16", "float16")
SPECULATIVE_ALGORITHMS = ("ngram", "draft")
KV_LAYOUTS = ("page_first", "layer_first")           # engine/kvcache/kv_pool.py
PREFILL_SCHEDULE_POLICIES = ("shortest-first", "fcfs")   # engine/scheduler/prefill_order.py


@dataclass(frozen=True)
class EngineConfig:
    model: str = "smollm2-135m"           # alias or local Hugging Face folder
    dtype: str = "auto"                   # auto: bf16 on CPU and GPU, fp32 if the model is fp32-only
    device: str = "auto"                  # auto | cpu | cuda | cuda:N
    attention_backend: str = "auto"       # auto | torch | triton
    page_size: int = 16                   # tokens per KV page
    # page_first: a page of every layer is one contiguous block (one piece to transfer or tier);
    # layer_first: one block per (layer, K|V). Attention reads either (engine/kvcache/kv_pool.py).
    # auto: layer-first on CPU, page-first on GPUs (engine/hardware.py, choose_kv_layout).
    kv_layout: str = "auto"
    max_total_tokens: int | None = None   # KV pool size in tokens; None: from kv_cache_gb
    kv_cache_gb: float = 1.0
    context_length: int | None = None     # None: the model's max_position_embeddings
    max_running_requests: int = 64        # request slots (decode batch size bound)
    # Requests waiting for compute (co-located/prefill: the waiting queue, decode: the prealloc
    # queue). When full, the one served last (the newcomer unless it outranks someone) gets
    # ResourceExhausted; see engine/scheduler/queue_policy.py.
    max_queued_requests: int = 4096
    enable_priority_scheduling: bool = False   # order queues by Request.priority, then arrival
    low_priority_values_first: bool = False    # a lower `priority` value is more urgent
    priority_preemption_threshold: int = 10    # a waiting request preempts a running one this much less urgent
    chunked_prefill_size: int = 2048      # max tokens per step: prefill chunks + (mixed) decode rows
    # A step may carry prefill chunks beside one token of every running request (SGLang's mixed
    # chunk); the chunk is then also bounded so that the step takes at most `mixed_chunk_itl_factor`
    # x a pure decode step (0: no bound beyond chunked_prefill_size). 1.5 measured better than 1.8
    # on the 256/64 load (docs/benchmarks.md): decode steps alone already spread to ~1.7x their
    # median at p98 on a shared core, so 1.8x mixed steps put ITL p99/p50 above 2.
    enable_mixed_chunk: bool = True
    mixed_chunk_itl_factor: float = 1.5
    # ... unless a queued prompt could then not get its first token within this many seconds of its
    # arrival: the chunk grows just enough for every queued prompt to make it, and a prompt that no
    # longer can is finished in the next step (0: the ITL bound always holds).
    mixed_chunk_ttft_target_s: float = 1.5
    enable_prefix_cache: bool = True
    # Structured output: JSON in the model's own formatting, bounded (one space, or a newline and some
    # indentation, between two tokens), instead of no whitespace at all (engine/structured/compile.py).
    # Off: with closed objects SmolLM2 ends more of its answers by itself without (docs/benchmarks.md).
    enable_any_whitespace: bool = False
    # Tiers below the KV pool (engine/kvcache/tiers/): pages the prefix cache evicts are kept in host
    # memory (L2) and/or on local disk (L3) and loaded back instead of recomputed, on every worker
    # role. Off by default until measured.
    kv_host_cache_gb: float = 0.0         # L2 size (0: no L2)
    kv_disk_cache_dir: str | None = None  # L3 directory (None: no L3); shareable by a host's workers
    kv_disk_cache_gb: float = 16.0        # L3 budget within that directory
    # write_through: a page goes below when the prefix cache takes it (L3 then survives a kill -9, and
    # an eviction copies nothing); write_back: only when the prefix cache evicts it.
    kv_write_policy: str = "write_through"
    # Plan step N+1 while step N's forward pass runs (SGLang's overlap scheduler). None: the
    # device's default (on for CUDA, off for CPU; see engine.engine.overlap_enabled).
    enable_overlap_schedule: bool | None = None
    # Who gets a step's prefill budget first (scheduler/prefill_order.py): the prompts with the least
    # left to compute ("shortest-first"), except that one waiting over `prefill_max_wait_s` goes first;
    # or "fcfs", one prompt's every chunk before the next prompt's first.
    prefill_schedule_policy: str = "shortest-first"
    prefill_max_wait_s: float = 2.0
    # Admission control reserves `remaining_tokens * new_token_ratio` pages for running requests.
    # The ratio decays while decoding goes well and jumps back after a retraction.
    init_new_token_ratio: float = 0.7
    min_new_token_ratio: float = 0.1
    new_token_ratio_decay_steps: int = 600
    num_threads: int | None = None        # torch intra-op threads; None: torch's default
    # Decode steps from graphs captured for fixed (padded) batch sizes: CUDA graphs on CUDA,
    # torch.compile/inductor on CPU (engine/runner/graph_runner.py). None: on where that measured faster
    # than eager (CUDA; not this project's 2-core CPU, see docs/benchmarks.md).
    enable_graph: bool | None = None
    graph_max_bs: int | None = None       # largest captured batch (<= max_running_requests); None: 256 CUDA, 32 CPU
    graph_bs: tuple[int, ...] | None = None   # the sizes to capture (<= graph_max_bs); None: the device's list
    # Linear layers on CPU from weights packed once at load (engine/models/prepack.py): bf16 in oneDNN's
    # layout, fp32 for Tandem's linear kernel; None: bf16 where oneDNN supports it, fp32 where the CPU
    # kernels are on, and decode graphs off.
    enable_weight_prepack: bool | None = None
    # Fused C++ kernels on CPU for decode attention, RMSNorm and RoPE (kernels/cpu); None: on CPU with
    # decode graphs off, wherever they build (the torch code otherwise).
    enable_cpu_kernels: bool | None = None
    # Speculative decoding on decode rows (engine/spec/): None (off) | ngram | draft.
    speculative_algorithm: str | None = None
    speculative_num_draft_tokens: int = 4      # drafts proposed per request per step (k)
    speculative_ngram_min: int = 2             # shortest suffix n-gram the n-gram proposer matches
    speculative_ngram_max: int = 4             # longest one (tried first)
    speculative_draft_model: str | None = None # HF folder of the draft model (algorithm "draft")
    # Switch speculation off for a batch while measured acceptance x step cost says it is slower than
    # plain decode, probing it again periodically (engine/spec/adaptive.py).
    speculative_adaptive: bool = True
    # LoRA adapters (engine/lora/): PEFT folders by name, applied per request in mixed batches.
    enable_lora: bool = False
    lora_modules: tuple[tuple[str, str], ...] = ()   # (name, path) loaded at start
    max_loras: int = 4                    # distinct adapters in one step
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None      # adapters kept loaded (None: max_loras), least recently used out
    lora_eager_load: bool = False         # load every lora_modules adapter at start (default: on first use)
    # POST /v1/load_lora_adapter, /v1/unload_lora_adapter (gateway) and the workers' LoraAdmin RPCs
    enable_lora_runtime_updating: bool = False
    seed: int = 0

    def validate(self) -> None:
        if self.dtype not in DTYPES:
            raise InvalidRequest(f"dtype must be one of {DTYPES}, got {self.dtype!r}", "dtype")
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise InvalidRequest("page_size must be a power of two >= 1", "page_size")
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise InvalidRequest("max_total_tokens must hold at least one page", "max_total_tokens")
        if self.kv_cache_gb <= 0:
            raise InvalidRequest("kv_cache_gb must be > 0", "kv_cache_gb")
        if self.max_queued_requests < 1:
            raise InvalidRequest("max_queued_requests must be >= 1", "max_queued_requests")
        if self.priority_preemption_threshold < 0:
            raise InvalidRequest("priority_preemption_threshold must be >= 0", "priority_preemption_threshold")
        if self.max_running_requests < 1:
            raise InvalidRequest("max_running_requests must be >= 1", "max_running_requests")
        if self.mixed_chunk_itl_factor and self.mixed_chunk_itl_factor <= 1:
            raise InvalidRequest("mixed_chunk_itl_factor must be > 1 (or 0: unbounded)", "mixed_chunk_itl_factor")
        if self.mixed_chunk_ttft_target_s < 0:
            raise InvalidRequest("mixed_chunk_ttft_target_s must be >= 0 (0: off)", "mixed_chunk_ttft_target_s")
        if self.prefill_schedule_policy not in PREFILL_SCHEDULE_POLICIES:
            raise InvalidRequest(f"prefill_schedule_policy must be one of {PREFILL_SCHEDULE_POLICIES}, "
                                 f"got {self.prefill_schedule_policy!r}", "prefill_schedule_policy")
        if self.prefill_max_wait_s < 0:
            raise InvalidRequest("prefill_max_wait_s must be >= 0", "prefill_max_wait_s")
        if self.chunked_prefill_size < self.page_size:
            raise InvalidRequest("chunked_prefill_size must be >= page_size", "chunked_prefill_size")
        if self.graph_max_bs is not None and self.graph_max_bs < 1:
            raise InvalidRequest(f"graph_max_bs must be >= 1, got {self.graph_max_bs}", "graph_max_bs")
        if self.graph_bs is not None:
            if not self.graph_bs or any(not isinstance(b, int) or b < 1 for b in self.graph_bs):
                raise InvalidRequest(f"graph_bs must be batch sizes >= 1, got {self.graph_bs}", "graph_bs")
            if self.graph_max_bs is not None and min(self.graph_bs) > self.graph_max_bs:
                raise InvalidRequest(f"graph_bs {self.graph_bs} has no size <= graph_max_bs {self.graph_max_bs}",
                                     "graph_bs")
        self._validate_speculative()
        self._validate_kv_tiers()
        self._validate_lora()
        if self.context_length is not None and self.context_length < 2:
            raise InvalidRequest("context_length must be >= 2", "context_length")

    @property
    def kv_tiers_enabled(self) -> bool:
        return self.kv_host_cache_gb > 0 or bool(self.kv_disk_cache_dir)

    def _validate_kv_tiers(self) -> None:
        if not self.kv_host_cache_gb >= 0:   # also catches NaN
            raise InvalidRequest(f"--kv-host-cache-gb must be >= 0 (0: off), got {self.kv_host_cache_gb}",
                                 "kv_host_cache_gb")
        if self.kv_disk_cache_dir is not None and not self.kv_disk_cache_dir.strip():
            raise InvalidRequest("--kv-disk-cache-dir is empty (unset it to turn L3 off)", "kv_disk_cache_dir")
        if self.kv_layout != "auto" and self.kv_layout not in KV_LAYOUTS:
            raise InvalidRequest(f"--kv-layout must be auto, page_first or layer_first, got {self.kv_layout!r}",
                                 "kv_layout")
        if self.kv_write_policy not in ("write_through", "write_back"):
            raise InvalidRequest(f"--kv-write-policy must be write_through or write_back, got {self.kv_write_policy!r}",
                                 "kv_write_policy")
        if self.kv_disk_cache_dir and not self.kv_disk_cache_gb > 0:
            raise InvalidRequest(f"--kv-disk-cache-gb must be > 0 with --kv-disk-cache-dir, got {self.kv_disk_cache_gb}",
                                 "kv_disk_cache_gb")
        if self.kv_tiers_enabled and not self.enable_prefix_cache:
            raise InvalidRequest("--kv-host-cache-gb / --kv-disk-cache-dir keep what the prefix cache evicts: they "
                                 "need it on (drop --disable-prefix-cache)", "kv_host_cache_gb")

    def _validate_lora(self) -> None:
        if self.lora_modules and not self.enable_lora:
            raise InvalidRequest("--lora-modules needs --enable-lora", "lora_modules")
        if self.enable_lora_runtime_updating and not self.enable_lora:
            raise InvalidRequest("--enable-lora-runtime-updating needs --enable-lora", "enable_lora_runtime_updating")
        if not self.enable_lora:
            return
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise InvalidRequest("--max-loras and --max-lora-rank must be >= 1", "max_loras")
        cpu = self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras
        if cpu < self.max_loras:
            raise InvalidRequest(f"--max-cpu-loras ({cpu}) must be >= --max-loras ({self.max_loras})", "max_cpu_loras")
        names = [n for n, _ in self.lora_modules]
        if len(set(names)) != len(names):
            raise InvalidRequest(f"--lora-modules names an adapter twice: {names}", "lora_modules")
        if self.lora_eager_load and len(names) > cpu:
            raise InvalidRequest(f"--lora-eager-load of {len(names)} adapters; --max-cpu-loras keeps {cpu}",
                                 "lora_modules")
        if self.enable_graph:
            raise InvalidRequest("--enable-lora and decode graphs (--enable-graph) do not go together yet",
                                 "enable_lora")
        if self.speculative_algorithm is not None:
            raise InvalidRequest("--enable-lora and speculative decoding do not go together yet", "enable_lora")

    def _validate_speculative(self) -> None:
        algo = self.speculative_algorithm
        if algo is None:
            return
        if algo not in SPECULATIVE_ALGORITHMS:
            raise InvalidRequest(f"speculative_algorithm must be one of {SPECULATIVE_ALGORITHMS}, got {algo!r}",
                                 "speculative_algorithm")
        if not 1 <= self.speculative_num_draft_tokens <= 32:
            raise InvalidRequest("speculative_num_draft_tokens must be in [1, 32]", "speculative_num_draft_tokens")
        if not 1 <= self.speculative_ngram_min <= self.speculative_ngram_max:
            raise InvalidRequest("need 1 <= speculative_ngram_min <= speculative_ngram_max", "speculative_ngram_min")
        if algo == "draft" and not self.speculative_draft_model:
            raise InvalidRequest("speculative_algorithm 'draft' needs speculative_draft_model", "speculative_draft_model")
