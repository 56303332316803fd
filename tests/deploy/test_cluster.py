"""deploy/cluster.py (`make cluster`) needs nothing compose.yaml does not configure: every variable it
gives a process is one compose.yaml's services (or the Dockerfile's ENV) set, every command is compose's
entry point, and every address is a veth address of its own subnet, never loopback. Bringing the
cluster up takes root and minutes: `make cluster ARGS=--smoke` and `make chaos` do that."""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path

import yaml
from test_compose import check_entry_point

from deploy import cluster

REPO = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((REPO / "compose.yaml").read_text())
# What every process of any OS needs to start at all, not configuration.
PROCESS_BASICS = {"PATH", "HOME"}


def dockerfile_env() -> set[str]:
    text = (REPO / "Dockerfile").read_text()
    block = re.search(r"^ENV (.+?)(?:\n(?!\s))", text, re.S | re.M).group(1)
    return set(re.findall(r"([A-Z_][A-Z0-9_]*)=", block))


def compose_env(service: str) -> set[str]:
    return set(COMPOSE["services"][service]["environment"])


def a_cluster(tmp_path) -> cluster.Cluster:
    return cluster.Cluster(
        work_dir=tmp_path,
        model="/models/m.gguf",
        redis_url="redis://:pw@10.36.0.10:6379/0",
        database_url="postgres://tessera:pw@10.36.0.10:5432/tessera",
    )


def test_every_variable_the_cluster_sets_is_configured_by_compose(tmp_path):
    c = a_cluster(tmp_path)
    configured = dockerfile_env() | PROCESS_BASICS
    service_of = {
        "web-1": "web",
        "web-2": "web",
        "engine-1": "engine",
        "engine-2": "engine",
        "worker": "worker",
        "beat": "beat",
    }
    for name, (_host, _argv, extra) in c.service_commands().items():
        allowed = configured | compose_env(service_of[name])
        env = {**c.app_env(), **extra}
        assert set(env) <= allowed, f"{name} sets {sorted(set(env) - allowed)}, which compose.yaml does not"
    assert set(c.app_env()) >= compose_env("web") - {"SERVED_MODEL_NAME"}  # and it sets all of compose's


def test_the_cluster_runs_composes_commands_on_its_hosts(tmp_path):
    c = a_cluster(tmp_path)
    commands = c.service_commands()
    assert {host for host, _, _ in commands.values()} == {"web", "engine-1", "engine-2", "celery"}
    for name, (host, argv, _extra) in commands.items():
        argv = ["python", *argv[1:]]  # sys.executable, as compose's image runs `python`
        if argv[1].endswith("manage.py"):
            argv[1] = "manage.py"
        if argv[1:3] == ["-m", "celery"]:
            argv = argv[2:]
        check_entry_point(argv)
        assert cluster.in_namespace(host, ["x"])[:4] == ["ip", "netns", "exec", f"tessera-{host}"]


def test_every_address_is_a_veth_address_of_the_clusters_subnet_never_loopback(tmp_path):
    c = a_cluster(tmp_path)
    subnet = ipaddress.ip_network(f"{cluster.SUBNET}.0/24")
    addresses = [ipaddress.ip_address(cluster.address(h)) for h in cluster.HOSTS]
    assert len(set(addresses)) == len(cluster.HOSTS) and all(a in subnet and not a.is_loopback for a in addresses)
    env = c.app_env()
    for url in (env["REDIS_URL"], env["DATABASE_URL"], *c.web_urls):
        host = url.rsplit("@", 1)[-1].split("//")[-1].split(":")[0]
        assert ipaddress.ip_address(host) in subnet
    for _name, (host, argv, _extra) in c.service_commands().items():
        if "--host" in argv:
            assert argv[argv.index("--host") + 1] == cluster.address(host)
    assert all(len(cluster.host_veth(h)) <= 15 for h in cluster.HOSTS)  # Linux's interface name limit
