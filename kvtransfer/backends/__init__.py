"""Data paths that plug a library into the transfer protocol through kvtransfer/datapath.py: nixl
(one-sided NIXL WRITEs) and ucx (UCX tagged messages), with the ucx helpers. They are imported only
when a backend that uses them is created (registry.py)."""
