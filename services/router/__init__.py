"""The router: serves the public `tandem.v1.Generation` API and pairs each request with a prefill and a
decode worker found through the registry (or relays it to a co-located worker). Never imports torch."""
