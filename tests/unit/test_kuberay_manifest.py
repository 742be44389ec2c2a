"""`compress serve ARCHIVE --engine ray --emit-kuberay PATH`, in this process and without a
cluster: each manifest is valid against KubeRay's RayService CRD (vendored in
tests/data/kuberay/, checked with jsonschema as `kubectl apply` checks it, unknown fields
included) and its serveConfigV2 deploys what `compress serve --engine ray` deploys (the same
application name, route prefix and deployment options, through an importable application
builder). A manifest with a wrong field fails the same check; bad requests are one line,
exit 2, and write nothing; emitting needs no Ray."""

from __future__ import annotations

import copy
import importlib
import inspect
import json
import subprocess
import sys
import types
import zipfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import cli

jsonschema = pytest.importorskip("jsonschema")

CRD = Path(__file__).resolve().parents[1] / "data" / "kuberay" / "ray.io_rayservices.yaml"
MODEL = "tiny_onnx"
CONFIG = {"minWorkers": 1, "maxWorkers": 1, "batchSize": 8, "maxBatchDelay": 50,
          "handler": {"threads": 2, "task": "classification"}}


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    """The RayService CRD's v1 openAPIV3Schema."""
    crd = yaml.load(CRD.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return v1["schema"]["openAPIV3Schema"]


def strict(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with unknown fields refused, as the API server's strict field validation
    refuses them (kubectl apply's default): every object that lists its properties and
    neither allows more nor preserves unknown fields gets additionalProperties: false."""
    schema = copy.deepcopy(schema)
    stack: list[Any] = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if ("properties" in node and "additionalProperties" not in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")):
                node["additionalProperties"] = False
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return schema


@pytest.fixture(scope="module")
def validator(schema):
    return jsonschema.Draft7Validator(strict(schema))


def fake_archive(folder: Path, config: dict[str, Any], name: str = MODEL) -> Path:
    """A `.mar` holding what the manifest reads: its manifest and model-config.yaml."""
    folder.mkdir(parents=True, exist_ok=True)
    mar = folder / f"{name}.mar"
    with zipfile.ZipFile(mar, "w") as archive:
        archive.writestr("MAR-INF/MANIFEST.json", json.dumps(
            {"model": {"modelName": name, "handler": "handler.py", "modelVersion": "1.0"}}))
        archive.writestr("model-config.yaml", yaml.safe_dump(config))
    return mar


def emit(monkeypatch, capsys, mar: Path, out: Path, *args: str) -> tuple[str, dict, dict]:
    """(the file's text, the manifest, its serveConfigV2) written by the CLI."""
    code, stdout, err = cli(monkeypatch, capsys, "serve", str(mar), "--engine", "ray",
                            "--emit-kuberay", str(out), *args)
    assert code == 0, err
    assert f"written: {out}" in stdout and "nothing started" in stdout
    text = out.read_text()
    manifest = yaml.safe_load(text)
    return text, manifest, yaml.safe_load(manifest["spec"]["serveConfigV2"])


def actor(cpus: float, resources: dict | None = None) -> dict:
    return {"num_cpus": cpus, **({"resources": resources} if resources else {})}


CASES = {  # options: (the deployment's options, worker pods (replicas, min, max), pod CPUs)
    "defaults": ([], {"ray_actor_options": actor(2.0), "max_ongoing_requests": 16,
                      "num_replicas": 1}, (1, 1, 1), "2"),
    "replicas": (["--replicas", "3", "--cpus-per-replica", "1.5", "--replica-resources",
                  '{"replica_slot": 1}'],
                 {"ray_actor_options": actor(1.5, {"replica_slot": 1.0}),
                  "max_ongoing_requests": 16, "num_replicas": 3}, (3, 3, 3), "2"),
    "autoscale": (["--autoscale", "0,4", "--downscale-delay", "30"],
                  {"ray_actor_options": actor(2.0), "max_ongoing_requests": 16,
                   "autoscaling_config": {"min_replicas": 0, "max_replicas": 4,
                                          "initial_replicas": 1, "target_ongoing_requests": 8,
                                          "upscale_delay_s": 2.0, "downscale_delay_s": 30.0}},
                  (1, 0, 4), "2"),
    "autoscale_no_auth": (["--autoscale", "2,5", "--cpus-per-replica", "0.25", "--no-auth",
                           "--kuberay-image", "registry.example.com/compress:1.0"],
                          {"ray_actor_options": actor(0.25), "max_ongoing_requests": 16,
                           "autoscaling_config": {
                               "min_replicas": 2, "max_replicas": 5, "initial_replicas": 2,
                               "target_ongoing_requests": 8, "upscale_delay_s": 2.0,
                               "downscale_delay_s": 600.0}}, (2, 2, 5), "1"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_manifest_is_a_valid_rayservice_deploying_the_ray_engines_app(
        case: str, validator, tmp_path: Path, monkeypatch, capsys) -> None:
    args, deployment, (pods, low, high), pod_cpus = CASES[case]
    mar = fake_archive(tmp_path / "archive", CONFIG)
    out = tmp_path / "rayservice.yaml"
    text, manifest, serve_config = emit(monkeypatch, capsys, mar, out, *args)

    errors = sorted(validator.iter_errors(manifest), key=lambda e: list(e.absolute_path))
    assert not errors, [f"{list(e.absolute_path)}: {e.message}" for e in errors]
    assert (manifest["apiVersion"], manifest["kind"]) == ("ray.io/v1", "RayService")
    assert manifest["metadata"]["name"] == "compress-tiny-onnx"
    assert text.startswith("# RayService compress-tiny-onnx")  # its assumptions, stated
    assert sorted(p.name for p in tmp_path.iterdir()) == ["archive", "rayservice.yaml"]

    (application,) = serve_config["applications"]
    assert application["name"] == f"compress-{MODEL}"  # `main`'s application name
    assert application["route_prefix"] == "/"
    assert application["deployments"] == [{"name": MODEL, **deployment}]
    auth = "--no-auth" not in args
    assert application["args"] == {"model_name": MODEL, "model_dir": f"/models/{MODEL}",
                                   "token_env": "COMPRESS_SERVE_TOKEN" if auth else None}

    cluster = manifest["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is ("--autoscale" in args)
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"  # no replica there
    (workers,) = cluster["workerGroupSpecs"]
    assert (workers["replicas"], workers["minReplicas"], workers["maxReplicas"]) == (
        pods, low, high)
    assert workers["rayStartParams"]["num-cpus"] == pod_cpus
    resources = deployment["ray_actor_options"].get("resources")
    if resources:  # each worker pod offers one replica's custom resources
        assert json.loads(json.loads(workers["rayStartParams"]["resources"])) == resources
    image = args[args.index("--kuberay-image") + 1] if "--kuberay-image" in args else (
        "compress-pipeline:latest")
    for group, cpus in ((cluster["headGroupSpec"], "1"), (workers, pod_cpus)):
        pod = group["template"]["spec"]
        (container,) = pod["containers"]
        assert container["image"] == image
        assert container["resources"]["requests"]["cpu"] == cpus
        assert container["volumeMounts"] == [{"name": "models", "mountPath": "/models",
                                              "readOnly": True}]
        assert pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == "compress-models"
        secret = [e["valueFrom"]["secretKeyRef"] for e in container.get("env", [])
                  if e["name"] == "COMPRESS_SERVE_TOKEN"]
        assert secret == ([{"name": "compress-tiny-onnx-token", "key": "token"}] if auth
                          else [])
        hook = {e["name"]: e.get("value") for e in container["env"]}
        assert hook["RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"] == (
            "compress.serving.ray.routes:proxy_middlewares")  # each node's proxy


def test_a_continuous_archive_holds_two_batches_of_decode_rows(validator, tmp_path: Path,
                                                              monkeypatch, capsys) -> None:
    config = {"batchSize": 1, "asyncCommunication": True, "handler": {"threads": 4, "rows": 6}}
    mar = fake_archive(tmp_path, config, name="llm.int8")
    _, manifest, serve_config = emit(monkeypatch, capsys, mar, tmp_path / "llm.yml",
                                     "--replicas", "2")
    assert not list(validator.iter_errors(manifest))
    assert manifest["metadata"]["name"] == "compress-llm-int8"  # a DNS-1035 label
    (deployment,) = serve_config["applications"][0]["deployments"]
    assert deployment == {"name": "llm.int8", "ray_actor_options": {"num_cpus": 4.0},
                          "max_ongoing_requests": 12, "num_replicas": 2}


def test_the_import_path_is_an_application_builder(tmp_path: Path, monkeypatch,
                                                   capsys) -> None:
    _, _, serve_config = emit(monkeypatch, capsys, fake_archive(tmp_path, CONFIG),
                              tmp_path / "s.yaml")
    (application,) = serve_config["applications"]
    module, name = application["import_path"].split(":")
    builder = getattr(importlib.import_module(module), name)
    # what Ray Serve's config deploy calls: a plain function of one argument, the args
    assert isinstance(builder, types.FunctionType)
    assert len(inspect.signature(builder).parameters) == 1


def test_ray_serve_reads_the_config_and_builds_the_deployment(tmp_path: Path, monkeypatch,
                                                             capsys) -> None:
    pytest.importorskip("ray.serve")
    from ray.serve import Application
    from ray.serve.schema import ServeDeploySchema

    from compress.serving.handler_host.handler import MAX_REQUEST_SIZE, token_digest

    _, _, serve_config = emit(monkeypatch, capsys, fake_archive(tmp_path, CONFIG),
                              tmp_path / "s.yaml", "--autoscale", "1,3")
    ServeDeploySchema.model_validate(serve_config)
    (application,) = serve_config["applications"]
    module, name = application["import_path"].split(":")
    builder = getattr(importlib.import_module(module), name)
    monkeypatch.delenv("COMPRESS_SERVE_TOKEN", raising=False)
    with pytest.raises(RuntimeError, match="COMPRESS_SERVE_TOKEN is not set"):
        builder(application["args"])
    monkeypatch.setenv("COMPRESS_SERVE_TOKEN", "s3cret\n")
    built = builder(application["args"])
    assert isinstance(built, Application)
    deployment = built._bound_deployment  # the serveConfigV2's `deployments` entry's name
    assert deployment.name == MODEL
    assert deployment.init_args == (f"/models/{MODEL}", None, token_digest("s3cret"),
                                    MAX_REQUEST_SIZE)


def test_a_wrong_field_fails_the_crd(schema, validator, tmp_path: Path, monkeypatch,
                                     capsys) -> None:
    _, manifest, _ = emit(monkeypatch, capsys, fake_archive(tmp_path, CONFIG),
                          tmp_path / "s.yaml", "--replicas", "2")
    wrong_type = copy.deepcopy(manifest)
    wrong_type["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["replicas"] = "two"
    missing = copy.deepcopy(manifest)
    del missing["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["groupName"]
    unknown = copy.deepcopy(manifest)
    cluster = unknown["spec"]["rayClusterConfig"]
    cluster["enableInTreeAutoscale"] = cluster.pop("enableInTreeAutoscaling")
    plain = jsonschema.Draft7Validator(schema)
    for bad in (wrong_type, missing):
        assert not plain.is_valid(bad) and not validator.is_valid(bad)
    assert plain.is_valid(unknown)  # a typo passes a schema that ignores unknown fields,
    (error,) = validator.iter_errors(unknown)  # not kubectl's strict check
    assert "enableInTreeAutoscale" in error.message


@pytest.mark.parametrize(("args", "message"), [
    (["--engine", "litserve", "--emit-kuberay", "{out}"], "add --engine ray"),
    (["--engine", "ray", "--kuberay-image", "x:1"], "give both"),
    (["--engine", "ray", "--emit-kuberay", "{out}", "--address", "10.0.0.1:6379"],
     "leave --address out"),
    (["--engine", "ray", "--emit-kuberay", "{out}", "--replicas", "2", "--autoscale", "1,2"],
     "contradict"),
    (["--engine", "ray", "--emit-kuberay", "{out}", "--downscale-delay", "5"], "give both"),
    (["--engine", "ray", "--emit-kuberay", "{out}", "--autoscale", "3,1"], "MIN <= MAX"),
    (["--engine", "ray", "--emit-kuberay", "{out}", "--batch-size", "4", "--threads", "2"],
     "--batch-size, --threads with --emit-kuberay"),
    (["--engine", "ray", "--emit-kuberay", "{out}", "--stop"], "--stop with --emit-kuberay"),
    (["--engine", "ray", "--emit-kuberay", "{tmp}/manifest.json"], "expected a .yaml file"),
    (["--engine", "ray", "--emit-kuberay", "{tmp}/folder.yaml"], "a folder"),
    (["--engine", "ray", "--emit-kuberay", "{tmp}/missing/rayservice.yaml"], "no folder"),
    (["--engine", "ray", "--emit-kuberay", "{tmp}/archive.mar/rayservice.yaml"], "no folder"),
])
def test_bad_requests_are_one_line_and_write_nothing(args: list[str], message: str,
                                                     tmp_path: Path, monkeypatch,
                                                     capsys) -> None:
    mar = fake_archive(tmp_path / "archive", CONFIG)
    (tmp_path / "folder.yaml").mkdir()
    (tmp_path / "archive.mar").write_bytes(b"")
    before = sorted(p.name for p in tmp_path.rglob("*"))
    filled = [a.format(out=tmp_path / "rayservice.yaml", tmp=tmp_path) for a in args]
    code, out, err = cli(monkeypatch, capsys, "serve", str(mar), *filled)
    assert code == 2 and err.count("\n") == 1 and message in err, err
    assert "Traceback" not in out + err
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def test_a_parallel_archive_is_refused_in_one_line(tmp_path: Path, monkeypatch,
                                                   capsys) -> None:
    mar = fake_archive(tmp_path, {**CONFIG, "parallelType": "tp"})
    code, _, err = cli(monkeypatch, capsys, "serve", str(mar), "--engine", "ray",
                       "--emit-kuberay", str(tmp_path / "s.yaml"))
    assert code == 2 and err.count("\n") == 1 and "torchrun" in err, err
    assert not (tmp_path / "s.yaml").exists()


def test_a_manifest_is_replaced_whole_and_needs_no_ray(tmp_path: Path) -> None:
    """In a process where `import ray` fails, the manifest is written over an older one
    through a temporary file and a rename: no temporary file is left."""
    mar = fake_archive(tmp_path / "archive", CONFIG)
    out = tmp_path / "rayservice.yaml"
    out.write_text("an older manifest\n")
    code = ("import sys; sys.modules['ray'] = None\n"
            "from compress.cli.main import main\n"
            f"sys.argv = ['compress', 'serve', {str(mar)!r}, '--engine', 'ray', "
            f"'--replicas', '2', '--emit-kuberay', {str(out)!r}]\n"
            "main()\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert yaml.safe_load(out.read_text())["kind"] == "RayService"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["archive", "rayservice.yaml"]
