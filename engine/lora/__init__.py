"""LoRA adapters (PEFT format) applied per request in mixed batches: adapters.py loads and checks
them, registry.py keeps the known ones and loads them when needed, pool.py decides which stay loaded
(LRU), batch.py applies them to a step's tokens."""
