"""Co-located worker: prefill and decode in one process, same schedulers, no transfer (the baseline)."""
