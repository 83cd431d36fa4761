"""deploy/slime/head_services.py: head-node services that live and die with their owner.

A real swerl server (the exec node, on the local dockerd) stands in for pool/agent/prm: the
owner logic only needs a process that serves grpc.health.v1 and drains on SIGTERM.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

# The head services know no framework: scripts/test's miles pass leaves this file out.
pytestmark = pytest.mark.framework_neutral

ROOT = Path(__file__).resolve().parents[2]
SPEC = importlib.util.spec_from_file_location(
    "head_services", ROOT / "deploy/slime/head_services.py"
)
head_services = importlib.util.module_from_spec(SPEC)
sys.modules["head_services"] = head_services
SPEC.loader.exec_module(head_services)

# An owner process: starts the service, prints its pid, then idles until killed.
OWNER = """
import importlib.util, json, sys, time
path, argv, port, logs = json.loads(sys.argv[1])
spec = importlib.util.spec_from_file_location("head_services", path)
hs = importlib.util.module_from_spec(spec)
sys.modules["head_services"] = hs
spec.loader.exec_module(hs)
services = hs.HeadServices([hs.ServiceSpec(name="exec", argv=argv, port=port)], log_dir=logs)
services.start(ready_timeout_s=60)
print(services.pids()["exec"], flush=True)
time.sleep(600)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def exec_node_spec(tmp_path: Path) -> head_services.ServiceSpec:
    port = _free_port()
    argv = [
        sys.executable,
        "-m",
        "swerl.cli",
        "exec",
        "serve",
        "--insecure",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--node-id",
        "plugin-test-" + uuid.uuid4().hex[:8],
        "--state-dir",
        str(tmp_path / "state"),
    ]
    return head_services.ServiceSpec(name="exec", argv=argv, port=port)


def _gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        # A zombie child of this test process counts as gone once reaped by nobody: check state.
        try:
            state = Path(f"/proc/{pid}/stat").read_text().split()[2]
        except FileNotFoundError:
            return True
        if state == "Z":
            return True
        time.sleep(0.1)
    return False


@pytest.mark.docker
def test_services_start_serving_and_stop_cleanly(base_image, tmp_path):
    services = head_services.HeadServices([exec_node_spec(tmp_path)], log_dir=tmp_path / "logs")
    addresses = services.start(ready_timeout_s=60)
    try:
        assert list(addresses) == ["exec"]
        assert services.alive() == {"exec": True}
        assert head_services.wait_serving(addresses["exec"], 5.0)
    finally:
        codes = services.stop(grace_s=20)
    assert codes == {"exec": 0}, "SIGTERM drains and exits 0"


@pytest.mark.docker
def test_services_die_with_their_owner_even_when_it_is_killed(base_image, tmp_path):
    spec = exec_node_spec(tmp_path)
    config = [str(ROOT / "deploy/slime/head_services.py"), spec.argv, spec.port, str(tmp_path)]
    proc = subprocess.Popen(
        [sys.executable, "-c", OWNER, json.dumps(config)], stdout=subprocess.PIPE, text=True
    )
    try:
        service_pid = int(proc.stdout.readline())
        assert not _gone(service_pid, 0.5)
        proc.send_signal(signal.SIGKILL)  # what Ray does to an actor whose owner died
        proc.wait()
        assert _gone(service_pid, 20.0), "the service outlived its owner"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_service_that_exits_at_once_is_reported_with_its_log(tmp_path):
    spec = head_services.ServiceSpec(
        name="broken", argv=[sys.executable, "-c", "raise SystemExit(3)"], port=_free_port()
    )
    services = head_services.HeadServices([spec], log_dir=tmp_path)
    with pytest.raises(RuntimeError, match="broken exited with 3"):
        services.start(ready_timeout_s=10)


def test_default_specs_start_pool_and_prm_before_the_agent_and_wire_them():
    specs = head_services.default_specs(
        ["agent", "prm", "pool"], host="127.0.0.1", exec_nodes=["n1=10.0.0.2:5000"], state_dir="/s"
    )
    assert [s.name for s in specs] == ["pool", "prm", "agent"]
    assert specs[0].argv[:3] == ["swerl", "pool", "serve"] and "n1=10.0.0.2:5000" in specs[0].argv
    assert [s.port for s in specs] == [18090, 18092, 18091]


def test_default_specs_bring_up_a_real_pool_and_agent_wired_together(tmp_path, monkeypatch):
    monkeypatch.setenv("SWERL_POOL_AUTH_TOKEN", "tok")
    monkeypatch.setenv("SWERL_POOL_CAPABILITY_SECRET", "sec")
    monkeypatch.setenv("SWERL_AGENT_AUTH_TOKEN", "tok")
    monkeypatch.setenv("SWERL_POOL_DRAIN_GRACE_S", "1")
    monkeypatch.setenv("SWERL_AGENT_DRAIN_GRACE_S", "1")
    ports = {"pool": _free_port(), "agent": _free_port()}
    specs = head_services.default_specs(
        ["pool", "agent"], host="127.0.0.1", exec_nodes=[], state_dir=str(tmp_path), ports=ports
    )
    assert specs[1].env["SWERL_AGENT_POOL_ADDRESS"] == f"127.0.0.1:{ports['pool']}"
    services = head_services.HeadServices(specs, log_dir=tmp_path / "logs")
    try:
        addresses = services.start(ready_timeout_s=60)
        assert addresses == {name: f"127.0.0.1:{port}" for name, port in ports.items()}
    finally:
        codes = services.stop(grace_s=20)
    assert codes == {"agent": 0, "pool": 0}


# The Ray-actor way under real Ray. Ray is not a swerl dependency (slime's image brings it), so
# this runs where `ray` imports, optionally from SWERL_RAY_SITE (a `pip install --target` dir).
# The driver imports head_services by name (deploy/slime on its PYTHONPATH), as Ray's workers must.
RAY_DRIVER = """
import json, sys
import head_services as hs
import ray
argv, port, logs, tmp = json.loads(sys.argv[1])
ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, _temp_dir=tmp)
actor, addresses = hs.start_actor([hs.ServiceSpec(name="exec", argv=argv, port=port)], logs, 60)
print(json.dumps(ray.get(actor.pids.remote())), flush=True)
if sys.argv[2] == "stop":
    sys.stdin.readline()  # the test says when, after it has seen the service alive
    print(json.dumps(ray.get(actor.stop.remote(20))), flush=True)
    ray.shutdown()
else:
    import time
    time.sleep(600)
"""


def _json_line(proc: subprocess.Popen[str]) -> dict:
    for line in proc.stdout:
        if line.startswith("{"):
            return json.loads(line)
    raise AssertionError(f"the driver ended ({proc.wait()}) without reporting")


def _ray_env() -> dict[str, str] | None:
    env = dict(os.environ)
    site = os.environ.get("SWERL_RAY_SITE", "")
    if site:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (site, env.get("PYTHONPATH", "")) if p)
    probe = subprocess.run([sys.executable, "-c", "import ray"], env=env, capture_output=True)
    return env if probe.returncode == 0 else None


@pytest.mark.docker
@pytest.mark.parametrize("ending", ["stop", "driver-killed"])
def test_ray_actor_owned_by_the_job_driver_takes_the_services_along(base_image, tmp_path, ending):
    env = _ray_env()
    if env is None:
        # scripts/test (and so CI) always sets SWERL_RAY_SITE: there, a missing Ray is a failure.
        assert not os.environ.get("SWERL_RAY_SITE"), "SWERL_RAY_SITE is set but ray does not import"
        pytest.skip("ray is not importable (set SWERL_RAY_SITE to a dir holding it)")
    spec = exec_node_spec(tmp_path)
    # Ray's socket paths must stay short (AF_UNIX), so not under pytest's long tmp_path.
    ray_tmp = tempfile.mkdtemp(prefix="swerl-ray-", dir="/tmp")
    config = [spec.argv, spec.port, str(tmp_path / "logs"), ray_tmp]
    slime_dir = str(ROOT / "deploy/slime")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (slime_dir, env.get("PYTHONPATH", "")) if p)
    driver = subprocess.Popen(
        [sys.executable, "-c", RAY_DRIVER, json.dumps(config), ending],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        service_pid = _json_line(driver)["exec"]
        assert not _gone(service_pid, 0.5)
        if ending == "stop":
            driver.stdin.write("stop\n")
            driver.stdin.flush()
            assert _json_line(driver) == {"exec": 0}
            driver.wait(60)
        else:
            driver.kill()  # the job's driver dies: Ray kills the actor it owns
            driver.wait()
        assert _gone(service_pid, 30.0), "the service outlived the job"
    finally:
        # Ray's own helper processes of this local cluster share the driver's session.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(driver.pid, signal.SIGKILL)
        shutil.rmtree(ray_tmp, ignore_errors=True)
