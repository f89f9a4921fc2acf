"""The KV-tiers benchmark across hosts, its pure parts: the same configuration's flags split between the
router and the workers as `tandem up` splits them, each worker's own cores and L3 directory, and what
--hosts refuses (no namespaces, no servers, no torch)."""

import pytest

from tandem.bench.serve import kvtiers
from tandem.bench.serve.kvtiers_hosts import ClusterConfigUp, host_args, split_up_args


def up_argv(name: str, *extra: str) -> list[str]:
    cfg = kvtiers.KVTiersConfig(host_cache_gb=0.5, disk_cache_gb=2)
    return [*kvtiers.tandem_args(name, cfg, 4096, "/one/host/dir"), "--dtype", "bfloat16", *extra]


def test_router_and_worker_flags_are_split_as_tandem_up_splits_them():
    workers, router = split_up_args(up_argv("1p1d-tiers-no-d2p", "--local-prefill-max-tokens", "-1"))
    assert sorted(router) == sorted(["--local-prefill-max-tokens", "-1", "--kv-reuse-policy", "never"])
    for flag in ("--max-total-tokens", "--kv-host-cache-gb", "--kv-disk-cache-gb", "--dtype"):
        assert flag in workers and flag not in router
    assert "--kv-reuse-policy" not in workers and "--mode" not in workers + router


def test_the_default_policy_gives_the_router_nothing_to_change():
    _, router = split_up_args(up_argv("1p1d-tiers"))
    assert "--kv-reuse-policy" not in router


def test_each_worker_gets_its_own_core_and_l3_directory():
    dep = ClusterConfigUp("1p1d-tiers", up_argv("1p1d-tiers"), True, "smollm2-135m", 1000.0, 60, "openai-http")
    assert "--kv-disk-cache-dir" not in dep.worker_args and "/one/host/dir" not in dep.worker_args
    own = host_args({"prefill-0": "/p", "decode-0": "/d"})
    assert own == {"prefill-0": ("--cpu-cores", "0", "--kv-disk-cache-dir", "/p"),
                   "decode-0": ("--cpu-cores", "1", "--kv-disk-cache-dir", "/d")}
    assert host_args({}) == {"prefill-0": ("--cpu-cores", "0"), "decode-0": ("--cpu-cores", "1")}
    assert "1000 Mbit/s" in dep.describe() and "--kv-host-cache-gb" in dep.describe()


def test_hosts_refuse_what_is_not_1p1d():
    with pytest.raises(ValueError, match="1P1D"):
        split_up_args(up_argv("colo-tiers"))
    with pytest.raises(ValueError, match="--seed"):
        split_up_args(up_argv("1p1d-tiers", "--seed", "3"))
    assert kvtiers.main(["--hosts", "--configs", "1p1d-tiers,vllm"]) == 2


def test_hosts_deployment_is_made_from_the_same_plan(tmp_path):
    cfg = kvtiers.KVTiersConfig(configs=("1p1d-tiers",), hosts=True, link_mbit=1000.0, up_args=("--kv-link-gbps", "1"))
    plan = kvtiers.Plan("bfloat16", [], 4096, {})
    dep = kvtiers.make_deployment("1p1d-tiers", cfg, plan)
    assert isinstance(dep, ClusterConfigUp) and dep.link_mbit == 1000.0 and dep.tiers
    assert "--max-total-tokens" in dep.worker_args and "4096" in dep.worker_args
    assert dep.router_args == ["--kv-link-gbps", "1.0"]
