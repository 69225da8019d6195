"""The Terraform modules in infra/terraform, checked offline with Terraform 1.0.3 (tools.py):
formatting, init + validate where the providers are available locally (none, or null), a render
of twinkle-manifests whose documents are asserted (the server config through our strict loader),
checkov on those documents, and python-hcl2 checks of twinkle-kuberay, whose helm and kubernetes
providers cannot be installed here (its validate is reported as skipped)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from engine.config import TINY_MODEL_NAME
from gateway.config import ServerConfig
from tests.infra import tools

IMAGE = "registry.example.com/twinkle@sha256:" + "ab" * 32


def test_fmt() -> None:
    out = tools.terraform("fmt", "-check", "-recursive", "-diff", "-no-color", cwd=tools.TF_ROOT)
    assert out.stdout == ""


@pytest.mark.parametrize(
    "module", ["modules/twinkle-manifests", "modules/twinkle-host", "examples/single-host"]
)
def test_validate(module: str, tmp_path: Path) -> None:
    where = tools.copy_tree(tmp_path) / module
    tools.init(where)
    out = tools.terraform("validate", "-json", "-no-color", cwd=where)
    result = json.loads(out.stdout)
    assert result["valid"], result["diagnostics"]
    assert result["error_count"] == 0 and result["warning_count"] == 0, result


@pytest.mark.parametrize("module", ["modules/twinkle-kuberay", "examples/kubernetes"])
def test_validate_kuberay(module: str) -> None:
    pytest.skip(
        f"{module}: terraform validate needs the hashicorp/kubernetes and hashicorp/helm "
        "providers from the provider registry, which is not reachable here (checked instead: "
        "test_kuberay_module_pins_and_documents_everything)"
    )


# ----------------------------------------------------------------------------- render

SERVER_CONFIG = {
    "models": [
        {
            "name": TINY_MODEL_NAME,
            "trainer": {"num_replicas": 2, "num_gpus": 1},
            "sampler": {"num_replicas": 1, "num_gpus": 1},
        }
    ],
    "gateway": {"num_replicas": 2, "jwt_enabled": True},
    "engine_metrics": {"host": "0.0.0.0"},
}


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """twinkle-manifests applied (no providers: only outputs) with non-default inputs; the
    documents by name, parsed."""
    root = tools.copy_tree(tmp_path_factory.mktemp("render"))
    work = root / "render"
    work.mkdir()
    (work / "main.tf").write_text(
        f"""
module "twinkle" {{
  source                  = "../modules/twinkle-manifests"
  name                    = "tw"
  namespace               = "ml"
  image                   = "{IMAGE}"
  gpu_worker_replicas     = 3
  gpu_worker_max_replicas = 5
  gpus_per_worker         = 2
  worker_memory           = "96Gi"
  data_volume_claim       = "twinkle-data"
  redis_url_key           = ""
  extra_env               = {{ HF_HUB_OFFLINE = "1" }}
  service_monitor         = true
  service_monitor_labels  = {{ release = "prom" }}
  server_config           = jsondecode({json.dumps(json.dumps(SERVER_CONFIG))})
}}
output "manifests" {{ value = module.twinkle.manifests }}
output "stream" {{ value = module.twinkle.manifests_yaml }}
output "gateway" {{ value = module.twinkle.gateway_service }}
"""
    )
    tools.init(work)
    tools.terraform("apply", "-auto-approve", "-no-color", cwd=work)
    out = tools.outputs(work)
    docs = {name: yaml.safe_load(text) for name, text in out["manifests"].items()}
    docs["_stream"] = list(yaml.safe_load_all(out["stream"]))  # type: ignore[assignment]
    docs["_gateway"] = out["gateway"]
    return docs


def _containers(doc: dict) -> dict[str, dict]:
    pods = [doc["spec"]["headGroupSpec"]["template"]]
    pods += [g["template"] for g in doc["spec"]["workerGroupSpecs"]]
    return {c["name"]: c for pod in pods for c in pod["spec"]["containers"]}


def test_render_documents(rendered: dict[str, dict]) -> None:
    assert set(rendered) - {"_stream", "_gateway"} == {
        "configmap",
        "networkpolicy",
        "raycluster",
        "service",
        "servicemonitor",
    }
    kinds = [d["kind"] for d in rendered["_stream"]]  # type: ignore[index]
    # apply order: the ConfigMap and Service before the RayCluster that uses them
    assert kinds == ["NetworkPolicy", "ConfigMap", "Service", "RayCluster", "ServiceMonitor"]
    for doc in rendered["_stream"]:  # type: ignore[union-attr]
        assert doc["metadata"]["namespace"] == "ml"
        assert doc["metadata"]["labels"]["app.kubernetes.io/instance"] == "tw"


def test_render_raycluster(rendered: dict[str, dict]) -> None:
    rc = rendered["raycluster"]
    assert rc["apiVersion"] == "ray.io/v1" and rc["metadata"]["name"] == "tw"
    constraints = (tools.REPO / "constraints.txt").read_text()
    assert f"ray=={rc['spec']['rayVersion']}\n" in constraints
    (group,) = rc["spec"]["workerGroupSpecs"]
    assert (group["replicas"], group["minReplicas"], group["maxReplicas"]) == (3, 3, 5)
    assert group["rayStartParams"]["num-gpus"] == "2"
    assert rc["spec"]["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"
    containers = _containers(rc)
    assert list(containers) == ["ray-head", "twinkle", "ray-worker"]
    worker = containers["ray-worker"]["resources"]
    assert worker["limits"]["nvidia.com/gpu"] == 2 and worker["requests"]["nvidia.com/gpu"] == 2
    assert worker["limits"]["memory"] == "96Gi"
    assert "nvidia.com/gpu" not in containers["ray-head"]["resources"]["limits"]
    tolerations = group["template"]["spec"]["tolerations"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "value": "", "effect": "NoSchedule"} in (
        tolerations
    )
    for c in containers.values():
        assert c["image"] == IMAGE
        env = {e["name"]: e for e in c["env"]}
        assert env["TWINKLE_DATA_DIR"]["value"] == "/data"
        assert env["HF_HUB_OFFLINE"]["value"] == "1"
        # secrets by reference only; redis_url_key "" leaves TWINKLE_REDIS_URL out
        ref = env["TWINKLE_DATABASE_URL"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "twinkle-secrets", "key": "database-url", "optional": False}
        assert env["TWINKLE_JWT_SECRET"]["valueFrom"]["secretKeyRef"]["optional"] is True
        assert "TWINKLE_REDIS_URL" not in env
        assert not any("value" in e and "postgres" in str(e["value"]) for e in c["env"])
        assert c["securityContext"]["runAsNonRoot"] is True
        assert {"name": "data", "mountPath": "/data"} in c["volumeMounts"]
    volumes = {v["name"]: v for v in group["template"]["spec"]["volumes"]}
    assert volumes["data"] == {
        "name": "data",
        "persistentVolumeClaim": {"claimName": "twinkle-data"},
    }


def test_render_driver_and_service(rendered: dict[str, dict]) -> None:
    from gateway.tinker_api.sessions import router

    driver = _containers(rendered["raycluster"])["twinkle"]
    assert driver["command"] == [
        "twinkle", "serve", "--config", "/etc/twinkle/server.yaml",
        "--host", "0.0.0.0", "--port", "8000",
    ]  # fmt: skip
    assert {"name": "RAY_ADDRESS", "value": "127.0.0.1:6379"} in driver["env"]
    # the probes use the real health route
    health = driver["readinessProbe"]["httpGet"]["path"]
    assert health in {getattr(r, "path", None) for r in router.routes}
    assert driver["startupProbe"]["httpGet"]["path"] == health
    head_ports = {p["name"]: p["containerPort"] for p in _containers(rendered["raycluster"])[
        "ray-head"]["ports"]}  # fmt: skip
    assert head_ports["http"] == 8000
    svc = rendered["service"]
    assert svc["spec"]["selector"] == {"ray.io/cluster": "tw", "ray.io/node-type": "head"}
    (port,) = svc["spec"]["ports"]
    assert (port["port"], port["targetPort"], port["name"]) == (80, 8000, "http")
    assert rendered["_gateway"]["url"] == "http://tw-gateway.ml.svc:80"
    sm = rendered["servicemonitor"]
    assert sm["metadata"]["labels"]["release"] == "prom"
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["spec"]["endpoints"] == [{"port": "http", "path": "/metrics", "interval": "15s"}]


def test_render_config_map_parses_with_the_strict_loader(rendered: dict[str, dict]) -> None:
    cm = rendered["configmap"]
    volumes = rendered["raycluster"]["spec"]["headGroupSpec"]["template"]["spec"]["volumes"]
    assert {"name": "config", "configMap": {"name": cm["metadata"]["name"]}} in volumes
    raw = yaml.safe_load(cm["data"]["server.yaml"])
    config = ServerConfig.from_dict(raw, source="rendered ConfigMap")
    assert [m.name for m in config.models] == [TINY_MODEL_NAME]
    assert config.models[0].trainer.num_replicas == 2 and config.models[0].trainer.num_gpus == 1
    assert config.gateway.num_replicas == 2 and config.gateway.jwt_enabled
    assert config.engine_metrics.host == "0.0.0.0"
    assert raw == SERVER_CONFIG  # numbers and booleans survive Terraform's yamlencode


# ----------------------------------------------------------------------------- checkov


def _checkov_inputs(rendered: dict[str, dict], folder: Path) -> None:
    """The plain documents as they are, and each RayCluster pod template as a Pod: checkov has no
    policies for the RayCluster CRD and does not look inside its templates."""
    for name, doc in rendered.items():
        if name.startswith("_") or name == "raycluster":
            continue
        (folder / f"{name}.yaml").write_text(yaml.safe_dump(doc))
    rc = rendered["raycluster"]
    templates = {"head": rc["spec"]["headGroupSpec"]["template"]}
    templates |= {f"worker-{g['groupName']}": g["template"] for g in rc["spec"]["workerGroupSpecs"]}
    for name, tpl in templates.items():
        meta = {"name": name, "namespace": rc["metadata"]["namespace"], **tpl["metadata"]}
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": tpl["spec"]}
        (folder / f"pod-{name}.yaml").write_text(yaml.safe_dump(pod))


def test_checkov_finds_nothing_unjustified(rendered: dict[str, dict], tmp_path: Path) -> None:
    checkov = tools.require(tools.CHECKOV)
    _checkov_inputs(rendered, tmp_path)
    out = subprocess.run(
        [str(checkov), "-d", str(tmp_path), "--framework", "kubernetes", "--skip-download",
         "--quiet", "--compact", "-o", "json"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    report = json.loads(out.stdout)
    failed = [(c["check_id"], c["resource"]) for c in report["results"]["failed_checks"]]
    assert failed == [], f"checkov findings (fix, or skip with a reason in main.tf): {failed}"
    assert out.returncode == 0
    summary = report["summary"]
    assert summary["resource_count"] == 6 and summary["passed"] >= 150, summary
    # every skip is an annotation with a reason (twinkle-manifests' local.checkov_skips)
    for check in report["results"].get("skipped_checks", []):
        assert len(check["check_result"].get("suppress_comment", "")) > 20, check


# ----------------------------------------------------------------------------- python-hcl2

EXACT = re.compile(r"^\d+\.\d+\.\d+$")


def _variables(parsed: dict[str, dict]) -> dict[str, dict]:
    return {
        name: body
        for f in parsed.values()
        for block in f.get("variable", [])
        for name, body in block.items()
    }


def test_kuberay_module_pins_and_documents_everything() -> None:
    parsed = tools.hcl(tools.MODULES / "twinkle-kuberay")
    (tf,) = parsed["versions.tf"]["terraform"]
    assert tf["required_version"] == ">= 1.0"
    (providers,) = tf["required_providers"]
    assert set(providers) == {"kubernetes", "helm"}
    for name, spec in providers.items():
        assert spec["source"] == f"hashicorp/{name}"
        assert EXACT.match(spec["version"]), f"provider {name} not pinned: {spec['version']}"
    releases = [
        body
        for block in parsed["main.tf"]["resource"]
        for kind, named in block.items()
        if kind == "helm_release"
        for body in named.values()
    ]
    (operator,) = releases
    assert operator["chart"] == "kuberay-operator"
    assert operator["version"] == "${var.kuberay_chart_version}"
    variables = _variables(parsed)
    assert EXACT.match(variables["kuberay_chart_version"]["default"])
    # the module configures no provider (its caller does) and runs only pinned images
    assert not any("provider" in f for f in parsed.values())
    for image in ("postgres_image", "redis_image"):
        # an exact release (postgres versions are major.minor), never latest or a major alone
        assert re.search(r":\d+\.\d+(\.\d+)?-\w+$", variables[image]["default"]), image
    for secret in (
        "database_url",
        "redis_url",
        "jwt_secret",
        "url_signing_key",
        "postgres_password",
    ):
        assert variables[secret]["sensitive"] is True, secret


@pytest.mark.parametrize("module", ["twinkle-manifests", "twinkle-kuberay", "twinkle-host"])
def test_every_variable_typed_and_described(module: str) -> None:
    variables = _variables(tools.hcl(tools.MODULES / module))
    assert len(variables) >= 10
    for name, body in variables.items():
        assert body.get("type"), f"{module}: variable {name} has no type"
        assert len(body.get("description", "")) >= 15, f"{module}: variable {name} undescribed"


def test_kuberay_passes_known_inputs_to_manifests() -> None:
    """twinkle-kuberay's module call names only variables twinkle-manifests declares (validate
    cannot check this here: the module's providers are missing)."""
    kuberay = tools.hcl(tools.MODULES / "twinkle-kuberay")
    (call,) = [m["manifests"] for m in kuberay["main.tf"]["module"]]
    declared = set(_variables(tools.hcl(tools.MODULES / "twinkle-manifests")))
    passed = set(call) - {"source"}
    assert passed <= declared, passed - declared
    assert "image" in passed and "server_config" in passed


@pytest.mark.parametrize("module", ["twinkle-manifests", "twinkle-kuberay", "twinkle-host"])
def test_readme_lists_every_input_and_output(module: str) -> None:
    """infra/terraform/README.md's tables name every variable and output, and nothing else."""
    parsed = tools.hcl(tools.MODULES / module)
    readme = (tools.TF_ROOT / "README.md").read_text()
    section = readme.split(f"### `{module}`", 1)[1].split("\n### ", 1)[0]
    listed = set(re.findall(r"^\| `(\w+)` \|", section, re.M))
    outputs = {name for f in parsed.values() for b in f.get("output", []) for name in b}
    assert listed == set(_variables(parsed)) | outputs
