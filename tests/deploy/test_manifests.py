"""The KubeRay manifests and the Serve config: rendered from the one values file (no drift), valid
against KubeRay's own CRD schema and Ray's own ServeDeploySchema, pools pinned to their GPU groups,
and no secret in any manifest."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import jsonschema
import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from deploy.app import build_app
from deploy.config import PDServeConfig
from deploy.manifests import ClusterValues, rayservice, render, serve_config, write

ROOT = Path(__file__).resolve().parents[2]
KUBERAY = ROOT / "deploy" / "kuberay"
CRD = ROOT.parent / "shared" / "kuberay" / "ray.io_rayservices.yaml"


@pytest.fixture(scope="module")
def rendered() -> dict[str, str]:
    return render(KUBERAY / "values.yaml")


@functools.cache
def _crd_validator():
    """A validator of KubeRay's RayService schema (the CRD is 1 MB of YAML: parsed once, with
    libyaml where PyYAML has it)."""
    if not CRD.exists():
        pytest.fail(f"KubeRay CRD schema missing at {CRD}")
    crd = yaml.load(CRD.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    schema = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")["schema"]["openAPIV3Schema"]
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def test_committed_files_are_what_the_values_render(rendered):
    for name, text in rendered.items():
        assert (KUBERAY / name).read_text() == text, f"{name} is stale: run `pdserve manifests`"


def test_manifests_spell_every_value_out_without_yaml_anchors(rendered):
    """A value used twice (the Redis labels and selector) is written twice: no ``&id001`` to resolve."""
    for name, text in rendered.items():
        assert not re.search(r"[&*]id\d+", text), name


def test_serve_config_is_valid_for_ray_and_for_pdserve(rendered):
    doc = yaml.safe_load(rendered["serve_config.yaml"])
    schema = ServeDeploySchema.model_validate(doc)
    app = schema.applications[0]
    assert app.import_path == "deploy.app:build_app" and app.external_scaler_enabled
    config = PDServeConfig.model_validate(app.args)
    assert config.worker_host == "auto" and config.engine.device == "cuda"
    assert build_app(app.args) is not None  # the import path builds the application from these args


def test_rayservice_is_valid_against_the_kuberay_crd(rendered):
    doc = yaml.safe_load(rendered["rayservice.yaml"])
    _crd_validator().validate(doc)
    spec = doc["spec"]
    # The RayService embeds exactly the Serve config file.
    assert yaml.safe_load(spec["serveConfigV2"]) == yaml.safe_load(rendered["serve_config.yaml"])
    assert spec["rayClusterConfig"]["authOptions"] == {"mode": "token"}


def test_a_typo_fails_the_crd_check(rendered):
    doc = yaml.safe_load(rendered["rayservice.yaml"])
    doc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["replicas"] = "two"
    with pytest.raises(jsonschema.ValidationError):
        _crd_validator().validate(doc)


def test_pools_are_pinned_to_their_gpu_groups(rendered):
    doc = yaml.safe_load(rendered["rayservice.yaml"])
    groups = {g["groupName"]: g for g in doc["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    args = PDServeConfig.model_validate(
        yaml.safe_load(doc["spec"]["serveConfigV2"])["applications"][0]["args"]
    )
    values = ClusterValues.model_validate(yaml.safe_load((KUBERAY / "values.yaml").read_text()))
    for role, pool, vals in (
        ("prefill", args.prefill, values.prefill),
        ("decode", args.decode, values.decode),
    ):
        group = groups[f"{role}-gpu"]
        (resource,) = pool.resources
        assert resource in group["resources"]  # only this group's nodes advertise it
        pod = group["template"]["spec"]
        assert pod["nodeSelector"] == {"nvidia.com/gpu.product": vals.gpu_product}
        assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == str(int(pool.num_gpus))
        assert group["replicas"] == pool.num_replicas


def test_no_secret_in_any_manifest(rendered):
    for name, text in rendered.items():
        for doc in yaml.safe_load_all(text):
            for env in _all_env(doc):
                if any(k in env["name"] for k in ("PASSWORD", "API_KEY", "TOKEN")):
                    assert "secretKeyRef" in env.get("valueFrom", {}), (name, env)
                if env["name"] == "PDSERVE_REDIS_URL" and "value" in env:
                    assert "$(PDSERVE_REDIS_PASSWORD)" in env["value"], env


def test_listen_addresses_are_loopback_unless_the_values_ask():
    raw = yaml.safe_load((KUBERAY / "values.yaml").read_text())
    assert (raw["serve_host"], raw["dashboard_host"]) == ("0.0.0.0", "0.0.0.0")  # asked for, explicitly
    del raw["serve_host"], raw["dashboard_host"]
    v = ClusterValues.model_validate(raw)
    cfg = serve_config(v)
    assert cfg["http_options"]["host"] == "127.0.0.1"
    assert cfg["applications"][0]["args"]["ingress"]["host"] == "127.0.0.1"
    head = rayservice(v, "")["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert head["rayStartParams"]["dashboard-host"] == "127.0.0.1"


def test_values_without_a_model_are_refused():
    v = ClusterValues.model_validate(
        yaml.safe_load((KUBERAY / "values.yaml").read_text()) | {"model": {"served_model_name": "x"}}
    )
    with pytest.raises(ValueError, match="hf_id or pvc"):
        serve_config(v)


def _all_env(node):
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "env" and isinstance(v, list):
                yield from v
            else:
                yield from _all_env(v)
    elif isinstance(node, list):
        for item in node:
            yield from _all_env(item)


def test_an_autoscaled_pool_larger_than_its_gpu_group_is_refused():
    """Replicas past the group's pods would wait for pods KubeRay never adds."""
    raw = yaml.safe_load((KUBERAY / "values.yaml").read_text())
    raw["autoscaling"]["prefill"] = {**raw["autoscaling"].get("prefill", {}), "max_replicas": 10}
    raw["prefill"]["max_replicas"] = 4
    with pytest.raises(
        ValueError, match=r"autoscaling.prefill.max_replicas \(10\) is more than the prefill group's 4 pods"
    ):
        ClusterValues.model_validate(raw)
    raw["prefill"]["max_replicas"] = 10
    ClusterValues.model_validate(raw)


def test_each_ray_cluster_keeps_its_registry_apart(rendered):
    """KubeRay's NewCluster upgrade runs two Ray clusters on one Redis: every Ray container names
    its registry after its own RayCluster (the pod's ray.io/cluster label)."""
    spec = yaml.safe_load(rendered["rayservice.yaml"])["spec"]["rayClusterConfig"]
    groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
    for group in groups:
        for c in group["template"]["spec"]["containers"]:
            env = {e["name"]: e for e in c["env"]}
            field = env["PDSERVE_REGISTRY_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"]
            assert field == "metadata.labels['ray.io/cluster']", c["name"]


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"decode": {"memory": "96GB"}}, "decode.memory: a Kubernetes quantity such as 64Gi"),
        ({"head_memory": "lots"}, "head_memory: a Kubernetes quantity"),
        ({"redis_storage": "1 Gi"}, "redis_storage: a Kubernetes quantity"),
        ({"head_cpus": 0}, "head_cpus: Input should be greater than or equal to 1"),
        ({"name": "PD_Serve"}, "name: lower-case letters, digits and '-' are needed"),
        ({"prefill": {"gpus": 2}}, "prefill.gpus: Input should be less than or equal to 1"),
        ({"autoscaling": {"decode": {"min_replicas": 0}}}, "decode.min_replicas must be at least 1"),
        ({"prefill": {"replicas": 0}}, "prefill.replicas: Input should be greater than or equal to 1"),
        ({"router_policy": "fastest"}, "router_policy: Input should be 'cache_aware', 'least_load'"),
    ],
)
def test_values_kubernetes_or_the_policy_would_refuse_later_are_refused_in_a_line(tmp_path, change, says):
    raw = yaml.safe_load((KUBERAY / "values.yaml").read_text())
    for key, value in change.items():
        raw[key] = (
            {**raw[key], **value} if isinstance(value, dict) and isinstance(raw.get(key), dict) else value
        )
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump(raw))
    with pytest.raises(ValueError, match=re.escape(says)):
        write(values, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing written


def test_an_output_path_that_is_a_file_is_a_one_line_error(tmp_path):
    taken = tmp_path / "taken"
    taken.write_text("")
    with pytest.raises(ValueError, match=f"cannot write the manifests to {re.escape(str(taken))}"):
        write(KUBERAY / "values.yaml", taken)
