"""The Ray Serve application of one unpacked `.mar`: its name, and its deployment bound to
its arguments. `main` deploys it with `serve.run`; a Serve config file (a KubeRay
RayService's serveConfigV2, `kuberay`) names `app`, its application builder, as the
application's import path (IMPORT_PATH) and gives it the config's `args`.

Ray-free until called: the command line names the import path where Ray is not installed."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ray.serve import Application

IMPORT_PATH = "compress.serving.ray.application:app"
TOKEN_ENV = "COMPRESS_SERVE_TOKEN"  # a config's `token_env` default: the token, on every pod


def app_name(model_name: str) -> str:
    """The application's name on the cluster (one archive, one application)."""
    return f"compress-{model_name}"


def bound(model_name: str, model_dir: str, logs: str | None, digest: str | None,
          max_request_size: int, options: dict[str, Any]) -> Application:
    """The archive's deployment (named `model_name`, with Ray Serve's `options`) bound to
    the replica's arguments: the unpacked folder, the folder of the handler's log (None:
    Ray's own logging), the token's SHA-256 (None: no token) and the largest body."""
    from compress.serving.ray.replica import HandlerReplica

    deployment = HandlerReplica.options(name=model_name, **options)
    return deployment.bind(model_dir, logs, digest, max_request_size)


def app(args: dict[str, Any]) -> Application:
    """Ray Serve's application builder for a config file. `args`: `model_name`, `model_dir`
    (the unpacked archive, at that path on every node), `token_env` (the environment
    variable that holds the token on every node; absent or null: no token) and
    optionally `max_request_size`. The replicas get only the token's SHA-256; the
    deployment's options are the config's own (its `deployments` entry)."""
    from compress.serving.handler_host.handler import MAX_REQUEST_SIZE, token_digest

    digest = None
    if args.get("token_env"):
        token = os.environ.get(args["token_env"], "").strip()
        if not token:
            raise RuntimeError(f"{args['token_env']} is not set on this node: the token "
                               f"(a Kubernetes Secret in the pods' environment) is missing")
        digest = token_digest(token)
    return bound(str(args["model_name"]), str(args["model_dir"]), args.get("logs"), digest,
                 int(args.get("max_request_size") or MAX_REQUEST_SIZE), {})
