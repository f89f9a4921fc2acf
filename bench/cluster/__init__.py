"""Several hosts on one machine: network namespaces on a bridge (net.py) and a Tandem deployment
across them (deploy.py), for `make test-cluster` and the network chaos drill (bench/chaos.py)."""
