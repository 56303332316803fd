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
import json
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


def _nft(host: str, *rules: str, hooks: tuple[str, ...] = ("input", "output")) -> None:
    """This host's own nftables table `tessera_fault` with one chain per hook holding `rules`
    (replaced each time); no rules: the table is removed. Only the host's own namespace is touched."""
    run = ["ip", "netns", "exec", namespace(host), "nft"]
    subprocess.run([*run, "delete", "table", "inet", "tessera_fault"], capture_output=True)
    if not rules:
        return
    script = ["add table inet tessera_fault"]
    for hook in hooks:
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


# ---------------------------------------------------------------- latency without netem: NFQUEUE

# The queue number deploy/delayer.py reads in a host's namespace (queues are per namespace).
DELAY_QUEUE = 36
_delayers: dict[str, subprocess.Popen] = {}
_queue_rules: dict[str, list[str]] = {}  # host -> the iptables rule spec to delete at heal


def degrade(host: str, delay_ms: int, loss_percent: float, to: str | None = None) -> str:
    """Latency and loss on what a host sends (to `to`'s address only, if given); returns what was
    applied, in words. The loss is an nftables random drop. The latency: each packet is queued to
    userspace (an NFQUEUE rule: nftables `queue` where the kernel has it, else iptables' NFQUEUE
    target) and deploy/delayer.py, in the host's namespace, lets it go delay_ms later, in order;
    where no queue rule can be made, tc netem on the host's eth0 (then on all it sends); else none,
    and the reason is in the answer."""
    heal(host)
    match = f"ip daddr {address(to)}" if to else "ip daddr != 127.0.0.0/8"
    where = f"what {host} sends to {to} ({address(to)})" if to else f"what {host} sends"
    latency = _delay(host, delay_ms, to) if delay_ms else ""
    rules = [f"{match} numgen random mod 1000 < {int(loss_percent * 10)} drop"] if loss_percent else []
    _nft(host, *rules, hooks=("output",))
    if delay_ms and not latency:
        if _tc_netem(host, "delay", f"{delay_ms}ms"):
            latency = f"{delay_ms} ms latency (tc netem, on all {host} sends)"
        else:
            latency = (
                "no latency: this kernel has no netem (CONFIG_NET_SCH_NETEM) and no NFQUEUE rule could be made "
                "(nftables `queue` needs CONFIG_NFT_QUEUE; iptables' NFQUEUE target needs iptables: make netfilter)"
            )
    loss = f"{loss_percent:g}% loss (nftables)" if loss_percent else ""
    return f"{' and '.join(x for x in (latency, loss) if x)} on {where}"


def _delay(host: str, delay_ms: int, to: str | None) -> str:
    """Start the delayer in the host's namespace and queue what it sends to it; '' if no rule could be made."""
    argv = [
        sys.executable,
        str(REPO_DIR / "deploy" / "delayer.py"),
        "--queue",
        str(DELAY_QUEUE),
        "--delay-ms",
        str(delay_ms),
    ]
    delayer = subprocess.Popen(in_namespace(host, argv), stdout=subprocess.PIPE, text=True)
    assert delayer.stdout is not None
    if delayer.stdout.readline().strip() != "bound":  # it is reading the queue before any packet goes there
        delayer.wait()
        return ""
    _delayers[host] = delayer
    # `bypass`: while no delayer reads the queue, packets pass (a dead delayer never cuts the link).
    nft_rule = f"{'ip daddr ' + address(to) if to else 'oifname != lo'} queue num {DELAY_QUEUE} bypass"
    if _nft_queue(host, nft_rule):
        return f"{delay_ms} ms latency (nftables queue to the delayer)"
    if shutil.which("iptables"):
        spec = ["-d", address(to)] if to else ["!", "-o", "lo"]
        spec += ["-j", "NFQUEUE", "--queue-num", str(DELAY_QUEUE), "--queue-bypass"]
        added = subprocess.run(
            in_namespace(host, ["iptables", "-w", "-t", "mangle", "-A", "OUTPUT", *spec]), capture_output=True
        )
        if added.returncode == 0:
            _queue_rules[host] = spec
            return f"{delay_ms} ms latency (iptables NFQUEUE to the delayer)"
    _stop_delayer(host)
    return ""


def _nft_queue(host: str, rule: str) -> bool:
    """An nftables `queue` rule in the host's own table `tessera_delay`; False where the kernel has no nft_queue."""
    script = (
        "add table inet tessera_delay\n"
        "add chain inet tessera_delay output { type filter hook output priority -150; }\n"
        f"add rule inet tessera_delay output {rule}\n"
    )
    done = subprocess.run(in_namespace(host, ["nft", "-f", "-"]), input=script, text=True, capture_output=True)
    if done.returncode != 0:
        subprocess.run(in_namespace(host, ["nft", "delete", "table", "inet", "tessera_delay"]), capture_output=True)
    return done.returncode == 0


def _stop_delayer(host: str) -> dict | None:
    """Stop the host's delayer (it lets what it holds go first); what it did, or None if none ran."""
    delayer = _delayers.pop(host, None)
    if delayer is None:
        return None
    delayer.terminate()
    out, _ = delayer.communicate(timeout=30)
    lines = out.strip().splitlines()
    return json.loads(lines[-1]) if lines else None


def heal(host: str) -> str:
    """Clear every fault on the host; returns what its delayer did (empty if none ran)."""
    _nft(host)
    subprocess.run(in_namespace(host, ["nft", "delete", "table", "inet", "tessera_delay"]), capture_output=True)
    spec = _queue_rules.pop(host, None)
    if spec is not None:
        subprocess.run(
            in_namespace(host, ["iptables", "-w", "-t", "mangle", "-D", "OUTPUT", *spec]), capture_output=True
        )
    _tc_netem(host)
    stats = _stop_delayer(host)
    if not stats:
        return ""
    return (
        f"the delayer held {stats['packets']} packets {stats['held_ms_min']:.0f}-{stats['held_ms_max']:.0f} ms "
        f"(median {stats['held_ms_median']:.0f}); the kernel dropped {stats['queue_dropped']} for a full queue, "
        f"{stats['user_dropped']} for a full socket"
    )


def redis_ping_ms(host: str, redis_url: str, count: int = 7) -> float:
    """The median round trip of a Redis PING from a host's namespace (a new connection, connected first)."""
    script = (
        "import redis, sys, time\n"
        "r = redis.Redis.from_url(sys.argv[1], socket_timeout=30); r.ping(); times = []\n"
        f"for _ in range({count}):\n"
        "    t = time.monotonic(); r.ping(); times.append(time.monotonic() - t)\n"
        "print(sorted(times)[len(times) // 2] * 1000)\n"
    )
    done = subprocess.run(
        in_namespace(host, [sys.executable, "-c", script, redis_url]),
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    return float(done.stdout.strip())


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
        self.redis_url = embedded_redis.url(REDIS_PORT, embedded_redis.password(redis_dir), host=address("data"))
        embedded_redis.wait_until_ready(self.redis_url, redis.process)
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
