"""deploy/kubernetes/ checked without a cluster: every object validates against Kubernetes 1.30's
schemas (strict: an unknown field fails), the kustomization lists every file, every SWERL_* env
var is a field of its service's settings class and the values make valid settings, the ports
and probes are the services' own, every Secret key referenced exists, the addresses name the
Services, and the exec node's DaemonSet mounts its state dir and runtime socket at their host
paths (docs/kubernetes.md).

Each check is a function that returns the problems it finds; the second half of this file
breaks a copy of the manifests one way per check and asserts the check names the breakage.
Nothing here needs a cluster or dockerd: whether the manifests RUN is untested.
"""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock
from urllib.parse import urlparse

import kubernetes_validate
import pytest
import yaml
from pydantic import ValidationError

from swerl.agent.settings import AgentSettings
from swerl.chassis.settings import ServiceSettings
from swerl.exec.runtimes import DEFAULT_SOCKETS
from swerl.exec.settings import ExecSettings
from swerl.pool.settings import PoolSettings
from swerl.prm.settings import PrmSettings

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = REPO / "deploy" / "kubernetes"
# The Kubernetes release the manifests target (grpc probes are GA from 1.27); docs/kubernetes.md
# says the same.
KUBERNETES_VERSION = "1.30.0"
# A container's service is its first argument (`swerl exec serve`).
SETTINGS: dict[str, type[ServiceSettings]] = {
    "exec": ExecSettings,
    "pool": PoolSettings,
    "agent": AgentSettings,
    "prm": PrmSettings,
}
# What the downward API would give, for building settings from the manifests here.
FIELD_REFS = {"spec.nodeName": "k8s-node-1", "status.hostIP": "10.0.0.11"}
WORKLOAD_KINDS = ("Deployment", "DaemonSet", "StatefulSet")
_VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")

Manifests = dict[str, list[dict[str, Any]]]


def load_manifests() -> Manifests:
    """Every object of every manifest file, by file name; the kustomization is not an object."""
    return {
        path.name: [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
        for path in sorted(MANIFESTS.glob("*.yaml"))
        if path.name != "kustomization.yaml"
    }


def load_kustomization() -> dict[str, Any]:
    return yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())


def _objects(manifests: Manifests) -> Iterator[dict[str, Any]]:
    for docs in manifests.values():
        yield from docs


def _name(obj: dict[str, Any]) -> str:
    return f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"


def _containers(manifests: Manifests) -> Iterator[tuple[dict, dict, dict]]:
    """(workload, pod spec, container) for each container of each workload."""
    for obj in _objects(manifests):
        if obj.get("kind") in WORKLOAD_KINDS:
            pod = obj["spec"]["template"]["spec"]
            for container in pod.get("containers", []):
                yield obj, pod, container


def _service_of(container: dict) -> str:
    return (container.get("args") or [""])[0]


def _secrets(manifests: Manifests) -> dict[str, dict[str, str]]:
    """Secret name -> its keys and (placeholder) values."""
    found = {}
    for obj in _objects(manifests):
        if obj.get("kind") == "Secret":
            values = dict(obj.get("stringData") or {})
            values.update({key: "<base64>" for key in obj.get("data") or {}})
            found[obj["metadata"]["name"]] = values
    return found


def container_env(container: dict, secrets: dict[str, dict[str, str]]) -> dict[str, str]:
    """The environment the container would get: literal values with `$(VAR)` expanded as the
    kubelet expands them, Secret keys from the Secret manifest, downward-API fields faked."""
    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = _VAR_REF.sub(
                lambda m: env.get(m.group(1), m.group(0)), str(var["value"])
            )
            continue
        source = var.get("valueFrom", {})
        if "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            env[var["name"]] = secrets.get(ref["name"], {}).get(ref["key"], "")
        elif "fieldRef" in source:
            env[var["name"]] = FIELD_REFS.get(source["fieldRef"]["fieldPath"], "x")
    return env


def settings_of(container: dict, manifests: Manifests) -> ServiceSettings:
    """The service's settings as the container's environment makes them (ValidationError if
    they are not valid)."""
    env = container_env(container, _secrets(manifests))
    with mock.patch.dict(os.environ, env, clear=True):
        return SETTINGS[_service_of(container)]()


# -- the checks: each returns the problems it finds ----------------------------------------


def schema_problems(manifests: Manifests) -> list[str]:
    problems = []
    for file, docs in manifests.items():
        for obj in docs:
            try:
                kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
            except kubernetes_validate.ValidationError as err:
                path = "/".join(str(part) for part in err.path)
                problems.append(f"{file} {_name(obj)} at {path or '/'}: {err.message}")
            except kubernetes_validate.SchemaNotFoundError:
                problems.append(f"{file} {_name(obj)}: no schema in Kubernetes 1.30")
    return problems


def kustomization_problems(kustomization: dict[str, Any], manifests: Manifests) -> list[str]:
    listed = set(kustomization.get("resources", []))
    problems = [f"{f} is not in kustomization.yaml" for f in sorted(set(manifests) - listed)]
    problems += [f"kustomization.yaml lists missing {f}" for f in sorted(listed - set(manifests))]
    namespaces = {obj["metadata"].get("namespace") for obj in _objects(manifests)} - {None}
    if namespaces != {kustomization.get("namespace")}:
        problems.append(f"namespaces {sorted(namespaces)} != {kustomization.get('namespace')}")
    return problems


def env_name_problems(manifests: Manifests) -> list[str]:
    """pydantic-settings ignores a SWERL_* name its class has no field for: a typo is silent."""
    problems = []
    for workload, _pod, container in _containers(manifests):
        service = _service_of(container)
        if service not in SETTINGS:
            problems.append(f"{_name(workload)}: runs {service!r}, not a swerl service")
            continue
        settings_cls = SETTINGS[service]
        prefix = settings_cls.model_config["env_prefix"]
        for var in container.get("env", []):
            name = var["name"]
            if not name.startswith("SWERL_"):
                continue
            if not name.startswith(prefix):
                problems.append(f"{_name(workload)}: {name} is not a {prefix}* setting")
            elif name[len(prefix) :].lower() not in settings_cls.model_fields:
                problems.append(f"{_name(workload)}: {name} is no field of {settings_cls.__name__}")
    return problems


def settings_value_problems(manifests: Manifests) -> list[str]:
    problems = []
    for workload, _pod, container in _containers(manifests):
        if _service_of(container) not in SETTINGS:
            continue
        try:
            settings_of(container, manifests)
        except ValidationError as err:
            problems.append(f"{_name(workload)}: {err}")
    return problems


def _named_ports(container: dict) -> dict[str, int]:
    return {port["name"]: port["containerPort"] for port in container.get("ports", [])}


def _probe_port(probe: dict, ports: dict[str, int]) -> int | str | None:
    for kind in ("grpc", "tcpSocket", "httpGet"):
        if kind in probe:
            port = probe[kind]["port"]
            return ports.get(port, port) if isinstance(port, str) else port
    return None


def port_problems(manifests: Manifests) -> list[str]:
    """The container's ports are the ones its settings bind; its probes ask the gRPC port; each
    Service port reaches a named port of its pods, under the same number."""
    problems = []
    pods_by_labels = []
    for workload, _pod, container in _containers(manifests):
        if _service_of(container) not in SETTINGS:
            continue
        settings = settings_of(container, manifests)
        ports = _named_ports(container)
        want = {"grpc": settings.port, "metrics": settings.metrics_port}
        for name, number in want.items():
            if ports.get(name) != number:
                problems.append(
                    f"{_name(workload)}: port {name} is {ports.get(name)}, the settings bind"
                    f" {number}"
                )
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            if kind in container and _probe_port(container[kind], ports) != settings.port:
                problems.append(f"{_name(workload)}: {kind} does not ask port {settings.port}")
        labels = workload["spec"]["template"]["metadata"].get("labels", {})
        pods_by_labels.append((labels, ports))
    for obj in _objects(manifests):
        if obj.get("kind") != "Service":
            continue
        selector = obj["spec"].get("selector", {})
        matched = [
            ports
            for labels, ports in pods_by_labels
            if selector.items() <= labels.items() and selector
        ]
        if not matched:
            problems.append(f"{_name(obj)}: its selector matches no pod")
            continue
        for port in obj["spec"].get("ports", []):
            target = port.get("targetPort", port["port"])
            number = matched[0].get(target) if isinstance(target, str) else target
            if number != port["port"]:
                problems.append(
                    f"{_name(obj)}: port {port['port']} goes to {target!r} ({number}) of its pods"
                )
    return problems


def secret_problems(manifests: Manifests) -> list[str]:
    secrets = _secrets(manifests)
    problems = []
    for workload, _pod, container in _containers(manifests):
        for var in container.get("env", []):
            ref = var.get("valueFrom", {}).get("secretKeyRef")
            if ref is None:
                continue
            if ref["name"] not in secrets:
                problems.append(f"{_name(workload)}: {var['name']} names no Secret {ref['name']}")
            elif ref["key"] not in secrets[ref["name"]]:
                problems.append(
                    f"{_name(workload)}: {var['name']} names key {ref['key']!r}, which Secret"
                    f" {ref['name']} does not have"
                )
    return problems


def _service_targets(manifests: Manifests) -> dict[str, tuple[str, set[int]]]:
    """Each name a pod in the namespace may dial a Service by -> the swerl service its selector
    picks and the Service's ports."""
    pods = [
        (w["spec"]["template"]["metadata"].get("labels", {}), _service_of(c))
        for w, _p, c in _containers(manifests)
    ]
    found: dict[str, tuple[str, set[int]]] = {}
    for obj in _objects(manifests):
        if obj.get("kind") != "Service":
            continue
        selector = obj["spec"].get("selector", {})
        picked = [svc for labels, svc in pods if selector and selector.items() <= labels.items()]
        ports = {port["port"] for port in obj["spec"].get("ports", [])}
        name, namespace = obj["metadata"]["name"], obj["metadata"]["namespace"]
        for alias in (name, f"{name}.{namespace}", f"{name}.{namespace}.svc"):
            found[alias] = (picked[0] if picked else "", ports)
    return found


# The settings that name another swerl service's gRPC address, and that service.
ADDRESS_SETTINGS = {
    ("exec", "pool_address"): "pool",
    ("agent", "pool_address"): "pool",
    ("agent", "prm_endpoint"): "prm",
}


def address_problems(manifests: Manifests) -> list[str]:
    """Addresses of other services name the Service in front of that service, on its gRPC port;
    the exec node advertises its own gRPC port."""
    services = _service_targets(manifests)
    grpc_ports = {
        _service_of(c): settings_of(c, manifests).port
        for _w, _p, c in _containers(manifests)
        if _service_of(c) in SETTINGS
    }
    problems = []
    for workload, _pod, container in _containers(manifests):
        service = _service_of(container)
        if service not in SETTINGS:
            continue
        settings = settings_of(container, manifests)
        for (owner, field), target in ADDRESS_SETTINGS.items():
            address = getattr(settings, field, None) if owner == service else None
            if not address:
                continue
            host, _, port = address.rpartition(":")
            picked, ports = services.get(host, ("", set()))
            if picked != target:
                problems.append(f"{_name(workload)}: {field} {address}: no Service of the {target}")
            elif int(port) != grpc_ports.get(target) or int(port) not in ports:
                problems.append(
                    f"{_name(workload)}: {field} {address} is not the {target}'s gRPC port"
                    f" ({grpc_ports.get(target)})"
                )
        advertised = getattr(settings, "advertise_address", None)
        if advertised and int(advertised.rpartition(":")[2]) != settings.port:
            problems.append(f"{_name(workload)}: advertise_address {advertised} is not its port")
    return problems


def _same_path_mount(pod: dict, container: dict, path: Path) -> str | None:
    """None when `path` lies in a hostPath volume mounted at its own host path (no subPath),
    else why not."""
    mounts = [
        mount
        for mount in container.get("volumeMounts", [])
        if path == Path(mount["mountPath"]) or Path(mount["mountPath"]) in path.parents
    ]
    if not mounts:
        return f"{path} is not mounted"
    mount = max(mounts, key=lambda m: len(Path(m["mountPath"]).parts))
    volume = next((v for v in pod.get("volumes", []) if v["name"] == mount["name"]), {})
    host_path = (volume.get("hostPath") or {}).get("path")
    if host_path is None:
        return f"{path} is on volume {mount['name']!r}, not a hostPath"
    if Path(host_path) != Path(mount["mountPath"]) or mount.get("subPath"):
        return f"{path} is mounted from host path {host_path} at {mount['mountPath']}"
    if mount.get("readOnly"):
        return f"{path} is mounted read-only"
    return None


def exec_mount_problems(manifests: Manifests) -> list[str]:
    """The node's state dir (the sandboxes' I/O FIFOs and harness bundles, bind-mounted into
    sandboxes by host path) and its runtime's API socket, each at the host's own path."""
    problems = []
    for workload, pod, container in _containers(manifests):
        if _service_of(container) != "exec":
            continue
        settings = settings_of(container, manifests)
        assert isinstance(settings, ExecSettings)
        socket = settings.docker_host or DEFAULT_SOCKETS[settings.runtime]
        if socket is None:
            problems.append(
                f"{_name(workload)}: name the runtime's socket in SWERL_EXEC_DOCKER_HOST"
            )
            needed = [settings.state_dir, settings.bundle_dir]
        elif not socket.startswith("unix://"):
            problems.append(f"{_name(workload)}: {socket} is not a local socket")
            needed = [settings.state_dir, settings.bundle_dir]
        else:
            needed = [settings.state_dir, settings.bundle_dir, Path(urlparse(socket).path)]
        for path in needed:
            why = _same_path_mount(pod, container, path)
            if why is not None:
                problems.append(f"{_name(workload)}: {why}")
    return problems


# -- the manifests as they are -------------------------------------------------------------


@pytest.fixture
def manifests() -> Manifests:
    return load_manifests()


def test_the_manifests_hold_every_service_and_the_exec_node_is_a_daemonset(manifests):
    kinds = {_service_of(c): w["kind"] for w, _p, c in _containers(manifests)}
    assert kinds == {
        "exec": "DaemonSet",
        "pool": "Deployment",
        "agent": "Deployment",
        "prm": "Deployment",
    }
    (pool,) = [w for w, _p, c in _containers(manifests) if _service_of(c) == "pool"]
    assert pool["spec"]["replicas"] == 1 and pool["spec"]["strategy"]["type"] == "Recreate"


def test_every_manifest_validates_against_the_kubernetes_schemas_strictly(manifests):
    assert schema_problems(manifests) == []


def test_the_kustomization_lists_every_manifest_and_one_namespace(manifests):
    assert kustomization_problems(load_kustomization(), manifests) == []


def test_every_swerl_env_var_is_a_setting_of_its_service(manifests):
    assert env_name_problems(manifests) == []


def test_the_env_values_make_valid_settings(manifests):
    assert settings_value_problems(manifests) == []


def test_ports_and_probes_are_the_services_own(manifests):
    assert port_problems(manifests) == []


def test_every_secret_key_referenced_exists(manifests):
    assert secret_problems(manifests) == []


def test_addresses_name_the_services_and_their_grpc_ports(manifests):
    assert address_problems(manifests) == []


def test_the_exec_node_mounts_its_state_dir_and_runtime_socket_at_their_host_paths(manifests):
    assert exec_mount_problems(manifests) == []


# -- each check fails on a broken copy -----------------------------------------------------


def _container(manifests: Manifests, service: str) -> dict:
    return next(c for _w, _p, c in _containers(manifests) if _service_of(c) == service)


def _pod(manifests: Manifests, service: str) -> dict:
    return next(p for _w, p, c in _containers(manifests) if _service_of(c) == service)


def _set_env(manifests: Manifests, service: str, name: str, value: str) -> None:
    for var in _container(manifests, service)["env"]:
        if var["name"] == name:
            var.clear()
            var.update(name=name, value=value)
            return
    _container(manifests, service)["env"].append({"name": name, "value": value})


def _rename_env(manifests: Manifests, service: str, old: str, new: str) -> None:
    (var,) = [v for v in _container(manifests, service)["env"] if v["name"] == old]
    var["name"] = new


def _volume(manifests: Manifests, service: str, name: str) -> dict:
    return next(v for v in _pod(manifests, service)["volumes"] if v["name"] == name)


def _replace_volume(manifests: Manifests, service: str, volume: dict) -> None:
    old = _volume(manifests, service, volume["name"])
    old.clear()
    old.update(volume)


def _service(manifests: Manifests, name: str) -> dict:
    return next(
        o for o in _objects(manifests) if o["kind"] == "Service" and o["metadata"]["name"] == name
    )


Breakage = Callable[[Manifests], None]
Check = Callable[[Manifests], list[str]]

BREAKAGES: dict[str, tuple[Breakage, Check, str]] = {
    "an unknown field": (
        lambda m: _container(m, "exec").update(envFrom2=[]),
        schema_problems,
        "envFrom2",
    ),
    "a field of the wrong type": (
        lambda m: _container(m, "pool")["ports"][0].update(containerPort="18090"),
        schema_problems,
        "containerPort",
    ),
    "a misspelt setting": (
        lambda m: _rename_env(m, "exec", "SWERL_EXEC_MAX_SANDBOXES", "SWERL_EXEC_MAX_SANDBOX"),
        env_name_problems,
        "SWERL_EXEC_MAX_SANDBOX is no field of ExecSettings",
    ),
    "another service's setting": (
        lambda m: _set_env(m, "agent", "SWERL_POOL_MAX_LEASES", "10"),
        env_name_problems,
        "SWERL_POOL_MAX_LEASES is not a SWERL_AGENT_* setting",
    ),
    "a value the setting refuses": (
        lambda m: _set_env(m, "exec", "SWERL_EXEC_RUNTIME", "dockr"),
        settings_value_problems,
        "runtime",
    ),
    "a container port that is not the setting's": (
        lambda m: _container(m, "pool")["ports"][0].update(containerPort=18099),
        port_problems,
        "port grpc is 18099",
    ),
    "a metrics port setting that is not the container's": (
        lambda m: _set_env(m, "agent", "SWERL_AGENT_METRICS_PORT", "9599"),
        port_problems,
        "port metrics is 9591, the settings bind 9599",
    ),
    "a probe on another port": (
        lambda m: _container(m, "prm")["readinessProbe"]["grpc"].update(port=9592),
        port_problems,
        "readinessProbe does not ask port 18092",
    ),
    "a Service aimed at a port the pods lack": (
        lambda m: _service(m, "swerl-pool")["spec"]["ports"][0].update(targetPort="rpc"),
        port_problems,
        "port 18090 goes to 'rpc'",
    ),
    "a Secret key that does not exist": (
        lambda m: _container(m, "pool")["env"][1]["valueFrom"]["secretKeyRef"].update(
            key="capability_secret"
        ),
        secret_problems,
        "names key 'capability_secret'",
    ),
    "a Secret that does not exist": (
        lambda m: _container(m, "agent")["env"][0]["valueFrom"]["secretKeyRef"].update(
            name="swerl-token"
        ),
        secret_problems,
        "names no Secret swerl-token",
    ),
    "the pool's address on the agent's port": (
        lambda m: _set_env(m, "agent", "SWERL_AGENT_POOL_ADDRESS", "swerl-pool:18091"),
        address_problems,
        "pool_address swerl-pool:18091 is not the pool's gRPC port",
    ),
    "the PRM endpoint at the pool's Service": (
        lambda m: _set_env(m, "agent", "SWERL_AGENT_PRM_ENDPOINT", "swerl-pool:18092"),
        address_problems,
        "prm_endpoint swerl-pool:18092: no Service of the prm",
    ),
    "the pool's address naming no Service": (
        lambda m: _set_env(m, "exec", "SWERL_EXEC_POOL_ADDRESS", "pool.swerl.svc:18090"),
        address_problems,
        "pool_address pool.swerl.svc:18090: no Service of the pool",
    ),
    "the state dir from another host path": (
        lambda m: _volume(m, "exec", "state")["hostPath"].update(path="/srv/swerl/exec"),
        exec_mount_problems,
        "mounted from host path /srv/swerl/exec at /var/lib/swerl/exec",
    ),
    "a state dir setting outside the mount": (
        lambda m: _set_env(m, "exec", "SWERL_EXEC_STATE_DIR", "/var/lib/swerl-exec"),
        exec_mount_problems,
        "/var/lib/swerl-exec is not mounted",
    ),
    "the state dir on a pod-local volume": (
        lambda m: _replace_volume(m, "exec", {"name": "state", "emptyDir": {}}),
        exec_mount_problems,
        "on volume 'state', not a hostPath",
    ),
    "a runtime socket that is not mounted": (
        lambda m: _set_env(m, "exec", "SWERL_EXEC_DOCKER_HOST", "unix:///var/run/docker.sock"),
        exec_mount_problems,
        "/var/run/docker.sock is not mounted",
    ),
    "a manifest the kustomization leaves out": (
        lambda m: m.update({"extra.yaml": copy.deepcopy(m["prm.yaml"])}),
        lambda m: kustomization_problems(load_kustomization(), m),
        "extra.yaml is not in kustomization.yaml",
    ),
}


@pytest.mark.parametrize("breakage", list(BREAKAGES))
def test_each_check_reports_a_broken_copy(breakage, manifests):
    mutate, check, expected = BREAKAGES[breakage]
    broken = copy.deepcopy(manifests)
    mutate(broken)
    problems = check(broken)
    assert any(expected in problem for problem in problems), problems
    # The breakage is the copy's alone: the files as loaded still pass the same check.
    assert check(manifests) == []
