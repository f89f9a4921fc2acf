"""LoRA adapters (PEFT format) applied per request in mixed batches: adapters.py loads and checks
them, batch.py applies them to a step's tokens."""
