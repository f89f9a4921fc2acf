"""Tandem's deployable services (router, prefill, decode, gateway) and what they share (`common`)."""
