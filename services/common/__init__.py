"""Torch-free pieces every service shares: worker discovery and the error -> gRPC status mapping."""
