"""deploy/docker-compose.yml without a Docker engine: it validates (Debian's docker-compose, which
`make install` puts there), with the monitoring profile too, deploy/compose_command.py reads it as
compose does, every service's command parses with our CLIs, the seed's values give back the
seed's three commands flag for flag, the CPU deployment of the multi-host test passes start-up
validation, and Prometheus scrapes every role where the compose file puts it, for Grafana's
provisioned dashboard."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from deploy.compose_command import ComposeError, interpolate, load_service, read_env_file
from router.config import RouterConfig
from serving.config import ModelConfig
from serving.server_args import ServerArgs
from tests.test_cli import seed_commands
from tests.test_multihost_netns import deployment_env

REPO = Path(__file__).resolve().parents[1]
COMPOSE = REPO / "deploy" / "docker-compose.yml"
RDMA = REPO / "deploy" / "docker-compose.rdma.yml"
ENV_EXAMPLE = REPO / "deploy" / "pdserve.env.example"
SERVICES = ("prefill", "decode", "router")
MONITORING = ("prometheus", "grafana")  # the "monitoring" profile
GRAFANA = REPO / "deploy" / "monitoring" / "grafana"

# The seed's router command (shared/seed), after `python3 -m sglang_router.launch_router`.
SEED_ROUTER = """--pd-disaggregation --prefill-policy round_robin --decode-policy round_robin
  --prefill "http://$PREFILL_HOST:32171" 28998 --decode "http://$DECODE_HOST:32172"
  --host 0.0.0.0 --port 30000 --request-timeout-secs 1800 --model-path "$MODEL_PATH" """

# What separates the compose defaults from the seed: values this build cannot run yet.
SEED_ENV = {
    "MODEL_PATH": "/models/GLM-5.3-Flash",
    "IB_DEVICES": "mlx5_0,mlx5_1",
    "PREFILL_HOST": "10.0.0.1",
    "DECODE_HOST": "10.0.0.2",
    "ROUTER_BIND": "0.0.0.0",
    "TP_SIZE": "8",
    "EP_SIZE": "8",
    "DSA_PREFILL_BACKEND": "tilelang",
    "DSA_DECODE_BACKEND": "tilelang",
    "MOE_RUNNER_BACKEND": "triton",
}

needs_compose = pytest.mark.skipif(
    shutil.which("docker-compose") is None,
    reason="docker-compose is not installed (make install gets Debian's: apt-get install "
    "docker-compose)",
)


def docker_compose_config(env: dict[str, str], *files: Path) -> dict:
    flags = [arg for f in files for arg in ("-f", str(f))]
    out = subprocess.run(
        ["docker-compose", *flags, "config"],
        capture_output=True,
        text=True,
        env={"PATH": os.environ["PATH"], **env},
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)


def substitute(argv: list[str], env: dict[str, str]) -> list[str]:
    return [re.sub(r"\$(\w+)", lambda m: env[m.group(1)], a) for a in argv]


def compose_variables() -> dict[str, str | None]:
    """Every ${VAR...} in the compose file: its default, or None when it has none."""
    found: dict[str, str | None] = {}
    for name, default in re.findall(r"\$\{(\w+)(?::-([^}]*))?", COMPOSE.read_text()):
        found[name] = default or found.get(name)
    return found


@needs_compose
@pytest.mark.parametrize("files", [(COMPOSE,), (COMPOSE, RDMA)], ids=["base", "rdma"])
def test_compose_files_validate(files: tuple[Path, ...]) -> None:
    config = docker_compose_config(read_env_file(ENV_EXAMPLE), *files)
    assert set(config["services"]) == {*SERVICES, *MONITORING}
    for name, service in config["services"].items():
        assert service.get("profiles") == (["monitoring"] if name in MONITORING else None), name


@needs_compose
def test_the_monitoring_profile_validates_and_scrapes_every_role() -> None:
    """With the profile on, compose accepts the file; Prometheus's config (written by its
    service's shell command, which must parse) targets each service where the compose file
    puts it, under job = role."""
    env = {**read_env_file(ENV_EXAMPLE), "PREFILL_HOST": "10.0.0.1", "DECODE_HOST": "10.0.0.2"}
    flags = ["--profile", "monitoring", "-f", str(COMPOSE), "config", "--services"]
    out = subprocess.run(["docker-compose", *flags], capture_output=True, text=True,
                         env={"PATH": os.environ["PATH"], **env}, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert set(out.stdout.split()) == {*SERVICES, *MONITORING}
    script = docker_compose_config(env, COMPOSE)["services"]["prometheus"]["command"][0]
    assert script == load_service("prometheus", env)[0][0]  # our reader agrees
    assert subprocess.run(["sh", "-n", "-c", script]).returncode == 0
    config = yaml.safe_load(script.split("<<'CONFIG'\n")[1].split("\nCONFIG\n")[0])
    targets = {j["job_name"]: j["static_configs"][0]["targets"] for j in config["scrape_configs"]}
    want = {}
    for role in SERVICES:
        command, environment = load_service(role, env)
        host = environment.get("SGLANG_HOST_IP") or command[command.index("--host") + 1]
        want[role] = [f"{host}:{command[command.index('--port') + 1]}"]
    assert targets == want == {"prefill": ["10.0.0.1:32171"], "decode": ["10.0.0.2:32172"],
                               "router": ["127.0.0.1:30000"]}  # fmt: skip
    for role in ("prefill", "decode"):  # the workers serve /metrics
        assert ServerArgs.from_cli(load_service(role, env)[0][3:]).enable_metrics
    assert "--web.listen-address=127.0.0.1:9090" in script


def test_grafana_is_provisioned_with_the_datasource_and_the_dashboard() -> None:
    service = yaml.safe_load(COMPOSE.read_text())["services"]["grafana"]
    mounts = dict(v.rsplit(":", 1)[0].split(":", 1) for v in service["volumes"] if "./" in v)
    assert mounts == {"./monitoring/grafana/provisioning": "/etc/grafana/provisioning",
                      "./monitoring/grafana/dashboards": "/etc/pdserve/dashboards"}  # fmt: skip
    datasource = yaml.safe_load((GRAFANA / "provisioning/datasources/prometheus.yml").read_text())
    (source,) = datasource["datasources"]
    assert source["url"] == "$PROMETHEUS_URL" and "PROMETHEUS_URL" in service["environment"]
    provider = yaml.safe_load((GRAFANA / "provisioning/dashboards/pdserve.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/etc/pdserve/dashboards"
    home = service["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    dashboard = json.loads((GRAFANA / "dashboards" / Path(home).name).read_text())
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert panels and all(p["targets"] for p in panels)
    for panel in panels:
        for target in [panel, *panel["targets"]]:
            assert target["datasource"]["uid"] == source["uid"], panel["title"]


@needs_compose
def test_a_missing_model_path_is_named() -> None:
    out = subprocess.run(
        ["docker-compose", "-f", str(COMPOSE), "config"],
        capture_output=True,
        text=True,
        env={"PATH": os.environ["PATH"]},
    )
    assert out.returncode != 0 and "set MODEL_PATH" in out.stderr


@needs_compose
@pytest.mark.parametrize("env", [SEED_ENV, read_env_file(ENV_EXAMPLE)], ids=["seed", "example"])
def test_our_reader_matches_docker_compose(env: dict[str, str]) -> None:
    config = docker_compose_config(env, COMPOSE)
    for name in SERVICES:
        command, environment = load_service(name, env)
        service = config["services"][name]
        assert command == [str(a) for a in service["command"]]
        assert environment == {k: str(v) for k, v in (service.get("environment") or {}).items()}


def test_the_seed_values_give_the_seed_commands() -> None:
    seed = seed_commands()
    for role in ("prefill", "decode"):
        command, environment = load_service(role, SEED_ENV)
        assert command[:3] == ["python3", "-m", "serving.launch_server"]
        # two deliberate differences: a worker binds the address it advertises, not 0.0.0.0,
        # and serves /metrics (for the monitoring profile)
        want = substitute(seed[role], SEED_ENV)
        want[want.index("--host") + 1] = SEED_ENV[f"{role.upper()}_HOST"]
        assert command[3:] == [*want, "--enable-metrics"]
        assert environment["SGLANG_HOST_IP"] == SEED_ENV[f"{role.upper()}_HOST"]
        assert environment["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] == "0"
    command, _ = load_service("router", SEED_ENV)
    assert command[:3] == ["python3", "-m", "router.launch_router"]
    want = substitute(shlex.split(SEED_ROUTER), SEED_ENV)
    assert command[3 : 3 + len(want)] == want
    assert command[3 + len(want) :] == [
        "--health-check-interval-secs", "10", "--health-check-timeout-secs", "5",
    ]  # fmt: skip


@pytest.mark.parametrize(
    "env",
    [{"MODEL_PATH": "/m"}, SEED_ENV, read_env_file(ENV_EXAMPLE)],
    ids=["defaults", "seed", "example"],
)
def test_every_service_command_parses_and_the_addresses_agree(env: dict[str, str]) -> None:
    """The --help-style dry run: each command line through our own argument parsers."""
    (prefill, p_env), (decode, d_env) = (load_service(r, env) for r in ("prefill", "decode"))
    router, _ = load_service("router", env)
    p = ServerArgs.from_cli(prefill[3:])
    d = ServerArgs.from_cli(decode[3:])
    r = RouterConfig.from_cli(router[3:])
    assert (p.disaggregation_mode, d.disaggregation_mode) == ("prefill", "decode")
    assert r.prefill == (
        (f"http://{p_env['SGLANG_HOST_IP']}:{p.port}", p.disaggregation_bootstrap_port),
    )
    assert r.decode == (f"http://{d_env['SGLANG_HOST_IP']}:{d.port}",)
    assert p.model_path == d.model_path == r.model_path == env["MODEL_PATH"]
    assert (p.disaggregation_ib_device is None) == (env.get("IB_DEVICES", "none") == "none")


def test_the_cpu_deployment_passes_start_up_validation(tiny_ckpt: Path) -> None:
    """The values test_multihost_netns runs with: what a worker checks before loading."""
    pytest.importorskip("mooncake.engine")
    env = deployment_env(tiny_ckpt)
    for role in ("prefill", "decode"):
        args = ServerArgs.from_cli(load_service(role, env)[0][3:])
        args.validate()
        args.validate_for_model(ModelConfig.from_pretrained(args.model_path))
        assert args.resolved_device() == "cpu"


def test_the_env_example_lists_every_variable_with_its_default() -> None:
    variables = compose_variables()
    example = read_env_file(ENV_EXAMPLE)
    assert set(example) == set(variables)
    for name, default in variables.items():
        if default is not None:
            assert example[name] == default, name


def test_services_have_health_checks_restart_gpus_and_the_model_volume() -> None:
    config = yaml.safe_load(COMPOSE.read_text())
    ports = {"prefill": "PREFILL_PORT", "decode": "DECODE_PORT", "router": "ROUTER_PORT",
             "prometheus": "PROMETHEUS_PORT", "grafana": "GRAFANA_PORT"}  # fmt: skip
    for name, service in config["services"].items():
        assert service["network_mode"] == "host"
        assert service["restart"] == "unless-stopped"
        assert ports[name] in " ".join(service["healthcheck"]["test"])
        if name in MONITORING:
            continue
        volume = service["volumes"][0]
        assert volume.startswith("model:${MODEL_PATH") and volume.endswith(":ro")
        gpus = service.get("deploy", {}).get("resources", {}).get("reservations", {})
        assert bool(gpus.get("devices")) == (name != "router")
    assert config["volumes"]["model"]["driver_opts"]["device"] == "${MODEL_PATH}"


def test_interpolation_follows_compose() -> None:
    env = {"SET": "v", "EMPTY": ""}
    assert interpolate("$$SET ${SET} $SET ${UNSET}", env) == "$SET v v "
    assert interpolate("${EMPTY:-d} ${EMPTY-d} ${UNSET-d}", env) == "d  d"
    assert interpolate("${EMPTY?m}", env) == ""
    for text in ("${UNSET:?say why}", "${EMPTY:?say why}"):
        with pytest.raises(ComposeError, match="say why"):
            interpolate(text, env)
    with pytest.raises(ComposeError, match="unsupported"):
        interpolate("${SET:+alt}", env)
    for text in ("${UNSET:-${SET}}", "5$ each"):
        with pytest.raises(ComposeError, match="lone"):
            interpolate(text, env)


def test_only_what_must_be_reachable_is_bound_and_the_key_is_passed() -> None:
    env = {"MODEL_PATH": "/m", "PREFILL_HOST": "10.0.0.1", "DECODE_HOST": "10.0.0.2",
           "API_KEY": "k3y"}  # fmt: skip
    for role, host in (("prefill", "10.0.0.1"), ("decode", "10.0.0.2"), ("router", "127.0.0.1")):
        command, environment = load_service(role, env)
        assert command[command.index("--host") + 1] == host
        assert environment["SGLANG_API_KEY"] == "k3y"
        assert "0.0.0.0" not in command
    _, environment = load_service("decode", {"MODEL_PATH": "/m"})
    assert environment["SGLANG_API_KEY"] == ""  # unset: no key (ServerArgs reads "" as none)
    assert (environment["MC_MIN_RPC_PORT"], environment["MC_MAX_RPC_PORT"]) == ("15000", "17000")
    config = yaml.safe_load(COMPOSE.read_text())
    for service in config["services"].values():
        assert "ports" not in service  # host networking: nothing published on 0.0.0.0 by Docker
        probe = " ".join(service["healthcheck"]["test"])
        assert "127.0.0.1:" not in probe, probe  # the bound address, not a hard-coded one


def test_compose_command_prints_the_command_or_names_what_is_missing() -> None:
    script = [sys.executable, str(REPO / "deploy" / "compose_command.py")]
    env = {"PATH": os.environ["PATH"]}
    out = subprocess.run(
        [*script, "decode", "--env-file", str(ENV_EXAMPLE)], capture_output=True, text=True, env=env
    )
    assert out.returncode == 0, out.stderr
    assert "export SGLANG_HOST_IP=127.0.0.1\n" in out.stdout
    assert "python3 -m serving.launch_server \\\n  --model-path /models/GLM-5.3-Flash \\\n" in (
        out.stdout
    )
    assert "  --disaggregation-decode-extra-slots 64 \\\n" in out.stdout
    out = subprocess.run([*script, "router"], capture_output=True, text=True, env=env)
    assert out.returncode == 1 and out.stderr.startswith("error: MODEL_PATH: set MODEL_PATH")
