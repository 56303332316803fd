"""`make cluster`: compose.yaml's topology as processes on five hosts of this machine, each host a
Linux network namespace joined to the others by a veth pair on one bridge (needs root):

    data      10.36.0.10   Redis and PostgreSQL
    web       10.36.0.20   two web processes (ports 8000 and 8001)
    engine-1  10.36.0.31   an engine worker
    engine-2  10.36.0.32   an engine worker
    celery    10.36.0.40   the Celery worker and beat

Every process gets compose's variables (DATABASE_URL, REDIS_URL, SECRET_KEY, ...) with the data
host's veth address, so they reach each other over the veth links only; the bridge's own address
(10.36.0.1) is this (the host) namespace, from where the smoke check and clients connect.

    python deploy/cluster.py           up until Ctrl-C (prints the URLs, an admin login and API key)
    python deploy/cluster.py --smoke   up, check the playground and /v1 across it, down (exit 0 if passed)

tests/chaos imports this module to put faults between the hosts (partition, degrade).
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO_DIR = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO_DIR), str(REPO_DIR / "platform")]

from inference.gguf_files import resolve_model, served_model_name  # noqa: E402  (torch-free)
from tessera import embedded_postgres, embedded_redis  # noqa: E402
from tessera.supervisor import RestartPolicy, Supervisor  # noqa: E402

SUBNET = "10.36.0"
BRIDGE = "tessera-br0"
HOSTS = {"data": 10, "web": 20, "engine-1": 31, "engine-2": 32, "celery": 40}
HOST_ADDRESS = f"{SUBNET}.1"  # the bridge, in the host namespace
REDIS_PORT, POSTGRES_PORT, WEB_PORTS = 6379, 5432, (8000, 8001)
RESTART = RestartPolicy(backoff_s=1.0, max_backoff_s=10.0, min_uptime_s=10.0, max_fast_failures=5)
ADMIN = "admin"
# The engine runs on this machine's CPU: compose's engine variables with CPU values.
ENGINE_ENV = {"ENGINE_DEVICE": "cpu", "ENGINE_DTYPE": "float32", "ENGINE_ARGS": ""}


def namespace(host: str) -> str:
    return f"tessera-{host}"


def address(host: str) -> str:
    return f"{SUBNET}.{HOSTS[host]}"


def host_veth(host: str) -> str:
    """The host-namespace end of a host's veth pair (the other end is eth0 in its namespace)."""
    return f"ts-{host}"[:15]


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def in_namespace(host: str, argv: list[str]) -> list[str]:
    return ["ip", "netns", "exec", namespace(host), *argv]


# ---------------------------------------------------------------- the network


def create_network() -> None:
    """The bridge (with the host namespace's address) and one namespace + veth pair per host."""
    remove_network()
    ip("link", "add", BRIDGE, "type", "bridge")
    ip("addr", "add", f"{HOST_ADDRESS}/24", "dev", BRIDGE)
    ip("link", "set", BRIDGE, "up")
    for host in HOSTS:
        ns = namespace(host)
        ip("netns", "add", ns)
        ip("link", "add", host_veth(host), "type", "veth", "peer", "name", "eth0", "netns", ns)
        ip("link", "set", host_veth(host), "master", BRIDGE, "up")
        ip("-n", ns, "addr", "add", f"{address(host)}/24", "dev", "eth0")
        ip("-n", ns, "link", "set", "eth0", "up")
        ip("-n", ns, "link", "set", "lo", "up")


def remove_network() -> None:
    for host in HOSTS:
        ip("netns", "del", namespace(host), check=False)  # takes its veth pair with it
    ip("link", "del", BRIDGE, check=False)


def _nft(host: str, *rules: str) -> None:
    """This host's own nftables table `tessera_fault` with one chain per direction holding `rules`
    (replaced each time); no rules: the table is removed. Only the host's own namespace is touched."""
    run = ["ip", "netns", "exec", namespace(host), "nft"]
    subprocess.run([*run, "delete", "table", "inet", "tessera_fault"], capture_output=True)
    if not rules:
        return
    script = ["add table inet tessera_fault"]
    for hook in ("input", "output"):
        script.append(f"add chain inet tessera_fault {hook} {{ type filter hook {hook} priority 0; }}")
        script += [f"add rule inet tessera_fault {hook} {rule}" for rule in rules]
    subprocess.run([*run, "-f", "-"], input="\n".join(script) + "\n", text=True, check=True, capture_output=True)


def _tc_netem(host: str, *spec: str) -> bool:
    """netem on what a host sends (its eth0); False where the kernel has no netem (CONFIG_NET_SCH_NETEM)."""
    run = ["tc", "-n", namespace(host), "qdisc"]
    subprocess.run([*run, "del", "dev", "eth0", "root"], capture_output=True)
    if not spec:
        return True
    return subprocess.run([*run, "add", "dev", "eth0", "root", "netem", *spec], capture_output=True).returncode == 0


def partition(host: str) -> None:
    """Cut a host off: every packet in or out of it is dropped (its connections stay open, unanswered)."""
    _nft(host, "ip saddr != 127.0.0.0/8 drop")


def degrade(host: str, delay_ms: int, loss_percent: float) -> str:
    """Latency and loss on what a host sends; returns what was applied. Without netem in the kernel
    the loss comes from nftables (a random drop) and no latency can be added."""
    if _tc_netem(host, "delay", f"{delay_ms}ms", "loss", f"{loss_percent}%"):
        return f"{delay_ms} ms latency and {loss_percent}% loss (tc netem) on what {host} sends"
    subprocess.run(
        ["ip", "netns", "exec", namespace(host), "nft", "-f", "-"],
        check=True,
        capture_output=True,
        text=True,
        input="add table inet tessera_fault\nadd chain inet tessera_fault output "
        "{ type filter hook output priority 0; }\nadd rule inet tessera_fault output ip daddr != "
        f"127.0.0.0/8 numgen random mod 1000 < {int(loss_percent * 10)} drop\n",
    )
    return (
        f"{loss_percent}% loss (nftables) on what {host} sends; no latency: this kernel has no netem "
        "(CONFIG_NET_SCH_NETEM is not set)"
    )


def heal(host: str) -> None:
    _nft(host)
    _tc_netem(host)


# ---------------------------------------------------------------- the processes


@dataclass
class Cluster:
    work_dir: Path
    model: str
    supervisor: Supervisor = field(default_factory=lambda: Supervisor(grace_seconds=40.0))
    secret_key: str = field(default_factory=lambda: secrets.token_hex(32))
    redis_url: str = ""
    database_url: str = ""
    api_key: str = ""
    admin_password: str = field(default_factory=lambda: secrets.token_urlsafe(12))
    engine_args: str = ""  # compose's ENGINE_ARGS (a JSON object); the chaos suite sizes its tiny model's cache

    @property
    def web_urls(self) -> list[str]:
        return [f"http://{address('web')}:{port}" for port in WEB_PORTS]

    def app_env(self) -> dict[str, str]:
        """compose.yaml's x-app environment, with this cluster's addresses and secrets."""
        web = address("web")
        return {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": os.environ.get("HOME", "/root"),
            "DJANGO_SETTINGS_MODULE": "tessera.settings.prod",
            "SECRET_KEY": self.secret_key,
            "DATABASE_URL": self.database_url,
            "REDIS_URL": self.redis_url,
            "ALLOWED_HOSTS": f"{web},localhost",
            "CSRF_TRUSTED_ORIGINS": ",".join(self.web_urls),
            "SECURE_COOKIES": "0",  # plain HTTP on the bridge
            "MODEL": self.model,
            "SERVED_MODEL_NAME": "",
            "LOG_LEVEL": "INFO",
            # The Dockerfile's ENV: the code, and the shared media volume (here a folder all hosts see).
            "PYTHONPATH": f"{REPO_DIR}{os.pathsep}{REPO_DIR / 'platform'}",
            "PYTHONUNBUFFERED": "1",
            "TESSERA_VAR_DIR": str(self.work_dir / "var"),
            "TESSERA_CACHE_DIR": str(REPO_DIR / "var" / "cache"),
        }

    def start(self, ready_timeout: float = 600.0) -> None:
        assets = REPO_DIR / "var" / "assets"  # `make assets` (chart.js), which the image copies in at build
        (self.work_dir / "var").mkdir(parents=True, exist_ok=True)
        if assets.exists():
            (self.work_dir / "var" / "assets").symlink_to(assets)
        create_network()
        self.start_data_host()
        self.prepare_database()
        self.start_services()
        self.wait_until_ready(ready_timeout)

    def start_data_host(self) -> None:
        redis_dir = self.work_dir / "redis"
        redis_dir.mkdir(parents=True, exist_ok=True)
        argv = embedded_redis.server_command(REDIS_PORT, redis_dir, persistent=True, host=address("data"))
        redis = self.supervisor.start("redis", in_namespace("data", argv), tier=0, restart=RESTART)
        embedded_redis.wait_until_listening(REDIS_PORT, redis.process, host=address("data"))
        self.redis_url = embedded_redis.url(REDIS_PORT, embedded_redis.password(redis_dir), host=address("data"))
        layout = embedded_postgres.prepare(self.work_dir / "postgres")
        argv = embedded_postgres.server_command(layout, address("data"), POSTGRES_PORT)
        postgres = self.supervisor.start("postgres", in_namespace("data", argv), tier=0, restart=RESTART)
        embedded_postgres.wait_until_ready(address("data"), POSTGRES_PORT, postgres.process, log=None)
        embedded_postgres.create_database(address("data"), POSTGRES_PORT, layout.password())
        self.database_url = embedded_postgres.url(address("data"), POSTGRES_PORT, layout.password())

    def manage(self, host: str, *args: str) -> str:
        """A one-off `manage.py` on a host (compose's `migrate` service, `docker compose run`)."""
        done = subprocess.run(
            in_namespace(host, [sys.executable, str(REPO_DIR / "manage.py"), *args]),
            env=self.app_env(),
            cwd=REPO_DIR,
            capture_output=True,
            text=True,
            timeout=600,
        )
        if done.returncode != 0:
            raise RuntimeError(f"manage.py {' '.join(args)} on {host} failed:\n{done.stdout}\n{done.stderr}")
        return done.stdout

    def prepare_database(self) -> None:
        self.manage("celery", "migrate", "--noinput")
        self.manage("web", "collectstatic", "--noinput", "--verbosity", "0")  # the image does this at build
        self.manage(
            "web",
            "shell",
            "-c",
            "from django.contrib.auth import get_user_model; "
            f"get_user_model().objects.create_superuser({ADMIN!r}, 'admin@localhost', "
            f"{self.admin_password!r})",
        )
        self.api_key = self.manage("web", "create_api_key", ADMIN, "--name", "cluster").strip().splitlines()[-1]

    def service_commands(self) -> dict[str, tuple[str, list[str], dict[str, str]]]:
        """name -> (host, argv, extra env): compose's commands for web, engine, worker and beat."""
        py = sys.executable
        commands = {}
        for i, port in enumerate(WEB_PORTS, start=1):
            commands[f"web-{i}"] = (
                "web",
                [py, "-m", "tessera.web", "--host", address("web"), "--port", str(port), "--proxy-headers"],
                {},
            )
        for host in ("engine-1", "engine-2"):
            commands[host] = (
                host,
                [py, str(REPO_DIR / "manage.py"), "engine"],
                {**ENGINE_ENV, "ENGINE_ARGS": self.engine_args, "ENGINE_WORKER_ID": host},
            )
        commands["worker"] = (
            "celery",
            [py, "-m", "celery", "-A", "tessera", "worker", "--loglevel", "INFO", "--concurrency", "2"],
            {},
        )
        commands["beat"] = (
            "celery",
            [
                py,
                "-m",
                "celery",
                "-A",
                "tessera",
                "beat",
                "--loglevel",
                "INFO",
                "--schedule",
                str(self.work_dir / "celerybeat-schedule"),
            ],
            {},
        )
        return commands

    def start_services(self) -> None:
        for name, (host, argv, extra) in self.service_commands().items():
            self.supervisor.start(
                name, in_namespace(host, argv), env={**self.app_env(), **extra}, cwd=str(REPO_DIR), restart=RESTART
            )

    def health(self, url: str) -> dict | None:
        import json

        try:
            with urllib.request.urlopen(url + "/health", timeout=3) as response:
                return json.load(response)
        except (OSError, ValueError):
            return None

    def wait_until_ready(self, timeout: float) -> None:
        """Both web processes answer /health with both engine workers' heartbeats."""
        deadline = time.monotonic() + timeout

        def ready() -> bool:
            answers = [self.health(url) for url in self.web_urls]
            return all(a is not None and len(a.get("workers", [])) >= 2 for a in answers)

        exited = self.supervisor.watch(until=lambda: ready() or time.monotonic() > deadline, poll_seconds=1.0)
        if exited is not None:
            raise RuntimeError(f"{exited.describe()} before the cluster was ready")
        if not ready():
            raise RuntimeError(f"the cluster was not ready within {timeout:g}s")

    def stop(self) -> None:
        self.supervisor.stop()
        remove_network()


# ---------------------------------------------------------------- the smoke check


def loopback_connections() -> dict[str, list[str]]:
    """Each host's established TCP connections whose peer is a loopback address (there should be none)."""
    found = {}
    for host in HOSTS:
        out = subprocess.run(
            in_namespace(host, ["ss", "-Htn", "state", "established"]), capture_output=True, text=True
        ).stdout
        peers = [line.split()[-1] for line in out.splitlines() if line.strip()]
        found[host] = [p for p in peers if p.startswith(("127.", "[::1]", "[::ffff:127."))]
    return found


def established_peers(host: str) -> set[str]:
    out = subprocess.run(
        in_namespace(host, ["ss", "-Htn", "state", "established"]), capture_output=True, text=True
    ).stdout
    return {line.split()[-1].rsplit(":", 1)[0] for line in out.splitlines() if line.strip()}


def smoke(cluster: Cluster) -> list[str]:
    """The playground page and /v1 through each web process, from the host namespace; returns what failed."""
    import httpx
    import openai

    failures = []
    model = served_model_name(cluster.model)
    for url in cluster.web_urls:
        with httpx.Client(base_url=url, timeout=60) as http:
            login = http.get("/accounts/login/")
            token = http.cookies.get("csrftoken", "")
            http.post(
                "/accounts/login/",
                data={"username": ADMIN, "password": cluster.admin_password, "csrfmiddlewaretoken": token},
                headers={"Referer": url + "/"},
            )
            page = http.get("/chat/")
            if login.status_code != 200 or page.status_code != 200 or "playground" not in page.text.lower():
                failures.append(f"{url}/chat/: login {login.status_code}, playground {page.status_code}")
        client = openai.OpenAI(base_url=url + "/v1", api_key=cluster.api_key, max_retries=0, timeout=120)
        reply = client.chat.completions.create(
            model=model, max_tokens=8, messages=[{"role": "user", "content": "Say hello."}]
        )
        if not reply.choices[0].message.content or reply.usage.completion_tokens < 1:
            failures.append(f"{url}/v1/chat/completions: empty answer {reply}")
        stream = client.chat.completions.create(
            model=model, max_tokens=8, stream=True, messages=[{"role": "user", "content": "Count to three."}]
        )
        finishes = [c.choices[0].finish_reason for c in stream if c.choices and c.choices[0].finish_reason]
        if finishes not in (["length"], ["stop"]):
            failures.append(f"{url}/v1 stream ended with {finishes}")
    for host, peers in loopback_connections().items():
        if peers:
            failures.append(f"{host} has loopback connections: {peers}")
    data = address("data")
    for host in ("web", "engine-1", "engine-2", "celery"):
        if data not in established_peers(host):
            failures.append(f"{host} has no connection to the data host {data}")
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="start, check across the hosts, stop")
    args = parser.parse_args(argv)
    if os.geteuid() != 0 or not shutil.which("ip"):
        raise SystemExit("make cluster needs root and iproute2 (ip netns, veth, a bridge)")
    work_dir = Path(tempfile.mkdtemp(prefix="tessera-cluster-"))
    work_dir.chmod(0o755)  # PostgreSQL's user must reach its folder
    cluster = Cluster(work_dir=work_dir, model=resolve_model(os.environ.get("MODEL"), strict=True))
    try:
        cluster.start()
        say = cluster.supervisor.say
        say(
            f"\ncluster up: web {' '.join(cluster.web_urls)}; data {address('data')}; engines "
            f"{address('engine-1')} {address('engine-2')}; celery {address('celery')}"
        )
        say(f"  admin login: {ADMIN} / {cluster.admin_password}\n  API key:     {cluster.api_key}")
        failures = smoke(cluster)
        for failure in failures:
            say(f"smoke: FAILED {failure}")
        say(
            "smoke: "
            + (
                "failed"
                if failures
                else "the playground and /v1 answer through both web processes; "
                "no loopback connections; every host talks to the data host over its veth"
            )
        )
        if args.smoke:
            return 1 if failures else 0
        say(f"ready: {cluster.web_urls[0]}/ (Ctrl-C stops everything)")
        exited = cluster.supervisor.watch()
        return 1 if exited is not None else 0
    except KeyboardInterrupt:
        return 0
    finally:
        cluster.stop()
        shutil.rmtree(work_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
