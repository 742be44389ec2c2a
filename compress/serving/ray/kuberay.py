"""A KubeRay RayService manifest (`apiVersion: ray.io/v1`) serving one archive on Kubernetes
with the Ray engine's options: what `compress serve TARGET --engine ray --emit-kuberay PATH`
writes, starting nothing. Its serveConfigV2 deploys the application `main` deploys (its
name, route prefix "/", the same deployment options), through `application.app`.

What the manifest assumes, and its header says, is each cluster's own: an image with
compress (and the Ray of `rayVersion`) installed; the archive unpacked at
/models/MODEL on a PersistentVolumeClaim every pod mounts; the token in a Kubernetes Secret
that every pod's environment reads. The head runs no replica (`num-cpus: 0`): each worker
pod is sized for one replica (its CPUs and custom resources), and there are as many
worker pods as replicas (autoscaled: KubeRay's autoscaler adds and removes them).

Ray-free: the manifest is written where Ray is not installed."""

from __future__ import annotations

import importlib.metadata
import json
import math
import re
import zipfile
from pathlib import Path
from typing import Any

import yaml

from compress.errors import UserError
from compress.runfolder.files import atomic_write_text
from compress.serving.ray.application import IMPORT_PATH, TOKEN_ENV, app_name
from compress.serving.ray.cluster import PROXY_HOOK
from compress.serving.ray.options import RayOptions, deployment_options
from compress.serving.serve_target import ServeTarget, refuse_parallel_config

DEFAULT_IMAGE = "compress-pipeline:latest"  # a placeholder: an image the user builds
RAY_VERSION = "2.50.0"  # the `ray` extra's lowest, when Ray is not installed here
MODELS_CLAIM, MODELS_MOUNT = "compress-models", "/models"
SERVE_PORT = 8000  # Ray Serve's and KubeRay's serve service's
NAME_LENGTH = 47  # KubeRay's longest RayService name (a DNS-1035 label)
SUFFIXES = (".yaml", ".yml")


def write_manifest(target: ServeTarget, path: Path, options: RayOptions, *,
                   image: str | None = None, auth: bool = True) -> dict[str, Any]:
    """Check the request, write the RayService manifest to `path` atomically; return it.
    A path that is no file to write, or an option a RayService cannot take, is a
    UserError."""
    if options.address is not None:
        raise UserError("--address with --emit-kuberay: the RayService runs its own cluster, "
                        "which KubeRay starts; leave --address out")
    options.check()
    _check_path(path)
    image = image or DEFAULT_IMAGE
    manifest = rayservice(target, options, image=image, auth=auth)
    text = header(target, path, manifest["metadata"]["name"], image,
                  manifest["spec"]["rayClusterConfig"]["rayVersion"], auth) + dump(manifest)
    try:
        atomic_write_text(path, text)
    except OSError as exc:
        raise UserError(f"--emit-kuberay {path}: cannot write it ({exc.strerror or exc})") from None
    return manifest


def _check_path(path: Path) -> None:
    if path.suffix not in SUFFIXES:
        raise UserError(f"--emit-kuberay {path}: expected a .yaml file to write")
    if path.is_dir():
        raise UserError(f"--emit-kuberay {path}: a folder; give a file path in it")
    if not path.parent.is_dir():
        raise UserError(f"--emit-kuberay {path}: no folder {path.parent} to write it in")


def rayservice(target: ServeTarget, options: RayOptions, *, image: str = DEFAULT_IMAGE,
               auth: bool = True) -> dict[str, Any]:
    """The RayService serving `target`'s archive with `options`, as a mapping."""
    config = archive_config(target.mar)
    handler = config.get("handler") or {}
    continuous = bool(config.get("asyncCommunication"))
    batch_size = int((handler.get("rows") if continuous else None) or config.get("batchSize")
                     or 1)
    threads = int(handler.get("threads") or 1)
    deployment = deployment_options(options, batch_size, threads)
    name = resource_name(target.model_name)
    args: dict[str, Any] = {"model_name": target.model_name,
                            "model_dir": f"{MODELS_MOUNT}/{target.model_name}",
                            "token_env": TOKEN_ENV if auth else None}
    serve_config = {
        "proxy_location": "EveryNode",
        "http_options": {"host": "0.0.0.0", "port": SERVE_PORT},
        "applications": [{"name": app_name(target.model_name), "route_prefix": "/",
                          "import_path": IMPORT_PATH, "args": args,
                          "deployments": [{"name": target.model_name, **deployment}]}]}
    actor = deployment["ray_actor_options"]
    pod_cpus = max(1, math.ceil(actor["num_cpus"]))  # `ray start --num-cpus` takes a whole
    worker_params = {"num-cpus": str(pod_cpus)}
    if actor.get("resources"):
        # KubeRay puts each value on `ray start`'s shell command line: quoted JSON
        quoted = json.dumps(actor["resources"]).replace('"', '\\"')
        worker_params["resources"] = f'"{quoted}"'
    low, high = options.autoscale or (options.replicas or 1,) * 2
    # every node runs a proxy (EveryNode): each gets the middleware for lost replicas
    env = [{"name": hook, "value": path} for hook, path in PROXY_HOOK.items()]
    env += ([{"name": TOKEN_ENV, "valueFrom": {"secretKeyRef": {
        "name": f"{name}-token", "key": "token"}}}] if auth else [])
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/name": name,
                                              "app.kubernetes.io/managed-by": "compress"}},
        "spec": {
            "serveConfigV2": dump(serve_config),
            "rayClusterConfig": {
                "rayVersion": ray_version(),
                "enableInTreeAutoscaling": options.autoscale is not None,
                "headGroupSpec": {
                    "rayStartParams": {"num-cpus": "0", "dashboard-host": "0.0.0.0"},
                    "template": _pod("ray-head", image, 1, env)},
                "workerGroupSpecs": [{
                    "groupName": "replicas", "replicas": max(low, 1), "minReplicas": low,
                    "maxReplicas": high, "rayStartParams": worker_params,
                    "template": _pod("ray-worker", image, pod_cpus, env)}]}}}


def _pod(container: str, image: str, cpus: int, env: list[dict[str, Any]]) -> dict[str, Any]:
    """A pod template: the image, `cpus` CPUs requested (and its limit), the token's
    variable and the archive's volume, read-only."""
    spec: dict[str, Any] = {"name": container, "image": image,
                            "resources": {"requests": {"cpu": str(cpus)},
                                          "limits": {"cpu": str(cpus)}},
                            "volumeMounts": [{"name": "models", "mountPath": MODELS_MOUNT,
                                              "readOnly": True}]}
    if env:
        spec["env"] = env
    return {"spec": {"containers": [spec], "volumes": [{
        "name": "models",
        "persistentVolumeClaim": {"claimName": MODELS_CLAIM, "readOnly": True}}]}}


def archive_config(mar: Path) -> dict[str, Any]:
    """The archive's model-config.yaml ({} when it has none); a UserError for a
    parallelType archive, whose workers are torchrun jobs only TorchServe starts."""
    with zipfile.ZipFile(mar) as archive:
        names = archive.namelist()
        config = (yaml.safe_load(archive.read("model-config.yaml"))
                  if "model-config.yaml" in names else None) or {}
    refuse_parallel_config(mar, config)
    return config


def resource_name(model_name: str) -> str:
    """The RayService's name: compress-MODEL as a DNS-1035 label KubeRay takes."""
    name = re.sub(r"[^a-z0-9-]+", "-", f"compress-{model_name}".lower())
    return re.sub(r"-+", "-", name)[:NAME_LENGTH].rstrip("-")


def ray_version() -> str:
    """The installed Ray's version (read without importing it), else RAY_VERSION."""
    try:
        return importlib.metadata.version("ray")
    except importlib.metadata.PackageNotFoundError:
        return RAY_VERSION


class _Dumper(yaml.SafeDumper):
    """YAML with multi-line strings (serveConfigV2) as literal blocks, and no anchors (the
    pods' shared env list is written out in each)."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _string(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    style = "|" if "\n" in text else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


_Dumper.add_representer(str, _string)


def dump(data: dict[str, Any]) -> str:
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, default_flow_style=False)


def header(target: ServeTarget, path: Path, name: str, image: str, ray: str,
           auth: bool) -> str:
    """The manifest's comment lines: what it assumes, and the commands that meet it."""
    model = target.model_name
    placeholder = (" (a placeholder: build such an image, then --kuberay-image)"
                   if image == DEFAULT_IMAGE else "")
    lines = [
        f"RayService {name}: {target.mar.name} served by Ray Serve on Kubernetes (KubeRay),",
        "written by `compress serve --engine ray --emit-kuberay`. It assumes:",
        f"- the image {image}{placeholder}",
        f"  has compress installed (pip install 'compress-pipeline[ray]') with Ray {ray}",
        f"- the archive unpacked at {MODELS_MOUNT}/{model} on the PersistentVolumeClaim",
        f"  {MODELS_CLAIM} (ReadOnlyMany or ReadWriteMany), mounted on every pod at "
        f"{MODELS_MOUNT}:",
        f"  unzip {target.mar.name} -d <the volume>/{model}"]
    lines += ([f"- the token in the Secret {name}-token (key: token), read as {TOKEN_ENV}",
               "  on every pod (the replicas keep only its SHA-256):",
               f"  kubectl create secret generic {name}-token --from-literal=token="
               "\"$(python3 -c 'import secrets; print(secrets.token_urlsafe(24))')\""]
              if auth else
              ["- no token (--no-auth): whoever reaches the serve service is answered"])
    lines += [f"Then: kubectl apply -f {path.name}; inside the cluster the model answers at",
              f"http://{name}-serve-svc:{SERVE_PORT}/predictions/{model}.",
              "Memory requests and limits are left to you."]
    return "".join(f"# {line}\n" for line in lines)
