"""KV blocks between processes: the contract between workers and the router.

`keys` (a block's key: a hash chain over the model's KV layout and token ids, the same in every
process), `blocks` (the tiers and a block's identity) and `events` (what a worker tells the router it
holds). Both sides import these; neither side's code lives here. Standard library only, so the
router imports them without torch or the engine.
"""
