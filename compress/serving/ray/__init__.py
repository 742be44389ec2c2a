"""compress's third serving engine: Ray Serve running the same unpacked `.mar` with the same
handler classes as TorchServe, as replicas placed on a Ray cluster (a local one on
127.0.0.1, or one joined with `--address`).

- `options`: what `--engine ray` takes beyond the other engines (replicas, autoscaling,
  CPUs and resources a replica, the cluster); Ray-free.
- `launch`: the host side: start `main` in the background, record it in server.json, wait
  until every replica is up and `/ping` answers.
- `main`: that process: a local cluster when no address is given (`cluster`), the
  application deployed, and on SIGTERM removed with what it started.
- `application`: the application `main` deploys (its name, its deployment bound to the
  archive), and its builder for a Serve config file; Ray-free until called.
- `kuberay`: a KubeRay RayService manifest deploying that application on Kubernetes
  (`--emit-kuberay`); Ray-free.
- `replica`: the deployment: each replica imports the archive's handler; `runner`: its
  batches and messages; `routes`: TorchServe's URLs as the replica's FastAPI app.
"""
